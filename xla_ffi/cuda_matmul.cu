// The CUDA kernel of "qmoe_matmul": y[b, n, r] = sum_j W_b[r, j] * x[b, n, j].
//
// A block stages a tile of up to 8 tokens of x in shared memory, token-minor
// (x[j][t]), and its teams decode rows (cuda_decode.cuh): each nonzero weight
// found is applied to the whole tile with one vector load from shared memory
// and one FMA per token, so each codeword is decoded once per tile rather
// than once per token. Sums stay in float32 registers, are reduced over the
// team with warp shuffles, and are rounded once into y's dtype.
//
// Only the tokens in use are staged and computed, and only the rows of the
// entries that have any are decoded (the schedule is in cuda_tokens.cuh);
// the y rows of the other tokens are zeroed by the same kernel afterwards,
// so every element of y is written once.
#include <cuda_bf16.h>

#include "cuda_decode.cuh"
#include "cuda_launch.h"
#include "cuda_tokens.cuh"

namespace qmoe::cuda {
namespace {

__device__ __forceinline__ void UnpackBf16Pair(uint32_t word, float* low, float* high) {
  *low = __uint_as_float(word << 16);
  *high = __uint_as_float(word & 0xffff0000u);
}

// values[t] = staged[t] for a column of kTokens staged tokens, in one or two
// vector loads (the column is 2 to 32 bytes, aligned to its size or to 16).
template <int kTokens>
__device__ __forceinline__ void LoadColumn(const float* staged, float (&values)[kTokens]) {
  if constexpr (kTokens == 1) {
    values[0] = staged[0];
  } else if constexpr (kTokens == 2) {
    const float2 pair = *reinterpret_cast<const float2*>(staged);
    values[0] = pair.x;
    values[1] = pair.y;
  } else {
#pragma unroll
    for (int t = 0; t < kTokens; t += 4) {
      const float4 quad = *reinterpret_cast<const float4*>(staged + t);
      values[t] = quad.x;
      values[t + 1] = quad.y;
      values[t + 2] = quad.z;
      values[t + 3] = quad.w;
    }
  }
}

template <int kTokens>
__device__ __forceinline__ void LoadColumn(const __nv_bfloat16* staged, float (&values)[kTokens]) {
  if constexpr (kTokens == 1) {
    values[0] = __bfloat162float(staged[0]);
  } else if constexpr (kTokens == 2) {
    UnpackBf16Pair(*reinterpret_cast<const uint32_t*>(staged), &values[0], &values[1]);
  } else if constexpr (kTokens == 4) {
    const uint2 words = *reinterpret_cast<const uint2*>(staged);
    UnpackBf16Pair(words.x, &values[0], &values[1]);
    UnpackBf16Pair(words.y, &values[2], &values[3]);
  } else {
    static_assert(kTokens == 8, "token tiles are 1, 2, 4 or 8");
    const uint4 words = *reinterpret_cast<const uint4*>(staged);
    UnpackBf16Pair(words.x, &values[0], &values[1]);
    UnpackBf16Pair(words.y, &values[2], &values[3]);
    UnpackBf16Pair(words.z, &values[4], &values[5]);
    UnpackBf16Pair(words.w, &values[6], &values[7]);
  }
}

// Copies tokens first .. first + kTokens - 1 of x (rows of `cols`) to
// staged[j * kTokens + t]; tokens not in `in_use` (bit t) are zeros.
template <int kTokens, typename T>
__device__ void StageTokens(const T* __restrict__ x, uint32_t in_use, int64_t first, int32_t cols,
                            T* staged) {
#pragma unroll
  for (int t = 0; t < kTokens; ++t) {
    if ((in_use >> t) & 1u) {
      const T* row = x + (first + t) * cols;
      for (int32_t j = threadIdx.x; j < cols; j += blockDim.x) staged[j * kTokens + t] = row[j];
    } else {
      for (int32_t j = threadIdx.x; j < cols; j += blockDim.x) {
        staged[j * kTokens + t] = FromFloat<T>(0.0f);
      }
    }
  }
}

// Writes zeros to the y rows of the tokens not in use; the grid's warps take
// (entry, token) pairs in turn.
template <typename T>
__device__ void ZeroUnusedTokens(const BatchMap& batch, const TokenCounts& counts, int64_t tokens,
                                 int32_t rows, T* __restrict__ y) {
  constexpr int64_t kWarps = kBlockThreads / 32;
  const int64_t warp = (int64_t{blockIdx.y} * gridDim.x + blockIdx.x) * kWarps + threadIdx.x / 32;
  const int64_t warps = int64_t{gridDim.x} * gridDim.y * kWarps;
  for (int64_t pair = warp; pair < batch.size * tokens; pair += warps) {
    const int64_t token = pair % tokens;
    if (token % counts.entry_tokens < UsedTokens(counts, batch.Locate(pair / tokens))) continue;
    T* out = y + pair * rows;
    for (int32_t r = threadIdx.x % 32; r < rows; r += 32) out[r] = FromFloat<T>(0.0f);
  }
}

// kStaged: x tiles in shared memory; else (one token per tile) x is read from
// global memory, for rows too wide to stage.
template <int kTeam, int kTokens, typename T, bool kStaged>
__global__ void __launch_bounds__(kBlockThreads, 1)
    MatmulKernel(const CompressedView w, const TokenCounts counts, const T* __restrict__ x,
                 T* __restrict__ y, int64_t tokens) {
  static_assert(kStaged || kTokens == 1, "unstaged x goes one token at a time");
  extern __shared__ __align__(16) unsigned char shared[];
  T* staged = reinterpret_cast<T*>(shared);
  const Team<kTeam> team;
  const int64_t tiles = CeilDiv(tokens, kTokens);
  EntriesInUse entries(w.batch, counts, CeilDiv(w.rows, Team<kTeam>::kPerBlock));
  for (int64_t item = blockIdx.x; item < entries.items(); item += gridDim.x) {
    const int64_t b = entries.Entry(item);
    const int64_t slice = item % entries.slices();
    const MatrixIndex index = w.batch.Locate(b);
    const MatrixView matrix = MatrixView::Of(w, index);
    const int64_t used = UsedTokens(counts, index);
    const T* x_matrix = x + index.dense;
    T* y_matrix = y + b * tokens * w.rows;
    for (int64_t tile = blockIdx.y; tile < tiles; tile += gridDim.y) {
      const int64_t first = tile * kTokens;
      const uint32_t in_use = TileInUse<kTokens>(counts, used, first, tokens);
      if (in_use == 0) continue;
      if constexpr (kStaged) {
        __syncthreads();  // every team is done with the previous tile
        StageTokens<kTokens>(x_matrix, in_use, first, w.cols, staged);
        __syncthreads();
      }
      for (int64_t row = slice * Team<kTeam>::kPerBlock + Team<kTeam>::InBlock(); row < w.rows;
           row += entries.slices() * Team<kTeam>::kPerBlock) {
        const float row_min = Bf16BitsToFloat(__ldg(matrix.minmax + 2 * row));
        const float row_max = Bf16BitsToFloat(__ldg(matrix.minmax + 2 * row + 1));
        float sums[kTokens] = {};
        const auto add_weights = [&](int32_t start, uint32_t plus, uint32_t minus) {
          for (uint32_t bits = plus | minus; bits != 0; bits &= bits - 1) {
            const int bit = __ffs(bits) - 1;
            const float weight = (plus >> bit) & 1u ? row_max : row_min;
            float values[kTokens];
            if constexpr (kStaged) {
              LoadColumn<kTokens>(staged + (start + bit) * kTokens, values);
            } else {
              values[0] = ToFloat(__ldg(x_matrix + first * w.cols + start + bit));
            }
#pragma unroll
            for (int t = 0; t < kTokens; ++t) sums[t] = fmaf(weight, values[t], sums[t]);
          }
        };
        const bool ok = DecodeRow(team, w.masks, matrix, static_cast<int32_t>(row), w.cols,
                                  add_weights);
#pragma unroll
        for (int t = 0; t < kTokens; ++t) {
          const float sum = team.Sum(sums[t]);
          if (t % kTeam == team.lane() && ((in_use >> t) & 1u)) {
            y_matrix[(first + t) * w.rows + row] = FromFloat<T>(ok ? sum : CUDART_NAN_F);
          }
        }
      }
    }
  }
  ZeroUnusedTokens(w.batch, counts, tokens, w.rows, y);
}

template <int kTeam, int kTokens, typename T, bool kStaged>
cudaError_t Launch(const CompressedView& w, const DenseView& x_y, int device, cudaStream_t stream) {
  const auto kernel = &MatmulKernel<kTeam, kTokens, T, kStaged>;
  const int64_t shared_bytes = kStaged ? int64_t{w.cols} * kTokens * int64_t{sizeof(T)} : 0;
  // The batch folds into x (cuda_tokens.cuh).
  const dim3 grid = GridFor(reinterpret_cast<const void*>(kernel), shared_bytes,
                            CeilDiv(w.rows, Team<kTeam>::kPerBlock) * w.batch.size,
                            CeilDiv(x_y.tokens, kTokens), /*batch=*/1, device);
  kernel<<<grid, kBlockThreads, shared_bytes, stream>>>(
      w, x_y.counts, static_cast<const T*>(x_y.input), static_cast<T*>(x_y.output), x_y.tokens);
  return cudaGetLastError();
}

template <int kTeam, typename T>
cudaError_t LaunchForTeam(const CompressedView& w, const DenseView& x_y, int device,
                          cudaStream_t stream) {
  switch (TokenTile(x_y.tokens, w.cols, sizeof(T), /*staged=*/true)) {
    case 8:
      return Launch<kTeam, 8, T, true>(w, x_y, device, stream);
    case 4:
      return Launch<kTeam, 4, T, true>(w, x_y, device, stream);
    case 2:
      return Launch<kTeam, 2, T, true>(w, x_y, device, stream);
    case 1:
      return Launch<kTeam, 1, T, true>(w, x_y, device, stream);
    default:
      return Launch<kTeam, 1, T, false>(w, x_y, device, stream);
  }
}

template <typename T>
cudaError_t LaunchForType(const CompressedView& w, const DenseView& x_y, int device,
                          cudaStream_t stream) {
  switch (TeamSize(w.n_codes, w.rows)) {
    case 32:
      return LaunchForTeam<32, T>(w, x_y, device, stream);
    case 16:
      return LaunchForTeam<16, T>(w, x_y, device, stream);
    case 8:
      return LaunchForTeam<8, T>(w, x_y, device, stream);
    default:
      return LaunchForTeam<4, T>(w, x_y, device, stream);
  }
}

}  // namespace

cudaError_t LaunchMatmul(const CompressedView& w, const DenseView& x_y, int device,
                         cudaStream_t stream) {
  return x_y.bf16 ? LaunchForType<__nv_bfloat16>(w, x_y, device, stream)
                  : LaunchForType<float>(w, x_y, device, stream);
}

}  // namespace qmoe::cuda
