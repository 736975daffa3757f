// Kernels of the device-side validation (QMOE_CUDA_VALIDATE=1, cuda_validate.h):
// the same checks as the CPU handlers, run over every matrix and row, each
// failure lowering one 64-bit key with atomicMin.
#include "cuda_decode.cuh"
#include "cuda_launch.h"

namespace qmoe::cuda {
namespace {

__device__ __forceinline__ unsigned long long OffsetsKey(int64_t matrix, unsigned kind,
                                                         int32_t entry) {
  return (static_cast<unsigned long long>(matrix) << 33) |
         (static_cast<unsigned long long>(kind) << 31) | static_cast<unsigned>(entry);
}

__global__ void __launch_bounds__(kBlockThreads)
    CheckOffsetsKernel(const int32_t* __restrict__ row_offsets, int64_t matrices, int32_t rows,
                       int64_t n_codes, unsigned long long* first_failure) {
  const int64_t per_matrix = int64_t{rows} + 1;
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < matrices * per_matrix;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t matrix = i / per_matrix;
    const int32_t entry = static_cast<int32_t>(i % per_matrix);
    const int32_t* offsets = row_offsets + matrix * per_matrix;
    unsigned long long key = kNoFailure;
    if (entry == 0) {
      if (offsets[0] != 0) key = OffsetsKey(matrix, kOffsetsStart, 0);
    } else if (offsets[entry] < offsets[entry - 1]) {
      key = OffsetsKey(matrix, kOffsetsDecrease, entry - 1);
    }
    if (key == kNoFailure && entry == rows && offsets[rows] > n_codes) {
      key = OffsetsKey(matrix, kOffsetsEnd, rows);
    }
    if (key != kNoFailure) atomicMin(first_failure, key);
  }
}

__global__ void __launch_bounds__(kBlockThreads)
    CheckRowsKernel(const CompressedView w, unsigned long long* first_failure) {
  const Team<32> team;
  const int64_t items = w.batch.size * w.rows;
  for (int64_t item = int64_t{blockIdx.x} * Team<32>::kPerBlock + Team<32>::InBlock(); item < items;
       item += int64_t{gridDim.x} * Team<32>::kPerBlock) {
    const int64_t b = item / w.rows;
    const int32_t row = static_cast<int32_t>(item % w.rows);
    const MatrixView matrix = MatrixView::Of(w, w.batch.Locate(b));
    const bool ok = DecodeRow(team, w.masks, matrix, row, w.cols,
                              [](int32_t, uint32_t, uint32_t) {});
    if (!ok && team.lane() == 0) {
      atomicMin(first_failure,
                (static_cast<unsigned long long>(b) << 32) | static_cast<unsigned>(row));
    }
  }
}

// One warp.
__global__ void CountRowWeightsKernel(const CompressedView w, int64_t b, int32_t row,
                                      long long* weights) {
  const MatrixView matrix = MatrixView::Of(w, w.batch.Locate(b));
  const int64_t end = matrix.row_offsets[row + 1];
  long long total = 0;
  for (int64_t k = matrix.row_offsets[row] + threadIdx.x; k < end; k += 32) {
    total += 2 * static_cast<long long>(w.masks[matrix.codes[k]].x >> kPairCountShift);
  }
  for (int delta = 16; delta > 0; delta /= 2) total += __shfl_xor_sync(0xffffffffu, total, delta);
  if (threadIdx.x == 0) *weights = total;
}

}  // namespace

cudaError_t LaunchCheckOffsets(const int32_t* row_offsets, int64_t matrices, int32_t rows,
                               int64_t n_codes, unsigned long long* first_failure, int device,
                               cudaStream_t stream) {
  const auto kernel = &CheckOffsetsKernel;
  const dim3 grid = GridFor(reinterpret_cast<const void*>(kernel), 0,
                            CeilDiv(matrices * (int64_t{rows} + 1), kBlockThreads), 1, 1, device);
  kernel<<<grid, kBlockThreads, 0, stream>>>(row_offsets, matrices, rows, n_codes, first_failure);
  return cudaGetLastError();
}

cudaError_t LaunchCheckRows(const CompressedView& w, unsigned long long* first_failure, int device,
                            cudaStream_t stream) {
  const auto kernel = &CheckRowsKernel;
  const dim3 grid = GridFor(reinterpret_cast<const void*>(kernel), 0,
                            CeilDiv(w.batch.size * w.rows, Team<32>::kPerBlock), 1, 1, device);
  kernel<<<grid, kBlockThreads, 0, stream>>>(w, first_failure);
  return cudaGetLastError();
}

cudaError_t LaunchCountRowWeights(const CompressedView& w, int64_t b, int32_t row,
                                  long long* weights, cudaStream_t stream) {
  CountRowWeightsKernel<<<1, 32, 0, stream>>>(w, b, row, weights);
  return cudaGetLastError();
}

}  // namespace qmoe::cuda
