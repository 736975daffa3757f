// Portable C++ row kernels: visit each nonzero weight through its mask bit.
#include <cstring>

#include "cpu_row_kernels.h"

namespace qmoe::cpu {
namespace {

bool RowDot(const DictionaryView& dictionary, const uint16_t* codes, int64_t count,
            const float* x, int64_t padded_cols, float* plus_sum, float* minus_sum) {
  float plus_total = 0.0f;
  float minus_total = 0.0f;
  int64_t pos = 0;
  for (int64_t k = 0; k < count; ++k) {
    if (pos >= padded_cols) return false;
    const uint32_t length = EntryLength(dictionary, codes[k]);
    uint32_t plus, minus;
    EntryBits(dictionary, codes[k], length, &plus, &minus);
    for (; plus != 0; plus &= plus - 1) plus_total += x[pos + __builtin_ctz(plus)];
    for (; minus != 0; minus &= minus - 1) minus_total += x[pos + __builtin_ctz(minus)];
    pos += length;
  }
  *plus_sum = plus_total;
  *minus_sum = minus_total;
  return pos == padded_cols;
}

bool RowNonzeros(const DictionaryView& dictionary, const uint16_t* codes, int64_t count,
                 int64_t padded_cols, int32_t* plus_index, int64_t* plus_count,
                 int32_t* minus_index, int64_t* minus_count) {
  int64_t plus_size = 0;
  int64_t minus_size = 0;
  int64_t pos = 0;
  for (int64_t k = 0; k < count; ++k) {
    if (pos >= padded_cols) return false;
    const uint32_t length = EntryLength(dictionary, codes[k]);
    uint32_t plus, minus;
    EntryBits(dictionary, codes[k], length, &plus, &minus);
    // Bits lie below `length`, so the lists never outgrow pos + length.
    for (; plus != 0; plus &= plus - 1) plus_index[plus_size++] = pos + __builtin_ctz(plus);
    for (; minus != 0; minus &= minus - 1) minus_index[minus_size++] = pos + __builtin_ctz(minus);
    pos += length;
  }
  *plus_count = plus_size;
  *minus_count = minus_size;
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
  static const RowKernels kernels{"portable", RowsDotOneByOne<RowDot>, RowNonzeros, GatherTokenRows,
                                  ScatterTokenRows};
  return kernels;
}

}  // namespace qmoe::cpu
