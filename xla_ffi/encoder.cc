// Dictionary encoder of format v1 (docs/format.md §5): greedy longest-prefix
// matching of each row's pair symbols against the 2^16 dictionary entries.
//
// Lingo: a row of `cols` ternary codes (0 = zero, 1 = min, 2 = max) is read as
// pair symbols s = a + 3*b (a zero weight pads an odd row). The encoder walks
// a trie whose node i+1 is dictionary entry i (node 0 is the empty sequence):
// a codeword starts with one pair, is extended by one pair while the extended
// sequence is an entry, and is emitted when it cannot grow; the next codeword
// starts at the pair that did not fit. This is exactly
// `qmoe_jax.codec.reference.encode_reference`, including its behaviour on
// dictionaries that are not prefix-closed (the walk stops at the first missing
// prefix, except that a codeword's first pair is always taken; emitting a
// one-pair codeword that is no entry is an error) and on duplicate entries
// (the last index wins).
//
// Rows are independent, so large inputs are split into row chunks encoded by
// std::threads with the GIL released; each chunk writes its own buffer and the
// buffers are concatenated afterwards.
#include "encoder.h"

#include <pybind11/numpy.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <new>
#include <string>
#include <system_error>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "qmoe_format.h"

namespace py = pybind11;

namespace qmoe {
namespace {

constexpr int kPairSymbols = 9;
// Nodes kOnePairNodes + s stand for the one-pair sequences (s) that are not
// entries, so that a codeword can still start with them.
constexpr int32_t kOnePairNodes = kDictionaryEntries + 1;
constexpr int32_t kTrieNodes = kOnePairNodes + kPairSymbols;
constexpr int kEntryPairCountMask = 15;
// Below this many weights per thread, starting a thread costs more than it saves.
constexpr int64_t kMinWeightsPerThread = int64_t{1} << 18;

// The first bad input a chunk of rows met; failures are data until the
// threads have joined, then the earliest one becomes the Python exception.
struct RowFailure {
  int64_t row = -1;  // flat row index over all matrices; -1 = no failure
  int64_t col = 0;
  int value = 0;
  bool missing_pair = false;  // true: the dictionary lacks a one-pair entry
};

// Encodes one row into `out` (room for PaddedCols(cols) / 2 codewords) and
// returns the number of codewords, or -1 after filling `failure`.
int64_t EncodeRow(const uint8_t* row, int64_t cols, const int32_t* children, uint16_t* out,
                  RowFailure* failure) {
  uint8_t largest = 0;
  for (int64_t c = 0; c < cols; ++c) largest = std::max(largest, row[c]);
  if (largest > 2) {
    const int64_t col = std::find_if(row, row + cols, [](uint8_t v) { return v > 2; }) - row;
    failure->col = col;
    failure->value = row[col];
    return -1;
  }
  int64_t written = 0;
  int32_t node = 0;
  // Emits the codeword of `node`, whose last pair starts at column `col`.
  auto emit = [&](int64_t col) {
    if (node >= kOnePairNodes) {
      failure->col = col;
      failure->value = node - kOnePairNodes;
      failure->missing_pair = true;
      return false;
    }
    out[written++] = static_cast<uint16_t>(node - 1);
    return true;
  };
  // Adds the pair `symbol` starting at column `col`.
  auto step = [&](int symbol, int64_t col) {
    int32_t next = children[node * kPairSymbols + symbol];
    if (next == 0) {
      if (!emit(col - 2)) return false;
      next = children[symbol];
    }
    node = next;
    return true;
  };
  const int64_t full_pairs = cols / 2;
  for (int64_t p = 0; p < full_pairs; ++p) {
    if (!step(row[2 * p] + 3 * row[2 * p + 1], 2 * p)) return -1;
  }
  if (cols & 1) {
    if (!step(row[cols - 1], cols - 1)) return -1;
  }
  if (node != 0 && !emit(2 * ((cols - 1) / 2))) return -1;
  return written;
}

// Rows [first_row, end_row) of the flattened input, encoded into `codes`.
struct RowChunk {
  int64_t first_row = 0;
  int64_t end_row = 0;
  std::vector<uint16_t> codes;
  RowFailure failure;
  bool out_of_memory = false;
};

void EncodeChunk(const uint8_t* input, int64_t cols, const int32_t* children, int64_t* row_lengths,
                 RowChunk* chunk) {
  const int64_t max_codes_per_row = PaddedCols(cols) / 2;
  const int64_t rows = chunk->end_row - chunk->first_row;
  try {
    // About one codeword per 10 pairs at p0 = 0.885; grown on demand.
    chunk->codes.resize(static_cast<size_t>(rows * max_codes_per_row / 8 + max_codes_per_row));
    int64_t used = 0;
    for (int64_t r = chunk->first_row; r < chunk->end_row; ++r) {
      if (used + max_codes_per_row > static_cast<int64_t>(chunk->codes.size())) {
        chunk->codes.resize(static_cast<size_t>(2 * (used + max_codes_per_row)));
      }
      const int64_t written = EncodeRow(input + r * cols, cols, children,
                                        chunk->codes.data() + used, &chunk->failure);
      if (written < 0) {
        chunk->failure.row = r;
        break;
      }
      row_lengths[r] = written;
      used += written;
    }
    chunk->codes.resize(static_cast<size_t>(used));
  } catch (const std::bad_alloc&) {
    chunk->out_of_memory = true;
  }
}

template <typename Work>
void RunOnThreads(int num_tasks, const Work& work) {
  std::vector<std::thread> workers;
  for (int t = 1; t < num_tasks; ++t) {
    try {
      workers.emplace_back(work, t);
    } catch (const std::system_error&) {
      work(t);  // No thread available: do this task here.
    }
  }
  work(0);
  for (auto& worker : workers) worker.join();
}

class EncoderTable {
 public:
  // entries: uint32[65536, 2], the canonical dictionary layout.
  explicit EncoderTable(const py::array& entries);

