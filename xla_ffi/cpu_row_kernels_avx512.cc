// AVX-512 row kernels. A codeword's nonzero weights come from its slots (see
// qmoe_format.h): one two-source permute picks them out of a 32-float window
// of x starting at the codeword, plus lanes 0..7 and minus lanes 8..14.
#include <immintrin.h>

#include "cpu_row_kernels.h"

#define QMOE_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,bmi,bmi2,popcnt")))

namespace qmoe::cpu {
namespace {

constexpr __mmask16 kPlusLanes = 0x00FF;
constexpr __mmask16 kMinusLanes = 0x7F00;
// Window lanes 28..31 read as zero, so unused slots (31) add nothing.
constexpr __mmask16 kWindowHighLanes = 0x0FFF;

QMOE_AVX512 inline __m512i SlotOffsets(const uint8_t* slot) {
  return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(slot)));
}

QMOE_AVX512 bool RowDot(const DictionaryView& dictionary, const uint16_t* codes, int64_t count,
                        const float* x, int64_t padded_cols, float* plus_sum, float* minus_sum) {
  __m512 total = _mm512_setzero_ps();
  float overflow_plus = 0.0f;
  float overflow_minus = 0.0f;
  int64_t pos = 0;
  for (int64_t k = 0; k < count; ++k) {
    if (pos >= padded_cols) return false;
    const uint8_t* slot = dictionary.slots + kSlotBytes * static_cast<uint32_t>(codes[k]);
    const uint32_t meta = slot[kSlotMetaByte];
    const uint32_t length = meta & kSlotLengthMask;
    if (__builtin_expect(meta & kSlotsOverflow, 0)) {
      uint32_t plus, minus;
      EntryBits(dictionary, codes[k], length, &plus, &minus);
      for (; plus != 0; plus &= plus - 1) overflow_plus += x[pos + __builtin_ctz(plus)];
      for (; minus != 0; minus &= minus - 1) overflow_minus += x[pos + __builtin_ctz(minus)];
    } else {
      const __m512 low = _mm512_loadu_ps(x + pos);
      const __m512 high = _mm512_maskz_loadu_ps(kWindowHighLanes, x + pos + 16);
      const __m512 picked = _mm512_permutex2var_ps(low, SlotOffsets(slot), high);
      total = _mm512_mask_add_ps(total, kPlusLanes | kMinusLanes, total, picked);
    }
    pos += length;
  }
  *plus_sum = _mm512_mask_reduce_add_ps(kPlusLanes, total) + overflow_plus;
  *minus_sum = _mm512_mask_reduce_add_ps(kMinusLanes, total) + overflow_minus;
  return pos == padded_cols;
}

QMOE_AVX512 bool RowNonzeros(const DictionaryView& dictionary, const uint16_t* codes,
                             int64_t count, int64_t padded_cols, int32_t* plus_index,
                             int64_t* plus_count, int32_t* minus_index, int64_t* minus_count) {
  const __m512i offset_bits = _mm512_set1_epi32(kSlotLengthMask);
  int64_t plus_size = 0;
  int64_t minus_size = 0;
  int64_t pos = 0;
  for (int64_t k = 0; k < count; ++k) {
    // A well-formed row never lists more than padded_cols positions; the
    // checks bound the 16-lane stores below by the lists' slack.
    if (pos >= padded_cols || plus_size > padded_cols || minus_size > padded_cols) return false;
    const uint8_t* slot = dictionary.slots + kSlotBytes * static_cast<uint32_t>(codes[k]);
    const uint32_t meta = slot[kSlotMetaByte];
    const uint32_t length = meta & kSlotLengthMask;
    if (__builtin_expect(meta & kSlotsOverflow, 0)) {
      uint32_t plus, minus;
      EntryBits(dictionary, codes[k], length, &plus, &minus);
      for (; plus != 0; plus &= plus - 1) plus_index[plus_size++] = pos + __builtin_ctz(plus);
      for (; minus != 0; minus &= minus - 1) minus_index[minus_size++] = pos + __builtin_ctz(minus);
    } else {
      const __m512i offsets = _mm512_and_si512(SlotOffsets(slot), offset_bits);
      const __mmask16 inside = _mm512_cmplt_epu32_mask(offsets, _mm512_set1_epi32(length));
      const __m512i positions = _mm512_add_epi32(offsets, _mm512_set1_epi32(pos));
      const __mmask16 plus = inside & kPlusLanes;
      const __mmask16 minus = inside & kMinusLanes;
      _mm512_storeu_si512(plus_index + plus_size, _mm512_maskz_compress_epi32(plus, positions));
      _mm512_storeu_si512(minus_index + minus_size, _mm512_maskz_compress_epi32(minus, positions));
      plus_size += __builtin_popcount(plus);
      minus_size += __builtin_popcount(minus);
    }
    pos += length;
  }
  *plus_count = plus_size;
  *minus_count = minus_size;
  return pos == padded_cols;
}

QMOE_AVX512 void GatherTokenRows(const float* table, const int32_t* index, int64_t count,
                                 float* sum) {
  __m512 total[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                     _mm512_setzero_ps()};
  int64_t i = 0;
  for (; i + 4 <= count; i += 4) {
    for (int lane = 0; lane < 4; ++lane) {
      total[lane] = _mm512_add_ps(total[lane], _mm512_loadu_ps(table + kTokenLanes * index[i + lane]));
    }
  }
  for (; i < count; ++i) {
    total[0] = _mm512_add_ps(total[0], _mm512_loadu_ps(table + kTokenLanes * index[i]));
  }
  _mm512_storeu_ps(sum, _mm512_add_ps(_mm512_add_ps(total[0], total[1]),
                                      _mm512_add_ps(total[2], total[3])));
}

QMOE_AVX512 void ScatterTokenRows(float* table, const int32_t* index, int64_t count,
                                  const float* value) {
  const __m512 addend = _mm512_loadu_ps(value);
  for (int64_t i = 0; i < count; ++i) {
    float* row = table + kTokenLanes * index[i];
    _mm512_storeu_ps(row, _mm512_add_ps(_mm512_loadu_ps(row), addend));
  }
}

}  // namespace

bool CpuHasAvx512() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("bmi2") && __builtin_cpu_supports("popcnt");
}

const RowKernels& Avx512RowKernels() {
  static const RowKernels kernels{"avx512", RowDot, RowNonzeros, GatherTokenRows,
                                  ScatterTokenRows};
  return kernels;
}

}  // namespace qmoe::cpu
