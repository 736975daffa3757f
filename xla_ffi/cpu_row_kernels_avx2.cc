// AVX2 row kernels. A codeword's nonzero weights come from its word (see
// qmoe_format.h): three or four broadcasts from the window of x at the
// codeword, blended into one vector with the values in lanes 0..3 and again
// in 4..7, and one fused multiply-add with its class's 0/1 weights adds plus
// weights to lanes 0..3 and minus weights to lanes 4..7. The words of
// codewords 48 steps ahead are prefetched: the 256 KB table outgrows L2, and
// its accesses are random. Entries that overflow their word go through the
// masks, checked for only when the dictionary has such entries.
#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "cpu_row_kernels.h"

#define QMOE_AVX2 __attribute__((target("avx2,fma,bmi,bmi2,popcnt")))
#define QMOE_AVX2_INLINE QMOE_AVX2 __attribute__((always_inline)) inline

namespace qmoe::cpu {
namespace {

// Codewords ahead whose words are prefetched: about a memory latency's worth
// when the table has left the caches (docs/measurements.md, "Where the
// kernel's time goes", has what the prefetch and its distance are worth).
constexpr int64_t kPrefetchDistance = 48;
static_assert(kCheckedChunk == 4, "RowsDotWith loads a chunk's 4 codes as one 8-byte word");

QMOE_AVX2 float HorizontalSum(__m128 v) {
  const __m128 half = _mm_add_ps(v, _mm_movehl_ps(v, v));
  return _mm_cvtss_f32(_mm_add_ss(half, _mm_movehdup_ps(half)));
}

// BEXTR controls (start | length << 8) for the parts of a word. One BEXTR
// takes a part out of the word and leaves the word in place, where a copy,
// a shift and a mask took up to three instructions. With the window kept as
// a pointer, rows_dot's chunked loop compiles (GCC 12, -O3) to 17-18
// instructions per codeword instead of 27, or 22 instead of 32 where the
// dictionary has 4-weight entries; its time follows that count
// (docs/cpu_kernels.md §1). Field 0, at bit 0, takes a mask instead
// (FieldValues), so it has no control here.
struct WordControls {
  uint64_t field1, field2, field3;
  uint64_t length;
  // Without 4-weight entries field 3 is 0, so the 8 bits from field 3's top
  // 3 bits up to the class are class * 8: the float offset of its weights
  // row, with no shift. In a words form not derived from the masks those 3
  // bits may be set: the offset then lands inside the class table's padding
  // row (WordClasses), wrong numbers and no read outside it.
  uint64_t scaled_class;
  uint64_t plain_class;
};

// The largest weights offset either form of the class gives, plus the 8
// floats read there, stays inside WordClasses::weights.
static_assert((kWordOverflowClass << 3 | 7) + 8 <= sizeof(WordClasses::weights) / sizeof(float));

QMOE_AVX2_INLINE WordControls MakeWordControls() {
  constexpr auto control = [](int start, int bits) {
    return static_cast<uint64_t>(start) | static_cast<uint64_t>(bits) << 8;
  };
  WordControls c{
      control(kWordFieldBits, kWordFieldBits),          control(2 * kWordFieldBits, kWordFieldBits),
      control(3 * kWordFieldBits, kWordFieldBits),      control(kWordLengthShift, kWordFieldBits),
      control(kWordClassShift - 3, kWordFieldBits + 3), control(kWordClassShift, kWordFieldBits)};
  return c;
}

// The window's values at the word's first 3 (or 4) fields, in lanes 0..3 and again in 4..7:
// a broadcast load per field and blends, where loads into lanes and inserts took shuffles
// (docs/cpu_kernels.md §1). Without a fourth field, lanes 3 and 7 hold the first field's value;
// the class's weights there are 0.
template <bool kFourth>
QMOE_AVX2_INLINE __m256 FieldValues(uint64_t word, const float* window, const WordControls& c) {
  // Field 0 sits at bit 0: a mask takes it, which leaves a register free for the loop where a
  // BEXTR control took one (0.97-0.99x the time on Zen 2, cpu_kernels.md §1).
  const __m256 first = _mm256_broadcast_ss(window + (word & kWordFieldMask));
  const __m256 second = _mm256_broadcast_ss(window + __bextr_u64(word, c.field1));
  const __m256 third = _mm256_broadcast_ss(window + __bextr_u64(word, c.field2));
  __m256 values = _mm256_blend_ps(_mm256_blend_ps(first, second, 0x22), third, 0x44);
  if (kFourth) {
    values = _mm256_blend_ps(values, _mm256_broadcast_ss(window + __bextr_u64(word, c.field3)),
                             0x88);
  }
  return values;
}

// One codeword at `window` into `total` (or the overflow sums); returns the
// window of the next one.
template <bool kFourth, bool kOverflow>
QMOE_AVX2_INLINE const float* AddCodeword(const DictionaryView& dictionary,
                                          const WordClasses& classes, const WordControls& c,
                                          uint16_t code, const float* window, __m256* total,
                                          float* overflow_plus, float* overflow_minus) {
  const uint64_t word = dictionary.words[code];
  if (kOverflow && WordClass(static_cast<uint32_t>(word)) == kWordOverflowClass) {
    AddEntryFromMasks(dictionary, code, WordLength(static_cast<uint32_t>(word)), window,
                      overflow_plus, overflow_minus);
  } else {
    const uint64_t row = kFourth ? __bextr_u64(word, c.plain_class) * 8
                                 : __bextr_u64(word, c.scaled_class);
    *total = _mm256_fmadd_ps(FieldValues<kFourth>(word, window, c),
                             _mm256_loadu_ps(&classes.weights[0][0] + row), *total);
  }
  return window + __bextr_u64(word, c.length);
}

// Rows of `rows` one after the other; their codes are one contiguous run,
// prefetched across row ends up to the span's last code.
//
// A row's codewords but its last run in chunks of kCheckedChunk with one check of
// where the chunk starts, and without clamping the prefetch (per codeword,
// both cost about as much as the decode; docs/cpu_kernels.md §1). Checking every codeword's
// start is not needed for correctness: starts never decrease, so a codeword
// starting at or past padded_cols makes the row's last codeword, which is
// always checked, start there too, and the row fails as before. Memory stays
// in bounds: a chunk starts below padded_cols and each codeword moves at most
// 31 weights, so its windows end within kRowsDotSlack. The sums are the same
// products added in the same order as one codeword at a time: same bits.
template <bool kFourth, bool kOverflow>
QMOE_AVX2 int64_t RowsDotWith(const DictionaryView& dictionary, const RowSpan& rows, const float* x,
                              int64_t padded_cols, float* plus_sums, float* minus_sums) {
  const WordClasses& classes = WordClassTable();
  const WordControls controls = MakeWordControls();
  const uint32_t* words = dictionary.words;
  const uint16_t* codes = rows.codes;
  const float* x_end = x + padded_cols;
  const int64_t last_code = std::max<int64_t>(rows.row_offsets[rows.end] - 1, 0);
  // Codewords below this one prefetch a code at most last_code.
  const int64_t prefetch_end = last_code - kPrefetchDistance + 1;
  for (int64_t r = rows.begin; r < rows.end; ++r) {
    const int64_t begin = rows.row_offsets[r];
    const int64_t end = rows.row_offsets[r + 1];
    __m256 total = _mm256_setzero_ps();
    float overflow_plus = 0.0f;
    float overflow_minus = 0.0f;
    const float* window = x;  // x at the next codeword's first weight
    int64_t k = begin;
    const int64_t chunked_end = std::min(end - 1, prefetch_end);
    for (; k + kCheckedChunk <= chunked_end; k += kCheckedChunk) {
      if (window >= x_end) return r;
      // The chunk's codes and those it prefetches for, one 8-byte load each (x86 is little
      // endian: code i of a load is bits 16i..16i+15). Both stay at or below last_code.
      uint64_t chunk, ahead;
      std::memcpy(&chunk, codes + k, sizeof(chunk));
      std::memcpy(&ahead, codes + k + kPrefetchDistance, sizeof(ahead));
#pragma GCC unroll 4
      for (int i = 0; i < kCheckedChunk; ++i) {
        const auto code_at = [i](uint64_t codes4) {
          return static_cast<uint16_t>(codes4 >> 16 * i);
        };
        _mm_prefetch(reinterpret_cast<const char*>(words + code_at(ahead)), _MM_HINT_T0);
        window = AddCodeword<kFourth, kOverflow>(dictionary, classes, controls, code_at(chunk),
                                                 window, &total, &overflow_plus, &overflow_minus);
      }
    }
    for (; k < end; ++k) {
      if (window >= x_end) return r;
      _mm_prefetch(
          reinterpret_cast<const char*>(words + codes[std::min(k + kPrefetchDistance, last_code)]),
          _MM_HINT_T0);
      window = AddCodeword<kFourth, kOverflow>(dictionary, classes, controls, codes[k], window,
                                               &total, &overflow_plus, &overflow_minus);
    }
    if (window != x_end) return r;
    plus_sums[r - rows.begin] = HorizontalSum(_mm256_castps256_ps128(total)) + overflow_plus;
    minus_sums[r - rows.begin] = HorizontalSum(_mm256_extractf128_ps(total, 1)) + overflow_minus;
  }
  return rows.end;
}

QMOE_AVX2 int64_t RowsDot(const DictionaryView& dictionary, const RowSpan& rows, const float* x,
                          int64_t padded_cols, float* plus_sums, float* minus_sums) {
  const auto run =
      dictionary.words_fourth
          ? (dictionary.words_overflow ? RowsDotWith<true, true> : RowsDotWith<true, false>)
          : (dictionary.words_overflow ? RowsDotWith<false, true> : RowsDotWith<false, false>);
  return run(dictionary, rows, x, padded_cols, plus_sums, minus_sums);
}

// row_nonzeros from the words with vector stores: one variable shift takes
// a codeword's four fields out of its word, offset by pos; they go to the plus
// list as they are and, permuted by the class so that its minus fields come
// first, to the minus list (as the portable loop's eight scalar stores did;
// the counts keep what belongs). The class and length come out with BEXTR.
// Same lists, same checks (once per kCheckedChunk codewords, as
// WordsRowNonzeros in cpu_row_kernels_portable.cc explains).
template <bool kOverflow>
QMOE_AVX2 bool RowNonzerosWith(const DictionaryView& dictionary, const uint16_t* codes,
                               int64_t count, int64_t padded_cols, int32_t* plus_index,
                               int64_t* plus_count, int32_t* minus_index, int64_t* minus_count) {
  const WordClasses& classes = WordClassTable();
  const WordControls controls = MakeWordControls();
  const __m128i field_shifts = _mm_setr_epi32(0, kWordFieldBits, 2 * kWordFieldBits,
                                              3 * kWordFieldBits);
  const __m128i field_mask = _mm_set1_epi32(static_cast<int32_t>(kWordFieldMask));
  int64_t plus_size = 0;
  int64_t minus_size = 0;
  int64_t pos = 0;
  for (int64_t k = 0; k < count;) {
    if (pos >= padded_cols || plus_size >= padded_cols || minus_size >= padded_cols) return false;
    const int64_t chunk_end = k + kCheckedChunk < count ? k + kCheckedChunk : k + 1;
    for (; k < chunk_end; ++k) {
      const uint64_t word = dictionary.words[codes[k]];
      const uint64_t kind = __bextr_u64(word, controls.plain_class);
      if (kOverflow && kind == kWordOverflowClass) {
        ListEntryFromMasks(dictionary, codes[k], WordLength(static_cast<uint32_t>(word)), pos,
                           plus_index, &plus_size, minus_index, &minus_size);
      } else {
        const __m128i fields = _mm_add_epi32(
            _mm_and_si128(_mm_srlv_epi32(_mm_set1_epi32(static_cast<int32_t>(word)), field_shifts),
                          field_mask),
            _mm_set1_epi32(static_cast<int32_t>(pos)));
        const __m128i minus_order =
            _mm_load_si128(reinterpret_cast<const __m128i*>(classes.minus_fields[kind]));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(plus_index + plus_size), fields);
        _mm_storeu_si128(
            reinterpret_cast<__m128i*>(minus_index + minus_size),
            _mm_castps_si128(_mm_permutevar_ps(_mm_castsi128_ps(fields), minus_order)));
        plus_size += classes.plus_count[kind];
        minus_size += classes.minus_count[kind];
      }
      pos += __bextr_u64(word, controls.length);
    }
  }
  *plus_count = plus_size;
  *minus_count = minus_size;
  return pos == padded_cols;
}

QMOE_AVX2 bool RowNonzeros(const DictionaryView& dictionary, const uint16_t* codes, int64_t count,
                           int64_t padded_cols, int32_t* plus_index, int64_t* plus_count,
                           int32_t* minus_index, int64_t* minus_count) {
  const auto run = dictionary.words_overflow ? RowNonzerosWith<true> : RowNonzerosWith<false>;
  return run(dictionary, codes, count, padded_cols, plus_index, plus_count, minus_index,
             minus_count);
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
  static const RowKernels kernels{"avx2", RowsDot, RowNonzeros, GatherTokenRows, ScatterTokenRows};
  return kernels;
}

}  // namespace qmoe::cpu
