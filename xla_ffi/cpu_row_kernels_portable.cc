// Portable C++ row kernels: each codeword's nonzero weights come from its
// word (qmoe_format.h), or from its mask bits when it overflows the word.
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
          classes.weights[kind][kWordFields + field] =
              field >= plus && field < plus + minus ? 1.0f : 0.0f;
        }
      }
    }
    return classes;
  }();
  return table;
}

bool WordsRowNonzeros(const DictionaryView& dictionary, const uint16_t* codes, int64_t count,
                      int64_t padded_cols, int32_t* plus_index, int64_t* plus_count,
                      int32_t* minus_index, int64_t* minus_count) {
  const WordClasses& classes = WordClassTable();
  int64_t plus_size = 0;
  int64_t minus_size = 0;
  int64_t pos = 0;
  for (int64_t k = 0; k < count; ++k) {
    if (pos >= padded_cols) return false;
    const uint32_t word = dictionary.words[codes[k]];
    const uint32_t kind = WordClass(word);
    if (dictionary.words_overflow && kind == kWordOverflowClass) {
      ListEntryFromMasks(dictionary, codes[k], WordLength(word), pos, plus_index, &plus_size,
                         minus_index, &minus_size);
    } else {
      // All four fields go to both lists, and the counts keep the ones that
      // belong: no branch per weight. Lists never outgrow pos + kWordFields,
      // inside their kIndexSlack.
      const int32_t plus_here = classes.plus_count[kind];
      const uint32_t minus_fields = word >> (kWordFieldBits * plus_here);
      for (int field = 0; field < kWordFields; ++field) {
        plus_index[plus_size + field] = static_cast<int32_t>(pos + WordField(word, field));
        minus_index[minus_size + field] = static_cast<int32_t>(pos + WordField(minus_fields, field));
      }
      plus_size += plus_here;
      minus_size += classes.minus_count[kind];
    }
    pos += WordLength(word);
  }
  *plus_count = plus_size;
  *minus_count = minus_size;
  return pos == padded_cols;
}

namespace {

bool RowDot(const DictionaryView& dictionary, const uint16_t* codes, int64_t count,
            const float* x, int64_t padded_cols, float* plus_sum, float* minus_sum) {
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
