// Device side of the CUDA kernels: teams of lanes decoding compressed rows.
//
// Lingo: a *team* is kTeam consecutive lanes of a warp (4, 8, 16 or 32) that
// decode one row of W at a time; narrow matrices get small teams, so one warp
// works on several rows. A team reads its row's codewords in chunks of
// kTeam * kChunkCodes, one codeword per lane per step (all of a chunk's loads
// are in flight together). Each lane fetches its codeword's entry from the
// masks table (qmoe_format.h); an inclusive scan of the entry lengths over the
// team gives each codeword's first weight position; then the lane visits only
// its codeword's nonzero weights by their mask bits (2.5 per codeword on
// average at P(0) = 0.885; no entry of the p0 = 0.885 dictionary has more
// than 3), not all 28 positions.
//
// Against the paper's kernel (one warp per row, one codeword at a time with
// 28 lanes each testing one weight, a dequantization table in shared
// memory): lanes decode different codewords in parallel, the work per
// codeword follows its nonzeros, rows narrower than a warp share one, and the
// table becomes a select between the row's min and max held in registers.
// The matmul kernel applies each decoded codeword to a tile of up to 8 tokens
// staged in shared memory, so N tokens cost ceil(N / 8) decodes; holding all
// N would take N * cols of shared memory.
//
// Dictionary residency: the masks table is 512 KiB, more than shared memory.
// Codeword use is flat (on 2080×6144 at P(0) = 0.885: 59201 distinct
// codewords among 587743; the 4096 most used cover 44% of uses, the 4096
// lowest indices 14%), so a hot subset in shared memory would miss most
// look-ups. Entries are read through the read-only data cache (__ldg, L1),
// backed by L2 (40 MB and more on sm_80 and sm_90), where the whole table
// stays resident across calls.
//
// Memory safety does not depend on the operands' bytes: a row whose offsets
// are outside [0, n_codes], decreasing, or whose matrix's offsets do not
// start at 0 fails before any code is read; decoding stops at the first chunk
// that runs past the row's width; a lane visits only positions below `cols`.
// DecodeRow reports whether the row was well formed; the kernels write NaN
// for whatever depends on a row that was not.
#pragma once

#include <cuda_bf16.h>
#include <math_constants.h>

#include <cstdint>

#include "cuda_launch.h"
#include "qmoe_format.h"

namespace qmoe::cuda {

// Codewords per lane per chunk.
inline constexpr int kChunkCodes = 4;

__device__ __forceinline__ float Bf16BitsToFloat(uint32_t bits) {
  return __uint_as_float(bits << 16);
}

__device__ __forceinline__ float ToFloat(float value) { return value; }
__device__ __forceinline__ float ToFloat(__nv_bfloat16 value) { return __bfloat162float(value); }

template <typename T>
__device__ __forceinline__ T FromFloat(float value);
template <>
__device__ __forceinline__ float FromFloat<float>(float value) {
  return value;
}
template <>
__device__ __forceinline__ __nv_bfloat16 FromFloat<__nv_bfloat16>(float value) {
  return __float2bfloat16_rn(value);
}

// kTeam consecutive lanes of a warp working on one row.
template <int kTeam>
class Team {
 public:
  static_assert(kTeam == 4 || kTeam == 8 || kTeam == 16 || kTeam == 32, "team of 4..32 lanes");
  static constexpr int kPerBlock = kBlockThreads / kTeam;

  __device__ Team() {
    const unsigned warp_lane = threadIdx.x % 32u;
    lane_ = static_cast<int>(warp_lane % kTeam);
    if constexpr (kTeam == 32) {
      mask_ = 0xffffffffu;
    } else {
      mask_ = ((1u << kTeam) - 1u) << (warp_lane - lane_);
    }
  }

  __device__ int lane() const { return lane_; }
  // This team's index within the block.
  __device__ static int InBlock() { return static_cast<int>(threadIdx.x) / kTeam; }

