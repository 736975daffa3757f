// The CUDA kernel of "qmoe_dequantize": W as bf16[B..., rows, cols].
//
// The handler zeroes the result first (a memset at full bandwidth); teams
// decode rows (cuda_decode.cuh) and store each nonzero weight's bf16 bits, the
// row's min or max copied exactly. A row that does not decode is overwritten
// with NaN.
#include "cuda_decode.cuh"
#include "cuda_launch.h"

namespace qmoe::cuda {
namespace {

constexpr uint16_t kBf16QuietNan = 0x7fc0;

template <int kTeam>
__global__ void __launch_bounds__(kBlockThreads, 1)
    DequantizeKernel(const CompressedView w, uint16_t* __restrict__ weights) {
  const Team<kTeam> team;
  for (int64_t b = blockIdx.z; b < w.batch.size; b += gridDim.z) {
    const MatrixView matrix = MatrixView::Of(w, w.batch.Locate(b));
    for (int64_t row = int64_t{blockIdx.x} * Team<kTeam>::kPerBlock + Team<kTeam>::InBlock();
         row < w.rows; row += int64_t{gridDim.x} * Team<kTeam>::kPerBlock) {
      const uint16_t row_min = __ldg(matrix.minmax + 2 * row);
      const uint16_t row_max = __ldg(matrix.minmax + 2 * row + 1);
      uint16_t* out = weights + (b * w.rows + row) * w.cols;
      const auto store_weights = [&](int32_t start, uint32_t plus, uint32_t minus) {
        for (uint32_t bits = plus | minus; bits != 0; bits &= bits - 1) {
          const int bit = __ffs(bits) - 1;
          out[start + bit] = (plus >> bit) & 1u ? row_max : row_min;
        }
      };
      if (!DecodeRow(team, w.masks, matrix, static_cast<int32_t>(row), w.cols, store_weights)) {
        team.Sync();  // the stores above land first
        for (int32_t j = team.lane(); j < w.cols; j += kTeam) out[j] = kBf16QuietNan;
      }
    }
  }
}

template <int kTeam>
cudaError_t Launch(const CompressedView& w, uint16_t* weights, int device, cudaStream_t stream) {
  const auto kernel = &DequantizeKernel<kTeam>;
  const dim3 grid = GridFor(reinterpret_cast<const void*>(kernel), 0,
                            CeilDiv(w.rows, Team<kTeam>::kPerBlock), 1, w.batch.size, device);
  kernel<<<grid, kBlockThreads, 0, stream>>>(w, weights);
  return cudaGetLastError();
}

}  // namespace

cudaError_t LaunchDequantize(const CompressedView& w, uint16_t* weights, int device,
                             cudaStream_t stream) {
  switch (TeamSize(w.n_codes, w.rows)) {
    case 32:
      return Launch<32>(w, weights, device, stream);
    case 16:
      return Launch<16>(w, weights, device, stream);
    case 8:
      return Launch<8>(w, weights, device, stream);
    default:
      return Launch<4>(w, weights, device, stream);
  }
}

}  // namespace qmoe::cuda
