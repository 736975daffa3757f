// Portable C++ row kernels: each codeword's nonzero weights come from its
// word (qmoe_format.h), or from its mask bits when it overflows the word.
#include <algorithm>
#include <cstring>

#include "cpu_row_kernels.h"

namespace qmoe::cpu {

const WordClasses& WordClassTable() {
  static const WordClasses table = [] {
    WordClasses classes{};
    for (int plus = 0; plus <= kWordFields; ++plus) {
      for (int minus = 0; plus + minus <= kWordFields; ++minus) {
        const int kind = (kWordFields + 1) * plus + minus;
        classes.plus_count[kind] = plus;
        classes.minus_count[kind] = minus;
        for (int field = 0; field < kWordFields; ++field) {
          classes.weights[kind][field] = field < plus ? 1.0f : 0.0f;
          classes.weights[kind][kWordFields + field] = field >= plus && field < plus + minus ? 1.0f
                                                                                             : 0.0f;
          classes.minus_fields[kind][field] = std::min(plus + field, kWordFields - 1);
        }
      }
    }
    return classes;
  }();
  return table;
}

namespace {

// The lists of one row so far.
struct NonzeroLists {
  int32_t* plus_index;
  int32_t* minus_index;
  int64_t plus_size;
  int64_t minus_size;
  int64_t pos;
};

// Appends one codeword's weights to the lists; code for overflowing entries
// only where the dictionary has them (their path takes the sizes' addresses).
template <bool kOverflow>
__attribute__((always_inline)) inline void ListCodeword(const DictionaryView& dictionary,
                                                        const WordClasses& classes, uint16_t code,
                                                        NonzeroLists& lists) {
  const uint32_t word = dictionary.words[code];
  const uint32_t kind = WordClass(word);
  if (kOverflow && kind == kWordOverflowClass) {
    ListEntryFromMasks(dictionary, code, WordLength(word), lists.pos, lists.plus_index,
                       &lists.plus_size, lists.minus_index, &lists.minus_size);
  } else {
    // All four fields go to both lists, and the counts keep the ones that
    // belong: no branch per weight.
    const int32_t plus_here = classes.plus_count[kind];
    const uint32_t minus_fields = word >> (kWordFieldBits * plus_here);
    for (int field = 0; field < kWordFields; ++field) {
      lists.plus_index[lists.plus_size + field] =
          static_cast<int32_t>(lists.pos + WordField(word, field));
      lists.minus_index[lists.minus_size + field] =
          static_cast<int32_t>(lists.pos + WordField(minus_fields, field));
    }
    lists.plus_size += plus_here;
    lists.minus_size += classes.minus_count[kind];
  }
  lists.pos += WordLength(word);
}

// A codeword adds at most 31 entries to a list (4 through its word), so lists
// shorter than padded_cols at a check stay inside their kIndexSlack until the
// next one, kCheckedChunk codewords later. Words derived from the masks never
// list more weights than a codeword covers, so their lists stay no longer than
// pos and never fail this check; a garbage words form that claims more makes
// the row fail instead of writing past the lists. As in the AVX2 rows_dot,
// checking only each chunk's start and the row's last codeword still fails
// every row with a codeword starting at or past padded_cols: starts never
// decrease.
template <bool kOverflow>
bool WordsRowNonzerosWith(const DictionaryView& dictionary, const uint16_t* codes, int64_t count,
                          int64_t padded_cols, int32_t* plus_index, int64_t* plus_count,
                          int32_t* minus_index, int64_t* minus_count) {
  const WordClasses& classes = WordClassTable();
  NonzeroLists lists{plus_index, minus_index, 0, 0, 0};
  const auto in_bounds = [&] {
    return lists.pos < padded_cols && lists.plus_size < padded_cols &&
           lists.minus_size < padded_cols;
  };
  int64_t k = 0;
  for (; k + kCheckedChunk < count; k += kCheckedChunk) {
    if (!in_bounds()) return false;
    for (int64_t i = 0; i < kCheckedChunk; ++i) {
      ListCodeword<kOverflow>(dictionary, classes, codes[k + i], lists);
    }
  }
  for (; k < count; ++k) {
    if (!in_bounds()) return false;
    ListCodeword<kOverflow>(dictionary, classes, codes[k], lists);
  }
  *plus_count = lists.plus_size;
  *minus_count = lists.minus_size;
  return lists.pos == padded_cols;
}

}  // namespace

bool WordsRowNonzeros(const DictionaryView& dictionary, const uint16_t* codes, int64_t count,
                      int64_t padded_cols, int32_t* plus_index, int64_t* plus_count,
                      int32_t* minus_index, int64_t* minus_count) {
  const auto run = dictionary.words_overflow ? WordsRowNonzerosWith<true>
                                             : WordsRowNonzerosWith<false>;
  return run(dictionary, codes, count, padded_cols, plus_index, plus_count, minus_index,
             minus_count);
}

namespace {

bool RowDot(const DictionaryView& dictionary, const uint16_t* codes, int64_t count, const float* x,
            int64_t padded_cols, float* plus_sum, float* minus_sum) {
  const WordClasses& classes = WordClassTable();
  float plus_total = 0.0f;
  float minus_total = 0.0f;
  int64_t pos = 0;
  for (int64_t k = 0; k < count; ++k) {
    if (pos >= padded_cols) return false;
    const uint32_t word = dictionary.words[codes[k]];
    const uint32_t kind = WordClass(word);
    const float* window = x + pos;
    if (dictionary.words_overflow && kind == kWordOverflowClass) {
      AddEntryFromMasks(dictionary, codes[k], WordLength(word), window, &plus_total, &minus_total);
    } else {
      const float* weights = classes.weights[kind];
      for (int field = 0; field < kWordFields; ++field) {
        const float value = window[WordField(word, field)];
        plus_total += weights[field] * value;
        minus_total += weights[kWordFields + field] * value;
      }
    }
    pos += WordLength(word);
  }
  *plus_sum = plus_total;
  *minus_sum = minus_total;
  return pos == padded_cols;
}

void GatherTokenRows(const float* table, const int32_t* index, int64_t count, float* sum) {
  float total[kTokenLanes] = {};
  for (int64_t i = 0; i < count; ++i) {
    const float* row = table + kTokenLanes * index[i];
    for (int64_t lane = 0; lane < kTokenLanes; ++lane) total[lane] += row[lane];
  }
  std::memcpy(sum, total, sizeof(total));
}

void ScatterTokenRows(float* table, const int32_t* index, int64_t count, const float* value) {
  for (int64_t i = 0; i < count; ++i) {
    float* row = table + kTokenLanes * index[i];
    for (int64_t lane = 0; lane < kTokenLanes; ++lane) row[lane] += value[lane];
  }
}

}  // namespace

const RowKernels& PortableRowKernels() {
  static const RowKernels kernels{"portable", RowsDotOneByOne<RowDot>, WordsRowNonzeros,
                                  GatherTokenRows, ScatterTokenRows};
  return kernels;
}

}  // namespace qmoe::cpu
