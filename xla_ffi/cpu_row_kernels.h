// Per-row inner loops of the CPU kernels, one implementation per instruction
// set (portable C++, AVX2, AVX-512), chosen at run time by cpu_kernels.cc.
//
// Lingo: a row's codes decode left to right into `padded_cols` weights; a
// codeword starting at weight position `pos` covers 2*pair_count weights.
// "Plus" weights are the row maximum, "minus" weights the row minimum, so
// y_r = max_r * plus_sum + min_r * minus_sum.
//
// Memory safety does not depend on the operands: every loop stops before a
// codeword that would start at or past `padded_cols`, a codeword covers at
// most 31 weights, and buffers carry kDensePad slack behind `padded_cols`
// (kRowsDotSlack for rows_dot's x, which may check starts once per chunk).
// Garbage codes or dictionaries give wrong numbers or a `false` return,
// never an out-of-bounds access.
#pragma once

#include <cstdint>
#include <vector>

#include "qmoe_format.h"

// The target attribute of code built for AVX-512. The test build with
// QMOE_EMULATE_AVX512 (.ci/asan_fuzz) builds that code for the host
// instead, with the row kernels' intrinsics replaced by scalar stand-ins
// (avx512_emulation.h), so that a CPU without AVX-512 runs its logic.
#if defined(QMOE_EMULATE_AVX512)
#define QMOE_AVX512_TARGET(features)
#else
#define QMOE_AVX512_TARGET(features) __attribute__((target(features)))
#endif

