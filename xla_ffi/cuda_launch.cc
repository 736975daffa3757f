#include "cuda_launch.h"

#include <algorithm>

namespace qmoe::cuda {
namespace {

constexpr int64_t kMaxGridYZ = 65535;
constexpr int kMaxTokenTile = 8;

}  // namespace

int TeamSize(int64_t n_codes, int64_t rows) {
  const int64_t codes_per_row = rows > 0 ? n_codes / rows : 0;
  if (codes_per_row >= 64) return 32;
  if (codes_per_row >= 24) return 16;
  if (codes_per_row >= 8) return 8;
  return 4;
}

int TokenTile(int64_t tokens, int64_t cols, int64_t element_bytes, bool staged) {
  int tile = 1;
  while (tile < kMaxTokenTile && tile < tokens) tile *= 2;
  if (!staged) return tile;
  while (tile > 1 && cols * tile * element_bytes > kStagedBytes) tile /= 2;
  return cols * tile * element_bytes > kStagedBytes ? 0 : tile;
}

dim3 GridFor(const void* kernel, int64_t shared_bytes, int64_t row_blocks, int64_t tiles,
             int64_t batch, int device) {
  // A failed query leaves its error for the launcher's cudaGetLastError().
  int multiprocessors = 1;
  int blocks_per_multiprocessor = 1;
  cudaDeviceGetAttribute(&multiprocessors, cudaDevAttrMultiProcessorCount, device);
  cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks_per_multiprocessor, kernel, kBlockThreads,
                                                shared_bytes);
  const int64_t resident = std::max(1, multiprocessors) *
                           static_cast<int64_t>(std::max(1, blocks_per_multiprocessor));
  const int64_t grid_y = std::clamp<int64_t>(tiles, 1, kMaxGridYZ);
  const int64_t grid_z = std::clamp<int64_t>(batch, 1, kMaxGridYZ);
  const int64_t grid_x = std::clamp<int64_t>(CeilDiv(2 * resident, grid_y * grid_z), 1,
                                             std::max<int64_t>(row_blocks, 1));
  return dim3(static_cast<unsigned>(grid_x), static_cast<unsigned>(grid_y),
              static_cast<unsigned>(grid_z));
}

}  // namespace qmoe::cuda
