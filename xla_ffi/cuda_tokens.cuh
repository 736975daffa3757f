// Tokens in use, and how the matmul kernels (cuda_matmul.cu,
// cuda_transposed.cu) spread the work of the entries that have any.
//
// counts[b], clamped to [0, N], tokens of result batch entry b are in use:
// its first ones along N (cpu_kernels.h). After folding (cuda_operands.h) a
// kernel batch entry holds fold x N tokens t = f * N + n, all under one count
// (folding requires the counts to broadcast too), so token t is in use iff
// t % N < count.
//
// The counts are on the device, and the host cannot learn which entries are
// in use without waiting for it (see cuda_validate.h), so each block finds
// out itself. The grid is x blocks by token tiles; every block counts the
// entries in use (`in_use`, one __syncthreads_count per 256 entries) and
// cuts each one's rows into S = ceil(gridDim.x / in_use) slices (at most one
// per row group of a block), so the grid covers in_use x S items: one entry
// in use gets all blocks, E entries in use about gridDim.x / E blocks each.
// Block x takes items x, x + gridDim.x, ..., in order, and finds item i's
// entry, the (i / S)-th in use, by walking forward over the counts 32 at a
// time with a warp ballot. Entries without tokens in use cost each block one
// count read, and none of their codes are read. Every call is made by all
// threads of a block alike (the kernels synchronize the block between
// tiles), so control flow around them must be block-uniform.
#pragma once

#include <cstdint>

#include "cuda_launch.h"

namespace qmoe::cuda {

// Tokens in use of the batch entry at `index`: its count clamped to [0, N].
__device__ __forceinline__ int64_t UsedTokens(const TokenCounts& counts, const MatrixIndex& index) {
  const int64_t count = __ldg(counts.counts + index.counts);
  return count < 0 ? 0 : (count > counts.entry_tokens ? counts.entry_tokens : count);
}

// Bit t: token first + t exists (below `tokens`) and is in use, for t < kTokens.
template <int kTokens>
__device__ __forceinline__ uint32_t TileInUse(const TokenCounts& counts, int64_t used,
                                              int64_t first, int64_t tokens) {
  uint32_t bits = 0;
#pragma unroll
  for (int t = 0; t < kTokens; ++t) {
    if (first + t < tokens && (first + t) % counts.entry_tokens < used) bits |= 1u << t;
  }
  return bits;
}

// The batch entries with tokens in use, and the items of the grid over them.
class EntriesInUse {
 public:
  __device__ EntriesInUse(const BatchMap& batch, const TokenCounts& counts, int64_t row_groups)
      : batch_(batch), counts_(counts) {
    for (int64_t first = 0; first < batch.size; first += blockDim.x) {
      const int64_t b = first + threadIdx.x;
      in_use_ += __syncthreads_count(b < batch.size && UsedTokens(counts, batch.Locate(b)) > 0);
    }
    const int64_t spread = in_use_ > 0 ? CeilDiv(gridDim.x, in_use_) : 1;
    slices_ = spread < row_groups ? spread : (row_groups > 0 ? row_groups : 1);
    window_ = Ballot(0);
  }

  // Items: (entry in use, row slice) pairs.
  __device__ int64_t items() const { return in_use_ * slices_; }
  // Row slices per entry.
  __device__ int64_t slices() const { return slices_; }

  // The batch entry of `item`; items must not decrease from call to call.
  __device__ int64_t Entry(int64_t item) {
    const int64_t k = item / slices_;  // the k-th entry in use
    while (before_ + __popc(window_) <= k) {
      before_ += __popc(window_);
      first_ += 32;
      window_ = Ballot(first_);
    }
    uint32_t bits = window_;
    for (int64_t skip = k - before_; skip > 0; --skip) bits &= bits - 1;
    return first_ + __ffs(bits) - 1;
  }

 private:
  // Bit l: entry first + l has tokens in use.
  __device__ uint32_t Ballot(int64_t first) const {
    const int64_t b = first + threadIdx.x % 32;
    return __ballot_sync(0xffffffffu, b < batch_.size && UsedTokens(counts_, batch_.Locate(b)) > 0);
  }

  const BatchMap& batch_;
  const TokenCounts& counts_;
  int64_t in_use_ = 0;
  int64_t slices_ = 1;
  int64_t first_ = 0;    // the entries the ballot window starts at
  int64_t before_ = 0;   // entries in use before first_
  uint32_t window_ = 0;  // the ballot of entries first_ .. first_ + 31
};

}  // namespace qmoe::cuda