namespace qmoe::cpu {

// Zero floats behind each dense row, so a 32-float window at any codeword
// start stays inside the buffer.
inline constexpr int64_t kDensePad = 32;
// Codewords a kernel may decode between two checks of where the next one
// starts (and, for the position lists, of their sizes): rows_dot (AVX2) and
// row_nonzeros (AVX2, portable). A codeword covers at most 31 weights and
// adds at most 31 entries to a list, so a chunk that began in bounds ends
// within 4 * 31 of it; the slacks below hold that.
inline constexpr int64_t kCheckedChunk = 4;
inline constexpr int64_t kMaxCodewordWeights = 31;
// Zero floats behind rows_dot's x (a chunk's windows may run past padded_cols).
inline constexpr int64_t kRowsDotSlack = 128;
// Tokens per block in the token-major ("transposed") layouts.
inline constexpr int64_t kTokenLanes = 16;
// Slack entries behind `padded_cols` in each nonzero-position list (a chunk's
// entries may run past it before the row fails).
inline constexpr int64_t kIndexSlack = 128;
static_assert(kCheckedChunk * kMaxCodewordWeights <= kRowsDotSlack);
static_assert(kCheckedChunk * kMaxCodewordWeights <= kIndexSlack);

// The three kernel forms of a dictionary (see qmoe_format.h).
struct DictionaryView {
  const uint32_t* masks;  // [65536][2]
  const uint8_t* slots;   // [65536][16]
  bool slots_overflow;    // some entry overflows its slots (kSlotsTableOverflows)
  const uint32_t* words;  // [65536]
  bool words_overflow;    // some entry overflows its word (kWordsTableOverflows)
  bool words_fourth;      // some entry has 4 nonzero weights (kWordsTableHasFourth)
};

// Rows [begin, end) of one compressed matrix.
struct RowSpan {
  const uint16_t* codes;
  const int32_t* row_offsets;  // validated
  int64_t begin;
  int64_t end;
};

struct RowKernels {
  const char* isa;
  // For each row r of `rows`, sums x over its plus and minus weights into
  // plus_sums[r - begin] and minus_sums[r - begin]. `x` holds padded_cols +
  // kRowsDotSlack floats, zero from `cols` on. Returns the first row whose codes
  // do not decode to exactly `padded_cols` weights, or rows.end.
  int64_t (*rows_dot)(const DictionaryView& dictionary, const RowSpan& rows, const float* x,
                      int64_t padded_cols, float* plus_sums, float* minus_sums);
  // Lists the positions of one row's plus and minus weights in ascending
  // order. Each list needs room for padded_cols + kIndexSlack entries.
  // Returns false unless the codes decode to exactly `padded_cols` weights.
  bool (*row_nonzeros)(const DictionaryView& dictionary, const uint16_t* codes, int64_t count,
                       int64_t padded_cols, int32_t* plus, int64_t* plus_count, int32_t* minus,
                       int64_t* minus_count);
  // sum[0:16] = sum over i of table[16 * index[i] : 16 * index[i] + 16].
  void (*gather_token_rows)(const float* table, const int32_t* index, int64_t count, float* sum);
  // table[16 * index[i] : 16 * index[i] + 16] += value[0:16] for every i.
  void (*scatter_token_rows)(float* table, const int32_t* index, int64_t count, const float* value);
};

const RowKernels& PortableRowKernels();
const RowKernels& Avx2RowKernels();    // call only where CpuHasAvx2()
const RowKernels& Avx512RowKernels();  // call only where CpuHasAvx512()

bool CpuHasAvx2();
bool CpuHasAvx512();
// Instruction sets the row kernels can run here, fastest first; "auto" (QMOE_CPU_ISA unset) takes
// the first.
std::vector<const char*> CpuIsas();

// A codeword's length in weights (0..31) from its slots (AVX-512); the
// words (AVX2, portable) give the same length for the forms qmoe_jax.ops
// computes, so all instruction sets agree on where a row ends.
inline uint32_t EntryLength(const DictionaryView& dictionary, uint16_t code) {
  return dictionary.slots[kSlotBytes * static_cast<uint32_t>(code) + kSlotMetaByte] &
         kSlotLengthMask;
}

// The plus and minus bits of a codeword from the masks, limited to its own
// `length` weights.
inline void EntryBits(const DictionaryView& dictionary, uint16_t code, uint32_t length,
                      uint32_t* plus, uint32_t* minus) {
  const uint32_t* entry = dictionary.masks + 2 * static_cast<uint32_t>(code);
  const uint32_t within = kWeightMask & ((1u << length) - 1u);  // length <= 31
  *plus = entry[0] & within;
  *minus = entry[1] & within;
}

// For codewords that overflow the slots or the words: adds the window's
// values at the codeword's plus and minus weights, read from its masks.
inline void AddEntryFromMasks(const DictionaryView& dictionary, uint16_t code, uint32_t length,
                              const float* window, float* plus_sum, float* minus_sum) {
  uint32_t plus, minus;
  EntryBits(dictionary, code, length, &plus, &minus);
  for (; plus != 0; plus &= plus - 1) *plus_sum += window[__builtin_ctz(plus)];
  for (; minus != 0; minus &= minus - 1) *minus_sum += window[__builtin_ctz(minus)];
}

// The same codewords for row_nonzeros: appends pos + the positions of their
// plus and minus weights to the lists. Bits lie below `length`, so the lists
// never outgrow pos + length.
inline void ListEntryFromMasks(const DictionaryView& dictionary, uint16_t code, uint32_t length,
                               int64_t pos, int32_t* plus_index, int64_t* plus_size,
                               int32_t* minus_index, int64_t* minus_size) {
  uint32_t plus, minus;
  EntryBits(dictionary, code, length, &plus, &minus);
  for (; plus != 0; plus &= plus - 1) plus_index[(*plus_size)++] = pos + __builtin_ctz(plus);
  for (; minus != 0; minus &= minus - 1) minus_index[(*minus_size)++] = pos + __builtin_ctz(minus);
}

// Per word class (qmoe_format.h): lanes 0..3 weigh fields 0..3 as plus
// weights (1 or 0), lanes 4..7 as minus weights; the overflow class and
// classes past 5*4 + 4 weigh nothing. Counts are the plus and minus fields.
// The AVX2 rows_dot reads 8 floats at class * 8 + (0..7) (see WordControls
// in cpu_row_kernels_avx2.cc), hence one zero row of padding.
struct WordClasses {
  alignas(32) float weights[kWordClasses + 1][8];
  // Lane i: the field that holds the class's i-th minus weight (plus_count
  // + i, at most 3), for row_nonzeros' permute (AVX2); lanes past the minus
  // count are don't-cares.
  alignas(16) int32_t minus_fields[kWordClasses][4];
  int32_t plus_count[kWordClasses];
  int32_t minus_count[kWordClasses];
};
const WordClasses& WordClassTable();

inline uint32_t WordField(uint32_t word, int field) {
  return (word >> (kWordFieldBits * field)) & kWordFieldMask;
}

// row_nonzeros from the words, for every instruction set that reads them.
bool WordsRowNonzeros(const DictionaryView& dictionary, const uint16_t* codes, int64_t count,
                      int64_t padded_cols, int32_t* plus_index, int64_t* plus_count,
                      int32_t* minus_index, int64_t* minus_count);

// rows_dot for instruction sets that decode one row at a time.
template <bool (*RowDot)(const DictionaryView&, const uint16_t*, int64_t, const float*, int64_t,
                         float*, float*)>
int64_t RowsDotOneByOne(const DictionaryView& dictionary, const RowSpan& rows, const float* x,
                        int64_t padded_cols, float* plus_sums, float* minus_sums) {
  for (int64_t r = rows.begin; r < rows.end; ++r) {
    const int32_t begin = rows.row_offsets[r];
    if (!RowDot(dictionary, rows.codes + begin, rows.row_offsets[r + 1] - begin, x, padded_cols,
                &plus_sums[r - rows.begin], &minus_sums[r - rows.begin])) {
      return r;
    }
  }
  return rows.end;
}

}  // namespace qmoe::cpu
