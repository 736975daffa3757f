// AVX-512 row kernels. A codeword's nonzero weights come from its slots (see
// qmoe_format.h): one two-source permute picks them out of a 32-float window
// of x starting at the codeword, plus lanes 0..7 and minus lanes 8..14. Two
// rows decode in lockstep to overlap their dependency chains. Entries that
// overflow their slots go through the masks, checked for only when the
// dictionary has such entries.
#include <algorithm>

#include "cpu_row_kernels.h"

#if defined(QMOE_EMULATE_AVX512)
#include "avx512_emulation.h"
#else
#include <immintrin.h>
#endif

#define QMOE_AVX512 QMOE_AVX512_TARGET("avx512f,avx512bw,avx512vl,avx512dq,bmi,bmi2,popcnt")
#define QMOE_AVX512_INLINE QMOE_AVX512 __attribute__((always_inline)) inline

namespace qmoe::cpu {
namespace {

constexpr __mmask16 kPlusLanes = 0x00FF;
constexpr __mmask16 kMinusLanes = 0x7F00;
// Window lanes 28..31 read as zero, so unused slots (31) add nothing.
constexpr __mmask16 kWindowHighLanes = 0x0FFF;

QMOE_AVX512_INLINE __m512i SlotOffsets(const uint8_t* slot) {
  return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(slot)));
}

// One row's running sums: plus lanes and minus lanes of `total`, plus the
// scalar sums of overflowing entries.
struct DotState {
  __m512 total;
  float overflow_plus;
  float overflow_minus;
  int64_t pos;
};

QMOE_AVX512_INLINE DotState StartDot() { return {_mm512_setzero_ps(), 0.0f, 0.0f, 0}; }

template <bool kOverflow>
QMOE_AVX512_INLINE void AddCode(const DictionaryView& dictionary, uint16_t code, const float* x,
                                DotState& state) {
  const uint8_t* slot = dictionary.slots + kSlotBytes * static_cast<uint32_t>(code);
  const uint32_t meta = slot[kSlotMetaByte];
  const uint32_t length = meta & kSlotLengthMask;
  const float* window = x + state.pos;
  if (kOverflow && (meta & kSlotsOverflow)) {
    AddEntryFromMasks(dictionary, code, length, window, &state.overflow_plus,
                      &state.overflow_minus);
  } else {
    const __m512 low = _mm512_loadu_ps(window);
    const __m512 high = _mm512_maskz_loadu_ps(kWindowHighLanes, window + 16);
    const __m512 picked = _mm512_permutex2var_ps(low, SlotOffsets(slot), high);
    state.total = _mm512_mask_add_ps(state.total, kPlusLanes | kMinusLanes, state.total, picked);
  }
  state.pos += length;
}

QMOE_AVX512_INLINE void FinishDot(const DotState& state, float* plus_sum, float* minus_sum) {
  *plus_sum = _mm512_mask_reduce_add_ps(kPlusLanes, state.total) + state.overflow_plus;
  *minus_sum = _mm512_mask_reduce_add_ps(kMinusLanes, state.total) + state.overflow_minus;
}

template <bool kOverflow>
QMOE_AVX512 bool RowDot(const DictionaryView& dictionary, const uint16_t* codes, int64_t count,
                        const float* x, int64_t padded_cols, float* plus_sum, float* minus_sum) {
  DotState state = StartDot();
  for (int64_t k = 0; k < count; ++k) {
    if (state.pos >= padded_cols) return false;
    AddCode<kOverflow>(dictionary, codes[k], x, state);
  }
  FinishDot(state, plus_sum, minus_sum);
  return state.pos == padded_cols;
}

// Rows a and b in lockstep; false if either fails to decode.
template <bool kOverflow>
QMOE_AVX512 bool RowPairDot(const DictionaryView& dictionary, const uint16_t* a_codes,
                            int64_t a_count, const uint16_t* b_codes, int64_t b_count,
                            const float* x, int64_t padded_cols, float* sums) {
  DotState a = StartDot();
  DotState b = StartDot();
  const int64_t common = std::min(a_count, b_count);
  for (int64_t k = 0; k < common; ++k) {
    if (a.pos >= padded_cols || b.pos >= padded_cols) return false;
    AddCode<kOverflow>(dictionary, a_codes[k], x, a);
    AddCode<kOverflow>(dictionary, b_codes[k], x, b);
  }
  for (int64_t k = common; k < a_count; ++k) {
    if (a.pos >= padded_cols) return false;
    AddCode<kOverflow>(dictionary, a_codes[k], x, a);
  }
  for (int64_t k = common; k < b_count; ++k) {
    if (b.pos >= padded_cols) return false;
    AddCode<kOverflow>(dictionary, b_codes[k], x, b);
  }
  FinishDot(a, &sums[0], &sums[1]);
  FinishDot(b, &sums[2], &sums[3]);
  return a.pos == padded_cols && b.pos == padded_cols;
}

