// The CUDA kernels of "qmoe_matmul_t", the input gradient:
// dx[b, n, j] = sum_r W_b[r, j] * g[b, n, r].
//
// Rows of W are encoded independently, so a column of W cannot be decoded on
// its own: teams decode rows as in the forward kernel (cuda_decode.cuh), hold
// the row's g for a tile of up to 8 tokens in registers, and add each nonzero
// weight's products into float32 sums in global memory with atomics (about
// 11.5% of the rows x cols x N products at P(0) = 0.885). The sums are in
// dx itself for float32, else in a float32 scratch buffer rounded into bf16
// afterwards. The order of the atomic additions varies from run to run, so
// results may differ in the last bits between runs. Only the tokens in use
// add products, and only the rows of the entries that have any are decoded
// (cuda_tokens.cuh); the handler's zeroed sums are the other tokens' dx.
#include <cuda_bf16.h>

#include "cuda_decode.cuh"
#include "cuda_launch.h"
#include "cuda_tokens.cuh"

namespace qmoe::cuda {
namespace {

template <int kTeam, int kTokens, typename T>
__global__ void __launch_bounds__(kBlockThreads, 1)
    MatmulTransposedKernel(const CompressedView w, const TokenCounts counts,
                           const T* __restrict__ g, float* __restrict__ sums, int64_t tokens) {
  const Team<kTeam> team;
  const int64_t tiles = CeilDiv(tokens, kTokens);
  EntriesInUse entries(w.batch, counts, CeilDiv(w.rows, Team<kTeam>::kPerBlock));
  for (int64_t item = blockIdx.x; item < entries.items(); item += gridDim.x) {
    const int64_t b = entries.Entry(item);
    const int64_t slice = item % entries.slices();
    const MatrixIndex index = w.batch.Locate(b);
    const MatrixView matrix = MatrixView::Of(w, index);
    const int64_t used = UsedTokens(counts, index);
    const T* g_matrix = g + index.dense;
    float* sums_matrix = sums + b * tokens * w.cols;
    for (int64_t tile = blockIdx.y; tile < tiles; tile += gridDim.y) {
      const int64_t first = tile * kTokens;
      const uint32_t in_use = TileInUse<kTokens>(counts, used, first, tokens);
      if (in_use == 0) continue;
      float* sums_tile = sums_matrix + first * w.cols;
      for (int64_t row = slice * Team<kTeam>::kPerBlock + Team<kTeam>::InBlock(); row < w.rows;
           row += entries.slices() * Team<kTeam>::kPerBlock) {
        const float row_min = Bf16BitsToFloat(__ldg(matrix.minmax + 2 * row));
        const float row_max = Bf16BitsToFloat(__ldg(matrix.minmax + 2 * row + 1));
        float gradient[kTokens];
#pragma unroll
        for (int t = 0; t < kTokens; ++t) {
          gradient[t] = (in_use >> t) & 1u ? ToFloat(g_matrix[(first + t) * w.rows + row]) : 0.0f;
        }
        const auto add_products = [&](int32_t start, uint32_t plus, uint32_t minus) {
          for (uint32_t bits = plus | minus; bits != 0; bits &= bits - 1) {
            const int bit = __ffs(bits) - 1;
            const float weight = (plus >> bit) & 1u ? row_max : row_min;
#pragma unroll
            for (int t = 0; t < kTokens; ++t) {
              if ((in_use >> t) & 1u) {
                atomicAdd(sums_tile + t * w.cols + start + bit, weight * gradient[t]);
              }
            }
          }
        };
        if (!DecodeRow(team, w.masks, matrix, static_cast<int32_t>(row), w.cols, add_products)) {
          // Every column of these tokens depends on the row.
          for (int32_t j = team.lane(); j < w.cols; j += kTeam) {
#pragma unroll
            for (int t = 0; t < kTokens; ++t) {
              if ((in_use >> t) & 1u) atomicAdd(sums_tile + t * w.cols + j, CUDART_NAN_F);
            }
          }
        }
      }
    }
  }
}

__global__ void __launch_bounds__(kBlockThreads)
    RoundToBf16Kernel(const float* __restrict__ sums, __nv_bfloat16* __restrict__ out,
                      int64_t count) {
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < count;
       i += int64_t{gridDim.x} * blockDim.x) {
    out[i] = __float2bfloat16_rn(sums[i]);
  }
}

template <int kTeam, int kTokens, typename T>
cudaError_t Launch(const CompressedView& w, const DenseView& g, float* sums, int device,
                   cudaStream_t stream) {
  const auto kernel = &MatmulTransposedKernel<kTeam, kTokens, T>;
  // The batch folds into x (cuda_tokens.cuh).
  const dim3 grid = GridFor(reinterpret_cast<const void*>(kernel), 0,
                            CeilDiv(w.rows, Team<kTeam>::kPerBlock) * w.batch.size,
                            CeilDiv(g.tokens, kTokens), /*batch=*/1, device);
  kernel<<<grid, kBlockThreads, 0, stream>>>(w, g.counts, static_cast<const T*>(g.input), sums,
                                             g.tokens);
  return cudaGetLastError();
}

template <int kTeam, typename T>
cudaError_t LaunchForTeam(const CompressedView& w, const DenseView& g, float* sums, int device,
                          cudaStream_t stream) {
  switch (TokenTile(g.tokens, w.cols, sizeof(T), /*staged=*/false)) {
    case 8:
      return Launch<kTeam, 8, T>(w, g, sums, device, stream);
    case 4:
      return Launch<kTeam, 4, T>(w, g, sums, device, stream);
    case 2:
      return Launch<kTeam, 2, T>(w, g, sums, device, stream);
    default:
      return Launch<kTeam, 1, T>(w, g, sums, device, stream);
  }
}

template <typename T>
cudaError_t LaunchForType(const CompressedView& w, const DenseView& g, float* sums, int device,
                          cudaStream_t stream) {
  switch (TeamSize(w.n_codes, w.rows)) {
    case 32:
      return LaunchForTeam<32, T>(w, g, sums, device, stream);
    case 16:
      return LaunchForTeam<16, T>(w, g, sums, device, stream);
    case 8:
      return LaunchForTeam<8, T>(w, g, sums, device, stream);
    default:
      return LaunchForTeam<4, T>(w, g, sums, device, stream);
  }
}

}  // namespace

cudaError_t LaunchMatmulTransposed(const CompressedView& w, const DenseView& g, float* sums,
                                   int device, cudaStream_t stream) {
  return g.bf16 ? LaunchForType<__nv_bfloat16>(w, g, sums, device, stream)
                : LaunchForType<float>(w, g, sums, device, stream);
}

cudaError_t LaunchRoundToBf16(const float* sums, uint16_t* out, int64_t count, int device,
                              cudaStream_t stream) {
  const auto kernel = &RoundToBf16Kernel;
  const dim3 grid = GridFor(reinterpret_cast<const void*>(kernel), 0, CeilDiv(count, kBlockThreads),
                            1, 1, device);
  kernel<<<grid, kBlockThreads, 0, stream>>>(sums, reinterpret_cast<__nv_bfloat16*>(out), count);
  return cudaGetLastError();
}

}  // namespace qmoe::cuda