  __device__ int InclusiveSum(int value) const {
#pragma unroll
    for (int delta = 1; delta < kTeam; delta *= 2) {
      const int other = __shfl_up_sync(mask_, value, delta, kTeam);
      if (lane_ >= delta) value += other;
    }
    return value;
  }
  __device__ int FromLast(int value) const { return __shfl_sync(mask_, value, kTeam - 1, kTeam); }
  __device__ float Sum(float value) const {
#pragma unroll
    for (int delta = kTeam / 2; delta > 0; delta /= 2) {
      value += __shfl_xor_sync(mask_, value, delta, kTeam);
    }
    return value;
  }
  __device__ bool All(bool value) const { return __all_sync(mask_, value); }
  // Orders the team's memory accesses before and after it.
  __device__ void Sync() const { __syncwarp(mask_); }

 private:
  int lane_;
  unsigned mask_;
};

// One compressed matrix of the operands.
struct MatrixView {
  const uint16_t* codes;       // [n_codes]
  const int32_t* row_offsets;  // [rows + 1], unchecked
  const uint16_t* minmax;      // bf16 bits [rows][2]
  int64_t n_codes;

  __device__ static MatrixView Of(const CompressedView& w, const MatrixIndex& index) {
    return {w.codes + index.codes, w.row_offsets + index.row_offsets, w.minmax + index.minmax,
            w.n_codes};
  }
};

// The bits of an entry's own weights: its low `length` (0..30) of 28.
__device__ __forceinline__ uint32_t OwnWeights(int32_t length) {
  return kWeightMask & ((1u << length) - 1u);
}

// The bits of positions start .. start + 31 that lie below `cols`.
__device__ __forceinline__ uint32_t BelowCols(int32_t start, int32_t cols) {
  const int32_t room = cols - start;
  if (room >= 32) return 0xffffffffu;
  return room <= 0 ? 0u : (1u << room) - 1u;
}

// Decodes row `row` with the team. For each codeword, the lane holding it
// calls visit(start, plus_bits, minus_bits): bit k means weight start + k is
// the row max (plus) or min (minus), bits limited to positions below `cols`.
// Returns on every lane whether the row is well formed: the matrix's offsets
// start at 0, the row's lie in [0, n_codes] and do not decrease, every
// codeword starts below padded_cols and together they cover exactly
// padded_cols weights (cols rounded up to even), as the CPU handlers require.
template <int kTeam, typename Visit>
__device__ bool DecodeRow(const Team<kTeam>& team, const uint2* __restrict__ masks,
                          const MatrixView& matrix, int32_t row, int32_t cols, Visit&& visit) {
  const int32_t padded_cols = cols + (cols & 1);
  const int64_t begin = __ldg(matrix.row_offsets + row);
  const int64_t end = __ldg(matrix.row_offsets + row + 1);
  if (__ldg(matrix.row_offsets) != 0 || begin < 0 || end < begin || end > matrix.n_codes) {
    return false;
  }
  int32_t decoded = 0;  // weights before the current step; the same on every lane
  bool starts_inside = true;
  for (int64_t chunk = begin; chunk < end; chunk += kTeam * kChunkCodes) {
    uint32_t code[kChunkCodes];
#pragma unroll
    for (int step = 0; step < kChunkCodes; ++step) {
      const int64_t k = chunk + step * kTeam + team.lane();
      code[step] = k < end ? __ldg(matrix.codes + k) : 0u;
    }
    uint2 entry[kChunkCodes];
#pragma unroll
    for (int step = 0; step < kChunkCodes; ++step) {
      const bool present = chunk + step * kTeam + team.lane() < end;
      entry[step] = present ? __ldg(masks + code[step]) : make_uint2(0u, 0u);
    }
#pragma unroll
    for (int step = 0; step < kChunkCodes; ++step) {
      const int32_t length = 2 * static_cast<int32_t>(entry[step].x >> kPairCountShift);
      const int32_t through = team.InclusiveSum(length);
      const int32_t start = decoded + through - length;
      decoded += team.FromLast(through);
      if (chunk + step * kTeam + team.lane() < end) {
        starts_inside = starts_inside && start < padded_cols;
        const uint32_t bits = OwnWeights(length) & BelowCols(start, cols);
        visit(start, entry[step].x & bits, entry[step].y & bits);
      }
    }
    // Past the row's width: corrupt. Stopping here also bounds `decoded`.
    if (decoded > padded_cols) break;
  }
  return team.All(starts_inside) && decoded == padded_cols;
}

}  // namespace qmoe::cuda