template <bool kOverflow>
QMOE_AVX512 int64_t RowsDotWith(const DictionaryView& dictionary, const RowSpan& rows,
                                const float* x, int64_t padded_cols, float* plus_sums,
                                float* minus_sums) {
  const int32_t* offsets = rows.row_offsets;
  int64_t r = rows.begin;
  for (; r + 1 < rows.end; r += 2) {
    float sums[4];
    if (!RowPairDot<kOverflow>(dictionary, rows.codes + offsets[r], offsets[r + 1] - offsets[r],
                               rows.codes + offsets[r + 1], offsets[r + 2] - offsets[r + 1], x,
                               padded_cols, sums)) {
      break;  // the one-row loop below finds which row failed
    }
    plus_sums[r - rows.begin] = sums[0];
    minus_sums[r - rows.begin] = sums[1];
    plus_sums[r + 1 - rows.begin] = sums[2];
    minus_sums[r + 1 - rows.begin] = sums[3];
  }
  for (; r < rows.end; ++r) {
    if (!RowDot<kOverflow>(dictionary, rows.codes + offsets[r], offsets[r + 1] - offsets[r], x,
                           padded_cols, &plus_sums[r - rows.begin], &minus_sums[r - rows.begin])) {
      return r;
    }
  }
  return rows.end;
}

int64_t RowsDot(const DictionaryView& dictionary, const RowSpan& rows, const float* x,
                int64_t padded_cols, float* plus_sums, float* minus_sums) {
  return dictionary.slots_overflow
             ? RowsDotWith<true>(dictionary, rows, x, padded_cols, plus_sums, minus_sums)
             : RowsDotWith<false>(dictionary, rows, x, padded_cols, plus_sums, minus_sums);
}

template <bool kOverflow>
QMOE_AVX512 bool RowNonzerosWith(const DictionaryView& dictionary, const uint16_t* codes,
                                 int64_t count, int64_t padded_cols, int32_t* plus_index,
                                 int64_t* plus_count, int32_t* minus_index, int64_t* minus_count) {
  const __m512i offset_bits = _mm512_set1_epi32(kSlotLengthMask);
  int64_t plus_size = 0;
  int64_t minus_size = 0;
  int64_t pos = 0;
  for (int64_t k = 0; k < count; ++k) {
    // A well-formed row never lists more than padded_cols positions; the
    // checks bound the stores below by the lists' slack.
    if (pos >= padded_cols || plus_size > padded_cols || minus_size > padded_cols) return false;
    const uint8_t* slot = dictionary.slots + kSlotBytes * static_cast<uint32_t>(codes[k]);
    const uint32_t meta = slot[kSlotMetaByte];
    const uint32_t length = meta & kSlotLengthMask;
    if (kOverflow && (meta & kSlotsOverflow)) {
      ListEntryFromMasks(dictionary, codes[k], length, pos, plus_index, &plus_size, minus_index,
                         &minus_size);
    } else {
      // Used slots come first in each half, so the positions store as they
      // are; garbage slots can only give wrong positions below pos + 32.
      const __m512i offsets = _mm512_and_si512(SlotOffsets(slot), offset_bits);
      const uint32_t inside =
          _cvtmask16_u32(_mm512_cmplt_epu32_mask(offsets, _mm512_set1_epi32(length)));
      const __m512i positions = _mm512_add_epi32(offsets, _mm512_set1_epi32(pos));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(plus_index + plus_size),
                          _mm512_castsi512_si256(positions));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(minus_index + minus_size),
                          _mm512_extracti64x4_epi64(positions, 1));
      plus_size += __builtin_popcount(inside & kPlusLanes);
      minus_size += __builtin_popcount(inside & kMinusLanes);
    }
    pos += length;
  }
  *plus_count = plus_size;
  *minus_count = minus_size;
  return pos == padded_cols;
}

bool RowNonzeros(const DictionaryView& dictionary, const uint16_t* codes, int64_t count,
                 int64_t padded_cols, int32_t* plus_index, int64_t* plus_count,
                 int32_t* minus_index, int64_t* minus_count) {
  return dictionary.slots_overflow
             ? RowNonzerosWith<true>(dictionary, codes, count, padded_cols, plus_index, plus_count,
                                     minus_index, minus_count)
             : RowNonzerosWith<false>(dictionary, codes, count, padded_cols, plus_index, plus_count,
                                      minus_index, minus_count);
}

QMOE_AVX512 void GatherTokenRows(const float* table, const int32_t* index, int64_t count,
                                 float* sum) {
  __m512 total[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                     _mm512_setzero_ps()};
  int64_t i = 0;
  for (; i + 4 <= count; i += 4) {
    for (int lane = 0; lane < 4; ++lane) {
      total[lane] = _mm512_add_ps(total[lane],
                                  _mm512_loadu_ps(table + kTokenLanes * index[i + lane]));
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
#if defined(QMOE_EMULATE_AVX512)
  return true;  // the test build's scalar stand-ins run anywhere
#endif
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("bmi2") && __builtin_cpu_supports("popcnt");
}

const RowKernels& Avx512RowKernels() {
  static const RowKernels kernels{"avx512", RowsDot, RowNonzeros, GatherTokenRows,
                                  ScatterTokenRows};
  return kernels;
}

}  // namespace qmoe::cpu
