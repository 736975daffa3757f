// The leading batch dims B... as the CUDA kernels see them (host and device):
// a flat batch index, and per operand an element stride along each dim, 0
// where the operand broadcasts. Built on the host by cuda_operands.h.
#pragma once

#include <cstdint>

#ifdef __CUDACC__
#define QMOE_HOST_DEVICE __host__ __device__
#else
#define QMOE_HOST_DEVICE
#endif

namespace qmoe::cuda {

inline constexpr int kMaxBatchRank = 8;
inline constexpr int64_t kMaxBatchSize = (int64_t{1} << 31) - 1;

// Element offsets of one batch entry's matrices in each operand.
struct MatrixIndex {
  int64_t codes = 0;
  int64_t row_offsets = 0;
  int64_t minmax = 0;
  int64_t dense = 0;   // x or g
  int64_t counts = 0;  // the entry's count of tokens in use
};

struct BatchMap {
  int rank = 0;
  int64_t size = 1;  // product of dims
  int64_t dims[kMaxBatchRank] = {};
  int64_t codes[kMaxBatchRank] = {};
  int64_t row_offsets[kMaxBatchRank] = {};
  int64_t minmax[kMaxBatchRank] = {};
  int64_t dense[kMaxBatchRank] = {};
  int64_t counts[kMaxBatchRank] = {};

  // Constant indices only (a guard instead of a loop bound), so that a kernel
  // reads the map straight from its parameters; 32-bit division (the host
  // keeps size below kMaxBatchSize).
  QMOE_HOST_DEVICE MatrixIndex Locate(int64_t flat_index) const {
    MatrixIndex index;
    uint32_t flat = static_cast<uint32_t>(flat_index);
#pragma unroll
    for (int i = kMaxBatchRank - 1; i >= 0; --i) {
      if (i < rank) {
        const uint32_t dim = static_cast<uint32_t>(dims[i]);
        const uint32_t coordinate = i == 0 ? flat : flat % dim;
        flat = i == 0 ? 0 : flat / dim;
        index.codes += coordinate * codes[i];
        index.row_offsets += coordinate * row_offsets[i];
        index.minmax += coordinate * minmax[i];
        index.dense += coordinate * dense[i];
        index.counts += coordinate * counts[i];
      }
    }
    return index;
  }
};

}  // namespace qmoe::cuda
