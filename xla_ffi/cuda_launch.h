// Launchers of the CUDA kernels (one .cu file per op) and the launch
// heuristics they share. The FFI handlers (cuda_kernels.cc) check operands and
// call these; each launcher enqueues on `stream` and returns
// cudaGetLastError().
//
// Heuristics, read off the call and the device rather than fixed for one GPU:
//   team size   lanes per row (4, 8, 16, 32) from the mean codewords per row,
//               so narrow matrices put several rows in one warp;
//   token tile  tokens decoded together (1, 2, 4, 8): the next power of two
//               of N, halved until the tile of x fits kStagedBytes of shared
//               memory (past that, x is read through L1 instead);
//   grid        rows x token tiles x batch, with the row dim cut to about two
//               waves of resident blocks (multiprocessor count times the
//               occupancy of that kernel at that shared-memory size); each
//               team then loops over rows, so x is staged once per block.
//               The matmul kernels fold the batch into the row dim instead
//               (x blocks x token tiles) and hand out rows of the entries
//               with tokens in use only (cuda_tokens.cuh), so that one
//               expert in use gets the whole grid.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda_batch.h"

namespace qmoe::cuda {

inline constexpr int kBlockThreads = 256;
// Shared memory per block for a staged tile of x: within the default 48 KiB
// that every architecture grants without opting in, and leaving room for
// several blocks per multiprocessor.
inline constexpr int64_t kStagedBytes = 48 * 1024;

// A call's compressed operands on the device.
struct CompressedView {
  const uint2* masks;          // [65536] (plus mask | pair count << 28, minus mask)
  const uint16_t* codes;       // per matrix [n_codes]
  const int32_t* row_offsets;  // per matrix [rows + 1], unchecked bytes
  const uint16_t* minmax;      // bf16 bits, per matrix [rows][2] = (min, max)
  int64_t n_codes;
  int32_t rows;
  int32_t cols;
  BatchMap batch;
};

// The counts operand: tokens in use per batch entry (cpu_kernels.h).
struct TokenCounts {
  const int32_t* counts;  // on the device, located by MatrixIndex::counts
  int64_t entry_tokens;   // N, the tokens of one result batch entry; a count is clamped to it
};

// The dense operand and result of matmul (x, y) or matmul_t (g, dx).
struct DenseView {
  const void* input;
  void* output;
  bool bf16;           // else float32
  int64_t tokens;      // per matrix, after folding
  TokenCounts counts;  // which of them are in use
};

// y = W x, written in the dtype of x; zero rows for the tokens not in use.
cudaError_t LaunchMatmul(const CompressedView& w, const DenseView& x_y, int device,
                         cudaStream_t stream);

// sums[B, N, cols] += Wᵀ g in float32 for the tokens in use (atomically;
// zero `sums` first).
cudaError_t LaunchMatmulTransposed(const CompressedView& w, const DenseView& g, float* sums,
                                   int device, cudaStream_t stream);

// out[i] = bf16(sums[i]), rounded to nearest even.
cudaError_t LaunchRoundToBf16(const float* sums, uint16_t* out, int64_t count, int device,
                              cudaStream_t stream);

// Writes each row's nonzero weights into `weights` (bf16 bits, [B, rows, cols],
// zero it first).
cudaError_t LaunchDequantize(const CompressedView& w, uint16_t* weights, int device,
                             cudaStream_t stream);

// Device-side validation (cuda_validate.h). Each check lowers
// *first_failure (start it at kNoFailure) with atomicMin to the key of what
// it finds, so the smallest key wins.
inline constexpr unsigned long long kNoFailure = ~0ull;

// Bad row_offsets: key matrix << 33 | kind << 31 | entry, over the row_offsets
// operand's own matrices; kinds in the order the CPU handlers check them.
enum OffsetsFailure : unsigned { kOffsetsStart = 0, kOffsetsDecrease = 1, kOffsetsEnd = 2 };
cudaError_t LaunchCheckOffsets(const int32_t* row_offsets, int64_t matrices, int32_t rows,
                               int64_t n_codes, unsigned long long* first_failure, int device,
                               cudaStream_t stream);

// Rows that do not decode (with valid offsets): key b << 32 | row.
cudaError_t LaunchCheckRows(const CompressedView& w, unsigned long long* first_failure, int device,
                            cudaStream_t stream);

// *weights = the weights that row `row` of batch entry `b` decodes to, all of
// its codewords counted (its offsets already checked).
cudaError_t LaunchCountRowWeights(const CompressedView& w, int64_t b, int32_t row,
                                  long long* weights, cudaStream_t stream);

// Lanes per row for a matrix with this many codewords per row on average.
int TeamSize(int64_t n_codes, int64_t rows);

// Tokens per tile; 0 means x stays in global memory (one token per tile).
int TokenTile(int64_t tokens, int64_t cols, int64_t element_bytes, bool staged);

// Grid for `kernel` (kBlockThreads threads, `shared_bytes` dynamic shared
// memory): x over row blocks, y over token tiles, z over the batch.
dim3 GridFor(const void* kernel, int64_t shared_bytes, int64_t row_blocks, int64_t tiles,
             int64_t batch, int device);

QMOE_HOST_DEVICE inline int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace qmoe::cuda
