// Constants of the qmoe_jax compressed format v1 (docs/format.md), shared by the
// CPU and CUDA code.
//
// A matrix W[rows, cols] (y = W·x) is stored per row as a run of uint16
// codewords. Codeword i indexes entry i of a 2^16-entry dictionary; each entry
// expands to 1..14 pairs of ternary weights (0 = zero, 1 = row min, 2 = row
// max). Rows are encoded independently: row r owns codes[row_offsets[r] :
// row_offsets[r+1]]. A row with odd `cols` is padded with one zero weight, so
// a well-formed row decodes to exactly 2*ceil(cols/2) weights.
//
// Kernels do not read the canonical entries; they take the "mask" form that
// qmoe_jax.codec.Dictionary.masks precomputes once per dictionary:
//   masks[i][0] = plus_mask  | (pair_count << 28)   bit k set: weight k is max
//   masks[i][1] = minus_mask                         bit k set: weight k is min
// so that y_r = max_r * sum(x over plus bits) + min_r * sum(x over minus bits).
//
// The CPU kernels also take a sparse "slots" form (qmoe_jax.ops computes it
// once per dictionary from the masks), 16 bytes per entry:
//   bytes 0..7   positions (0..27) of the entry's plus weights, ascending,
//                then kUnusedSlot;
//   bytes 8..14  positions of its minus weights, ascending, then kUnusedSlot;
//   byte 15      2*pair_count, | kSlotsOverflow if the entry has more than 8
//                plus or 7 minus weights (kernels then read its masks);
//                entry 0 also carries kSlotsTableOverflows if any entry of
//                the table overflows, so kernels check entries only then.
// With p0 = 0.885 no entry overflows, and a codeword carries ~2.5 nonzero
// weights on average: a kernel picks them out of a 32-weight window of x with
// one permute instead of masking all 28 lanes twice.
//
// The AVX2 and portable CPU kernels take a third form, "words" (qmoe_jax.ops
// computes it once per dictionary from the masks), one uint32 per entry, a
// quarter of the slots' cache footprint:
//   bits 0..19   four 5-bit fields: positions (0..27) of the entry's nonzero
//                weights, its plus weights first, then its minus weights,
//                each ascending; unused fields 0;
//   bits 20..24  class = 5*plus_count + minus_count when the entry has at
//                most 4 nonzero weights, else kWordOverflowClass (kernels
//                then read its masks);
//   bits 25..29  2*pair_count, the entry's length in weights;
//   bit 30       entry 0 only: some entry of the table overflows;
//   bit 31       entry 0 only: some entry has 4 nonzero weights (without
//                any, kernels read 3 fields).
// Dictionaries built for p0 >= 0.885 have at most 3 nonzero weights per
// entry, so a codeword costs 3 loads of x and one fused multiply-add.
#pragma once

#include <cstdint>

namespace qmoe {

inline constexpr int64_t kDictionaryEntries = 1 << 16;
inline constexpr int kMaxPairsPerCode = 14;
inline constexpr int kMaxWeightsPerCode = 2 * kMaxPairsPerCode;  // 28
inline constexpr int kPairCountShift = 28;
inline constexpr uint32_t kWeightMask = (1u << kMaxWeightsPerCode) - 1u;  // low 28 bits

// Number of weights a well-formed row decodes to (odd rows get one zero pad).
inline constexpr int64_t PaddedCols(int64_t cols) { return cols + (cols & 1); }

inline constexpr int PairCount(uint32_t mask_word0) {
  return static_cast<int>(mask_word0 >> kPairCountShift);
}

inline constexpr int kSlotBytes = 16;
inline constexpr int kPlusSlots = 8;
inline constexpr int kMinusSlots = 7;
inline constexpr int kSlotMetaByte = 15;
inline constexpr uint8_t kUnusedSlot = 31;
inline constexpr uint8_t kSlotsOverflow = 0x80;
inline constexpr uint8_t kSlotsTableOverflows = 0x40;
inline constexpr uint8_t kSlotLengthMask = 0x1F;

inline constexpr int kWordFields = 4;
inline constexpr int kWordFieldBits = 5;
inline constexpr uint32_t kWordFieldMask = 0x1F;
inline constexpr int kWordClassShift = 20;
inline constexpr int kWordLengthShift = 25;
inline constexpr uint32_t kWordOverflowClass = 31;
inline constexpr int kWordClasses = 32;
inline constexpr uint32_t kWordsTableOverflows = 1u << 30;
inline constexpr uint32_t kWordsTableHasFourth = 1u << 31;

inline constexpr uint32_t WordClass(uint32_t word) {
  return (word >> kWordClassShift) & kWordFieldMask;
}
inline constexpr uint32_t WordLength(uint32_t word) {
  return (word >> kWordLengthShift) & kWordFieldMask;
}

}  // namespace qmoe