  // codes: uint8[rows, cols] or uint8[matrices, rows, cols] in {0, 1, 2}.
  // Returns (codes, row_offsets): uint16[n_codes] and int32[rows + 1] for one
  // matrix; uint16[matrices, longest] (zero padded) and int32[matrices, rows + 1]
  // for a stack, with offsets per matrix.
  py::tuple Encode(const py::array& codes, int num_threads) const;

  int64_t reachable_entries() const { return reachable_entries_; }

 private:
  // children_[node * 9 + symbol]: node 0 is the empty sequence, node i + 1 is
  // entry i, node kOnePairNodes + s the one-pair sequence (s) when it is no
  // entry; the value is the child's node, or 0 when the extended sequence is
  // not an entry. Every child of the root exists.
  std::vector<int32_t> children_;
  int64_t reachable_entries_ = 0;
};

// Entry key: pair count in bits [59:56], pair symbol j in bits [4j+3 : 4j].
uint64_t EntryKey(uint32_t word0, uint32_t word1, int64_t index) {
  const uint32_t pair_count = word0 & kEntryPairCountMask;
  if (pair_count < 1 || pair_count > static_cast<uint32_t>(kMaxPairsPerCode) ||
      (word1 & kEntryPairCountMask) != pair_count) {
    throw py::value_error("dictionary entry " + std::to_string(index) + " has pair counts " +
                          std::to_string(word0 & kEntryPairCountMask) + " and " +
                          std::to_string(word1 & kEntryPairCountMask) +
                          ", expected one count in 1.." + std::to_string(kMaxPairsPerCode) +
                          "; the dictionary is corrupt");
  }
  uint64_t key = uint64_t{pair_count} << 56;
  for (uint32_t k = 0; k < 2 * kMaxPairsPerCode; ++k) {
    const uint32_t word = k < kMaxPairsPerCode ? word0 : word1;
    const uint32_t weight = (word >> (4 + 2 * (k % kMaxPairsPerCode))) & 3u;
    if (k >= 2 * pair_count) {
      if (weight != 0) {
        throw py::value_error(
            "dictionary entry " + std::to_string(index) +
            " has a non-zero weight past its pair count; the dictionary is corrupt");
      }
      continue;
    }
    if (weight > 2) {
      throw py::value_error(
          "dictionary entry " + std::to_string(index) +
          " holds weight code 3, which is not ternary; the dictionary is corrupt");
    }
    key += uint64_t{k % 2 == 0 ? weight : 3 * weight} << (4 * (k / 2));
  }
  return key;
}

EncoderTable::EncoderTable(const py::array& entries) {
  if (!entries.dtype().is(py::dtype::of<uint32_t>()) || entries.ndim() != 2 ||
      entries.shape(0) != kDictionaryEntries || entries.shape(1) != 2) {
    throw py::value_error("dictionary entries must be uint32[" +
                          std::to_string(kDictionaryEntries) + ", 2]; pass Dictionary.entries");
  }
  const auto contiguous = py::array_t<uint32_t, py::array::c_style>::ensure(entries);
  const uint32_t* words = contiguous.data();
  std::unordered_map<uint64_t, int32_t> index_of;
  index_of.reserve(2 * kDictionaryEntries);
  for (int64_t i = 0; i < kDictionaryEntries; ++i) {
    index_of[EntryKey(words[2 * i], words[2 * i + 1], i)] = static_cast<int32_t>(i);
  }
  children_.assign(kTrieNodes * kPairSymbols, 0);
  for (int s = 0; s < kPairSymbols; ++s) children_[s] = kOnePairNodes + s;
  for (const auto& [key, index] : index_of) {
    const uint64_t pair_count = key >> 56;
    if (pair_count == 1) children_[key & 15] = index + 1;
  }
  for (const auto& [key, index] : index_of) {
    const uint64_t pair_count = key >> 56;
    if (pair_count == 1) continue;
    const uint64_t last_shift = 4 * (pair_count - 1);
    const uint64_t prefix_key = ((pair_count - 1) << 56) |
                                (key & ((uint64_t{1} << last_shift) - 1));
    int32_t parent;
    if (pair_count == 2) {
      parent = children_[prefix_key & 15];
    } else {
      const auto found = index_of.find(prefix_key);
      if (found == index_of.end()) continue;  // Unreachable, as in the reference.
      parent = found->second + 1;
    }
    children_[parent * kPairSymbols + ((key >> last_shift) & 15)] = index + 1;
  }
  // Entries reachable from the root through entries (all of them when the
  // dictionary is prefix-closed).
  std::vector<int32_t> stack = {0};
  while (!stack.empty()) {
    const int32_t node = stack.back();
    stack.pop_back();
    for (int s = 0; s < kPairSymbols; ++s) {
      if (const int32_t child = children_[node * kPairSymbols + s]) {
        if (child < kOnePairNodes) ++reachable_entries_;
        stack.push_back(child);
      }
    }
  }
}

std::string DescribeFailure(const RowFailure& failure, int64_t rows, bool stacked) {
  std::string where = "row " + std::to_string(failure.row % rows) + ", column " +
                      std::to_string(failure.col);
  if (stacked) where = "expert " + std::to_string(failure.row / rows) + ", " + where;
  if (failure.missing_pair) {
    const int symbol = failure.value;
    return "the dictionary has no one-pair entry for the weights (" + std::to_string(symbol % 3) +
           ", " + std::to_string(symbol / 3) + ") at " + where +
           "; it cannot encode this row (build it with build_dictionary)";
  }
  return "ternary codes must be 0, 1 or 2; found " + std::to_string(failure.value) + " at " + where;
}

py::tuple EncoderTable::Encode(const py::array& codes, int num_threads) const {
  if (!codes.dtype().is(py::dtype::of<uint8_t>())) {
    throw py::type_error("codes must be uint8 ternary codes, got dtype " +
                         std::string(py::str(codes.dtype())));
  }
  if (codes.ndim() != 2 && codes.ndim() != 3) {
    throw py::value_error("codes must be uint8[rows, cols] or uint8[matrices, rows, cols], got " +
                          std::to_string(codes.ndim()) + " dimensions");
  }
  const bool stacked = codes.ndim() == 3;
  const int64_t matrices = stacked ? codes.shape(0) : 1;
  const int64_t rows = codes.shape(codes.ndim() - 2);
  const int64_t cols = codes.shape(codes.ndim() - 1);
  const auto input = py::array_t<uint8_t, py::array::c_style>::ensure(codes);
  const int64_t total_rows = matrices * rows;

  int64_t threads = num_threads > 0 ? num_threads
                                    : std::max(1u, std::thread::hardware_concurrency());
  threads = std::min(threads, std::max<int64_t>(1, total_rows * cols / kMinWeightsPerThread));
  threads = std::max<int64_t>(1, std::min(threads, total_rows));
  std::vector<RowChunk> chunks(static_cast<size_t>(threads));
  for (int64_t t = 0; t < threads; ++t) {
    chunks[t].first_row = total_rows * t / threads;
    chunks[t].end_row = total_rows * (t + 1) / threads;
  }
  std::vector<int64_t> row_lengths(static_cast<size_t>(total_rows), 0);
  {
    py::gil_scoped_release release;
    const uint8_t* data = input.data();
    RunOnThreads(static_cast<int>(threads), [&](int t) {
      EncodeChunk(data, cols, children_.data(), row_lengths.data(), &chunks[t]);
    });
  }
  for (const RowChunk& chunk : chunks) {
    if (chunk.out_of_memory) throw std::bad_alloc();
    if (chunk.failure.row >= 0)
      throw py::value_error(DescribeFailure(chunk.failure, rows, stacked));
  }

  std::vector<int64_t> codes_per_matrix(static_cast<size_t>(matrices), 0);
  for (int64_t r = 0; r < total_rows; ++r)
    codes_per_matrix[r / std::max<int64_t>(rows, 1)] += row_lengths[r];
  const int64_t longest =
      matrices > 0 ? *std::max_element(codes_per_matrix.begin(), codes_per_matrix.end()) : 0;
  if (longest > std::numeric_limits<int32_t>::max()) {
    throw py::value_error("a matrix encodes to " + std::to_string(longest) +
                          " codewords, more than int32 row offsets can address; split it into "
                          "smaller matrices");
  }
  py::array_t<uint16_t> out_codes(stacked ? std::vector<py::ssize_t>{matrices, longest}
                                          : std::vector<py::ssize_t>{longest});
  py::array_t<int32_t> out_offsets(stacked ? std::vector<py::ssize_t>{matrices, rows + 1}
                                           : std::vector<py::ssize_t>{rows + 1});
  {
    py::gil_scoped_release release;
    uint16_t* code_data = out_codes.mutable_data();
    int32_t* offset_data = out_offsets.mutable_data();
    std::fill(code_data, code_data + matrices * longest, uint16_t{0});
    for (int64_t m = 0; m < matrices; ++m) {
      int32_t offset = 0;
      offset_data[m * (rows + 1)] = 0;
      for (int64_t r = 0; r < rows; ++r) {
        offset += static_cast<int32_t>(row_lengths[m * rows + r]);
        offset_data[m * (rows + 1) + r + 1] = offset;
      }
    }
    // Each chunk's codes are consecutive rows; split them at matrix borders.
    for (const RowChunk& chunk : chunks) {
      int64_t source = 0;
      int64_t r = chunk.first_row;
      while (r < chunk.end_row) {
        const int64_t m = r / rows;
        const int64_t end = std::min(chunk.end_row, (m + 1) * rows);
        const int64_t start = offset_data[m * (rows + 1) + (r - m * rows)];
        const int64_t stop = offset_data[m * (rows + 1) + (end - m * rows)];
        std::memcpy(code_data + m * longest + start, chunk.codes.data() + source,
                    static_cast<size_t>(stop - start) * sizeof(uint16_t));
        source += stop - start;
        r = end;
      }
    }
  }
  return py::make_tuple(out_codes, out_offsets);
}

}  // namespace

void RegisterEncoder(py::module_& m) {
  py::class_<EncoderTable>(m, "EncoderTable",
                           "Trie of a dictionary for greedy longest-prefix encoding (format v1).")
      .def(
          py::init<const py::array&>(), py::arg("entries"),
          "Builds the table from canonical entries uint32[65536, 2]; raises ValueError if corrupt.")
      .def("encode", &EncoderTable::Encode, py::arg("codes"), py::arg("num_threads") = 0,
           "Encodes uint8[rows, cols] or uint8[matrices, rows, cols] ternary codes.\n\n"
           "Returns (codes uint16, row_offsets int32); see qmoe_jax.codec.encode. "
           "num_threads <= 0 uses every core.")
      .def_property_readonly("reachable_entries", &EncoderTable::reachable_entries,
                             "Entries the greedy walk can reach (65536 when prefix-closed).");
}

}  // namespace qmoe
