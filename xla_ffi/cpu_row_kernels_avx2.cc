// AVX2 row kernels: each byte of a codeword's masks selects x lanes through a
// 256-entry table of 8-lane bit masks; token rows move in two 8-float halves.
#include <immintrin.h>

#include <array>

#include "cpu_row_kernels.h"

#define QMOE_AVX2 __attribute__((target("avx2,fma,bmi,bmi2,popcnt")))

namespace qmoe::cpu {
namespace {

// kByteLanes[b][i] is all ones where bit i of b is set.
using ByteLanes = std::array<std::array<uint32_t, 8>, 256>;
const ByteLanes& ByteLaneMasks() {
  alignas(32) static const ByteLanes table = [] {
    ByteLanes lanes{};
    for (int byte = 0; byte < 256; ++byte) {
      for (int bit = 0; bit < 8; ++bit) lanes[byte][bit] = (byte >> bit) & 1 ? ~0u : 0u;
    }
    return lanes;
  }();
  return table;
}

QMOE_AVX2 inline __m256 SelectLanes(const ByteLanes& lanes, uint32_t bits, __m256 x) {
  const __m256i selected =
      _mm256_load_si256(reinterpret_cast<const __m256i*>(lanes[bits & 0xFF].data()));
  return _mm256_and_ps(x, _mm256_castsi256_ps(selected));
}

QMOE_AVX2 float HorizontalSum(__m256 v) {
  const __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 quarter = _mm_add_ps(half, _mm_movehl_ps(half, half));
  return _mm_cvtss_f32(_mm_add_ss(quarter, _mm_movehdup_ps(quarter)));
}

QMOE_AVX2 bool RowDot(const DictionaryView& dictionary, const uint16_t* codes, int64_t count,
                      const float* x, int64_t padded_cols, float* plus_sum, float* minus_sum) {
  const ByteLanes& lanes = ByteLaneMasks();
  __m256 plus_total[4], minus_total[4];
  for (int chunk = 0; chunk < 4; ++chunk) {
    plus_total[chunk] = _mm256_setzero_ps();
    minus_total[chunk] = _mm256_setzero_ps();
  }
  int64_t pos = 0;
  for (int64_t k = 0; k < count; ++k) {
    if (pos >= padded_cols) return false;
    const uint32_t length = EntryLength(dictionary, codes[k]);
    uint32_t plus, minus;
    EntryBits(dictionary, codes[k], length, &plus, &minus);
    for (int chunk = 0; chunk < 4; ++chunk) {
      const __m256 window = _mm256_loadu_ps(x + pos + 8 * chunk);
      plus_total[chunk] = _mm256_add_ps(plus_total[chunk],
                                        SelectLanes(lanes, plus >> (8 * chunk), window));
      minus_total[chunk] = _mm256_add_ps(minus_total[chunk],
                                         SelectLanes(lanes, minus >> (8 * chunk), window));
    }
    pos += length;
  }
  *plus_sum = HorizontalSum(_mm256_add_ps(_mm256_add_ps(plus_total[0], plus_total[1]),
                                          _mm256_add_ps(plus_total[2], plus_total[3])));
  *minus_sum = HorizontalSum(_mm256_add_ps(_mm256_add_ps(minus_total[0], minus_total[1]),
                                           _mm256_add_ps(minus_total[2], minus_total[3])));
  return pos == padded_cols;
}

QMOE_AVX2 void GatherTokenRows(const float* table, const int32_t* index, int64_t count,
                               float* sum) {
  __m256 low[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  __m256 high[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  int64_t i = 0;
  for (; i + 2 <= count; i += 2) {
    for (int lane = 0; lane < 2; ++lane) {
      const float* row = table + kTokenLanes * index[i + lane];
      low[lane] = _mm256_add_ps(low[lane], _mm256_loadu_ps(row));
      high[lane] = _mm256_add_ps(high[lane], _mm256_loadu_ps(row + 8));
    }
  }
  if (i < count) {
    const float* row = table + kTokenLanes * index[i];
    low[0] = _mm256_add_ps(low[0], _mm256_loadu_ps(row));
    high[0] = _mm256_add_ps(high[0], _mm256_loadu_ps(row + 8));
  }
  _mm256_storeu_ps(sum, _mm256_add_ps(low[0], low[1]));
  _mm256_storeu_ps(sum + 8, _mm256_add_ps(high[0], high[1]));
}

QMOE_AVX2 void ScatterTokenRows(float* table, const int32_t* index, int64_t count,
                                const float* value) {
  const __m256 low = _mm256_loadu_ps(value);
  const __m256 high = _mm256_loadu_ps(value + 8);
  for (int64_t i = 0; i < count; ++i) {
    float* row = table + kTokenLanes * index[i];
    _mm256_storeu_ps(row, _mm256_add_ps(_mm256_loadu_ps(row), low));
    _mm256_storeu_ps(row + 8, _mm256_add_ps(_mm256_loadu_ps(row + 8), high));
  }
}

}  // namespace

bool CpuHasAvx2() {
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
         __builtin_cpu_supports("bmi") && __builtin_cpu_supports("bmi2") &&
         __builtin_cpu_supports("popcnt");
}

const RowKernels& Avx2RowKernels() {
  // Listing nonzero positions is branchy bit iteration on any instruction set.
  static const RowKernels kernels{"avx2", RowsDotOneByOne<RowDot>, PortableRowKernels().row_nonzeros,
                                  GatherTokenRows, ScatterTokenRows};
  return kernels;
}

}  // namespace qmoe::cpu
