// Operand checks of the CUDA handlers (contract in cpu_kernels.h) and the
// layout their kernels read.
//
// The operands live on the device, so the host checks what their dimensions
// alone tell: ranks, shapes, broadcasting of the leading dims B..., the
// kernels' index limits. What only their bytes tell (row_offsets monotone and
// within codes, rows decoding to the right width) is checked on the device
// (cuda_validate.h).
//
// Trailing leading dims over which every compressed operand and the counts
// broadcast while the dense operand does not (what vmap of an op over tokens
// produces) are folded into the token dim, so that such a matrix is decoded
// once for all of those tokens.
#pragma once

#include <cstdint>
#include <vector>

#include "cuda_batch.h"
#include "xla/ffi/api/ffi.h"

namespace qmoe::cuda {

// Weight positions inside a row are int32 in the kernels.
inline constexpr int64_t kMaxCols = int64_t{1} << 30;

// A call's operands as the kernels see them.
struct Layout {
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t n_codes = 0;                // codewords per matrix in `codes` (padding included)
  int64_t offsets_matrices = 0;       // matrices in the row_offsets operand
  std::vector<int64_t> result_batch;  // B... of the result, for messages
  int64_t fold = 1;                   // result batch entries folded into each token group
  int64_t entry_tokens = 0;           // N: tokens of one result batch entry, as counts count
  int64_t tokens = 0;                 // tokens per matrix after folding: N * fold
  BatchMap batch;                     // leading dims left after folding
};

// The dense operand of matmul (x, width cols) or matmul_t (g, width rows), and
// the counts of its tokens in use.
struct DenseOperand {
  const char* name;
  xla::ffi::Span<const int64_t> dims;  // [B..., N, width]
  bool width_is_rows;
  xla::ffi::Span<const int64_t> counts_dims;  // [B...]
};

// Checks masks, slots, words, codes, row_offsets, minmax and (if given) the dense
// operand and its counts against a result with leading dims `batch`, N =
// `tokens` and `cols` columns of W; fills `layout`. `op` prefixes messages.
xla::ffi::Error CheckOperands(const char* op, xla::ffi::Buffer<xla::ffi::U32> masks,
                              xla::ffi::Buffer<xla::ffi::U8> slots,
                              xla::ffi::Buffer<xla::ffi::U32> words,
                              xla::ffi::Buffer<xla::ffi::U16> codes,
                              xla::ffi::Buffer<xla::ffi::S32> row_offsets,
                              xla::ffi::Buffer<xla::ffi::BF16> minmax,
                              xla::ffi::Span<const int64_t> batch, int64_t tokens, int64_t cols,
                              const DenseOperand* dense, Layout* layout);

}  // namespace qmoe::cuda
