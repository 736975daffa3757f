// Validation of the FFI operands and their leading batch dims B... (see the
// contract in cpu_kernels.h), and grouping of the token rows in use by weight
// matrix so that every matrix is decoded once per call, however its tokens
// arrive (an expert stack, a vmapped axis, or a broadcast matrix), and a
// matrix without tokens in use is not read at all.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "cpu_row_kernels.h"
#include "xla/ffi/api/ffi.h"

namespace qmoe::cpu {

using Dims = xla::ffi::Span<const int64_t>;

// One compressed matrix inside the operands.
struct WeightMatrix {
  const uint16_t* codes;       // the matrix's code stream
  const int32_t* row_offsets;  // [rows + 1], validated
  const uint16_t* minmax;      // bf16 bits, [rows][2] = (min, max)
  int64_t batch_index;         // flat index over B... of its first use, for messages
};

// The compressed operands of one call, validated.
struct CompressedOperands {
  DictionaryView dictionary;
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t padded_cols = 0;
  std::vector<int64_t> batch;                 // B..., the result's leading dims
  int64_t batch_size = 1;                     // product of B...
  std::vector<WeightMatrix> matrix_of_batch;  // one per flat index over B...
  const int32_t* row_offsets = nullptr;       // the row_offsets operand, not yet validated
  int64_t offsets_matrices = 0;               // matrices in the row_offsets operand
  int64_t n_codes = 0;                        // codewords per matrix in the codes operand
};

// Token rows in use of one weight matrix: flat row indices into the dense
// operand (viewed as [*, in_width]) and the result (viewed as [*, out_width]).
struct TokenGroup {
  WeightMatrix matrix;
  std::vector<int64_t> in_rows;
  std::vector<int64_t> out_rows;
};

// Checks the shapes of masks, slots, words, codes, row_offsets and minmax against a
// result with leading dims `batch` and `cols` columns and locates each batch
// entry's matrix; reads no row_offsets (CheckRowOffsets does, for the
// matrices a call reads). `op` prefixes messages.
xla::ffi::Error CheckCompressed(const char* op, xla::ffi::Buffer<xla::ffi::U32> masks,
                                xla::ffi::Buffer<xla::ffi::U8> slots,
                                xla::ffi::Buffer<xla::ffi::U32> words,
                                xla::ffi::Buffer<xla::ffi::U16> codes,
                                xla::ffi::Buffer<xla::ffi::S32> row_offsets,
                                xla::ffi::Buffer<xla::ffi::BF16> minmax, Dims batch, int64_t cols,
                                CompressedOperands* operands);

// Validates the row_offsets of every matrix that a batch entry with tokens in
// use reads (used_tokens[b] > 0), or of every matrix when used_tokens is
// null: they start at 0, never decrease and end within codes.
xla::ffi::Error CheckRowOffsets(const char* op, const CompressedOperands& operands,
                                const std::vector<int64_t>* used_tokens);

// Checks counts [B'...] (B' broadcasting to `batch`) and sets used_tokens[b]
// for each result batch index b: its count clamped to [0, tokens].
xla::ffi::Error CheckCounts(const char* op, xla::ffi::Buffer<xla::ffi::S32> counts,
                            const std::vector<int64_t>& batch, int64_t tokens,
                            std::vector<int64_t>* used_tokens);

// Checks a dense operand [B'..., tokens, width] whose B'... broadcasts to
// `batch`; sets `in_batch_index[b]`, the operand's flat batch index for each
// result batch index b.
xla::ffi::Error CheckDense(const char* op, const char* name, Dims dims,
                           const std::vector<int64_t>& batch, int64_t tokens, int64_t width,
                           std::vector<int64_t>* in_batch_index);

// Groups the result's token rows in use (the first used_tokens[b] of the
// `tokens` rows of each batch entry b) by weight matrix; a matrix without
// tokens in use gets no group.
std::vector<TokenGroup> GroupTokens(const CompressedOperands& operands,
                                    const std::vector<int64_t>& in_batch_index, int64_t tokens,
                                    const std::vector<int64_t>& used_tokens);

// The message for a row that does not decode to padded_cols weights.
xla::ffi::Error BadRowError(const char* op, const CompressedOperands& operands,
                            const WeightMatrix& matrix, int64_t row);

// Host-side shape checks, shared with the CUDA handlers (cuda_operands.cc,
// cuda_validate.cc), so that both platforms word their errors alike.

std::string ShapeString(Dims dims);

// The product of the leading dims B... of [B..., trailing dims] (1 when there are none).
inline int64_t LeadingProduct(Dims dims, size_t trailing) {
  int64_t product = 1;
  for (size_t i = 0; i + trailing < dims.size(); ++i) product *= dims[i];
  return product;
}

// " of batch index 3 (of leading dims [4, 2])" where the call has leading dims, else "".
std::string OfBatch(const std::vector<int64_t>& batch, int64_t index);

// Dictionary forms carry no batch: [1..., 65536, width], or [1..., 65536] for width 0.
xla::ffi::Error CheckDictionaryForm(const char* op, const char* name, Dims dims, int64_t width,
                                    const char* source);

// The dense operand or result of matmul / matmul_t: its name, dtype, dims and
// what its last dim is ("cols" or "rows"), for messages.
struct DenseArg {
  const char* name;
  xla::ffi::DataType type;
  Dims dims;
  const char* width;
};

// The dense operand `in` is float32 or bfloat16, and the result `out` has its
// dtype and rank ([B..., N, width], rank >= 2).
xla::ffi::Error CheckDenseArgs(const char* op, const DenseArg& in, const DenseArg& out);

// dequantize's result is [B..., rows, cols] with the `cols` attribute.
xla::ffi::Error CheckDequantizeResult(const char* op, Dims dims, int64_t cols);

// Checks the shapes of masks, slots, words, minmax [B'..., rows, 2], codes
// [B'..., n_codes] and row_offsets [B'..., rows + 1] (each B' broadcasting to
// `batch`) and that cols >= 0; sets `rows`. Nothing is read from the buffers.
xla::ffi::Error CheckCompressedShapes(
    const char* op, xla::ffi::Buffer<xla::ffi::U32> masks, xla::ffi::Buffer<xla::ffi::U8> slots,
    xla::ffi::Buffer<xla::ffi::U32> words, xla::ffi::Buffer<xla::ffi::U16> codes,
    xla::ffi::Buffer<xla::ffi::S32> row_offsets, xla::ffi::Buffer<xla::ffi::BF16> minmax,
    const std::vector<int64_t>& batch, int64_t cols, int64_t* rows);

// Checks that `dims` is [B'..., trailing...] with B' broadcasting to `batch`
// (same rank, each dim equal or 1) and the trailing dims as given (-1: any).
xla::ffi::Error CheckBroadcastShape(const char* op, const char* name, Dims dims,
                                    const std::string& expected, const std::vector<int64_t>& batch,
                                    const std::vector<int64_t>& trailing);

}  // namespace qmoe::cpu
