#include "cpu_operands.h"

#include <algorithm>
#include <map>
#include <sstream>
#include <tuple>

namespace ffi = xla::ffi;

namespace qmoe::cpu {
namespace {

std::string Prefix(const char* op) { return std::string(op) + ": "; }

// The flat operand batch index of each result batch index, for an operand
// whose leading dims (checked by CheckBroadcastShape) broadcast to `batch`.
std::vector<int64_t> BatchIndex(Dims dims, const std::vector<int64_t>& batch) {
  std::vector<int64_t> index;
  int64_t size = 1;
  for (int64_t dim : batch) size *= dim;
  index.assign(size, 0);
  for (int64_t flat = 0; flat < size; ++flat) {
    int64_t remainder = flat;
    int64_t operand_flat = 0;
    int64_t stride = 1;
    for (size_t i = batch.size(); i-- > 0;) {
      const int64_t coordinate = remainder % batch[i];
      remainder /= batch[i];
      if (dims[i] != 1) operand_flat += coordinate * stride;
      stride *= dims[i];
    }
    index[flat] = operand_flat;
  }
  return index;
}

ffi::Error CheckOffsetsOfMatrix(const char* op, const int32_t* offsets, int64_t rows,
                                int64_t n_codes, const std::string& where) {
  if (offsets[0] != 0) {
    return ffi::Error::InvalidArgument(Prefix(op) + "row_offsets" + where + " start at " +
                                       std::to_string(offsets[0]) +
                                       ", not 0; the compressed matrix is corrupt");
  }
  for (int64_t r = 0; r < rows; ++r) {
    if (offsets[r + 1] < offsets[r]) {
      return ffi::Error::InvalidArgument(Prefix(op) + "row_offsets" + where + " decrease at row " +
                                         std::to_string(r) + " (" + std::to_string(offsets[r]) +
                                         " then " + std::to_string(offsets[r + 1]) +
                                         "); the compressed matrix is corrupt");
    }
  }
  if (offsets[rows] > n_codes) {
    return ffi::Error::InvalidArgument(
        Prefix(op) + "row_offsets" + where + " end at codeword " + std::to_string(offsets[rows]) +
        ", past the " + std::to_string(n_codes) +
        " codewords of codes; the compressed matrix is corrupt or truncated");
  }
  return ffi::Error::Success();
}

}  // namespace

std::string ShapeString(Dims dims) {
  std::ostringstream out;
  out << "[";
  for (size_t i = 0; i < dims.size(); ++i) out << (i ? ", " : "") << dims[i];
  out << "]";
  return out.str();
}

std::string OfBatch(const std::vector<int64_t>& batch, int64_t index) {
  if (batch.empty()) return "";
  return " of batch index " + std::to_string(index) + " (of leading dims " +
         ShapeString(Dims(batch.data(), batch.size())) + ")";
}

ffi::Error CheckDictionaryForm(const char* op, const char* name, Dims dims, int64_t width,
                               const char* source) {
  const size_t trailing = width > 0 ? 2 : 1;
  bool ok = dims.size() >= trailing && dims[dims.size() - trailing] == kDictionaryEntries &&
            (width == 0 || dims[dims.size() - 1] == width);
  for (size_t i = 0; ok && i + trailing < dims.size(); ++i) ok = dims[i] == 1;
  if (ok) return ffi::Error::Success();
  const std::string shape = width > 0 ? "[65536, " + std::to_string(width) + "]" : "[65536]";
  return ffi::Error::InvalidArgument(Prefix(op) + name + " must have shape " + shape + " (" +
                                     source + "); got " + ShapeString(dims));
}

ffi::Error CheckDenseArgs(const char* op, const DenseArg& in, const DenseArg& out) {
  if (in.type != ffi::DataType::F32 && in.type != ffi::DataType::BF16) {
    return ffi::Error::InvalidArgument(Prefix(op) + in.name + " must be float32 or bfloat16");
  }
  if (out.type != in.type || out.dims.size() < 2 || in.dims.size() != out.dims.size()) {
    return ffi::Error::InvalidArgument(
        Prefix(op) + in.name + " [B..., N, " + in.width + "] and " + out.name + " [B..., N, " +
        out.width + "] must share rank and dtype; got " + in.name + " " + ShapeString(in.dims) +
        ", " + out.name + " " + ShapeString(out.dims));
  }
  return ffi::Error::Success();
}

ffi::Error CheckDequantizeResult(const char* op, Dims dims, int64_t cols) {
  if (dims.size() >= 2 && dims.back() == cols) return ffi::Error::Success();
  return ffi::Error::InvalidArgument(Prefix(op) +
                                     "the result must have shape [B..., rows, cols] with cols = " +
                                     std::to_string(cols) + "; got " + ShapeString(dims));
}

ffi::Error CheckBroadcastShape(const char* op, const char* name, Dims dims,
                               const std::string& expected, const std::vector<int64_t>& batch,
                               const std::vector<int64_t>& trailing) {
  const size_t rank = batch.size() + trailing.size();
  bool ok = dims.size() == rank;
  for (size_t i = 0; ok && i < batch.size(); ++i) ok = dims[i] == batch[i] || dims[i] == 1;
  for (size_t i = 0; ok && i < trailing.size(); ++i) {
    ok = trailing[i] < 0 || dims[batch.size() + i] == trailing[i];
  }
  if (ok) return ffi::Error::Success();
  return ffi::Error::InvalidArgument(
      Prefix(op) + name + " must have shape " + expected +
      " with B... = " + ShapeString(Dims(batch.data(), batch.size())) +
      " (each leading dim equal or 1); got " + ShapeString(dims));
}

ffi::Error CheckCompressedShapes(const char* op, ffi::Buffer<ffi::U32> masks,
                                 ffi::Buffer<ffi::U8> slots, ffi::Buffer<ffi::U32> words,
                                 ffi::Buffer<ffi::U16> codes, ffi::Buffer<ffi::S32> row_offsets,
                                 ffi::Buffer<ffi::BF16> minmax, const std::vector<int64_t>& batch,
                                 int64_t cols, int64_t* rows) {
  if (auto error = CheckDictionaryForm(op, "masks", masks.dimensions(), 2, "Dictionary.masks");
      error.failure()) {
    return error;
  }
  if (auto error = CheckDictionaryForm(op, "slots", slots.dimensions(), kSlotBytes,
                                       "the sparse dictionary form of qmoe_jax.ops");
      error.failure()) {
    return error;
  }
  if (auto error = CheckDictionaryForm(op, "words", words.dimensions(), 0,
                                       "the compact dictionary form of qmoe_jax.ops");
      error.failure()) {
    return error;
  }
  const Dims minmax_dims = minmax.dimensions();
  if (minmax_dims.size() != batch.size() + 2) {
    return ffi::Error::InvalidArgument(
        Prefix(op) + "minmax must have shape [B..., rows, 2] with B... = " +
        ShapeString(Dims(batch.data(), batch.size())) + "; got " + ShapeString(minmax_dims));
  }
  *rows = minmax_dims[batch.size()];
  if (auto error = CheckBroadcastShape(op, "minmax", minmax_dims, "[B..., rows, 2]", batch,
                                       {*rows, 2});
      error.failure()) {
    return error;
  }
  if (auto error = CheckBroadcastShape(op, "codes", codes.dimensions(), "[B..., n_codes]", batch,
                                       {-1});
      error.failure()) {
    return error;
  }
  if (auto error = CheckBroadcastShape(op, "row_offsets", row_offsets.dimensions(),
                                       "[B..., rows + 1] with rows = " + std::to_string(*rows),
                                       batch, {*rows + 1});
      error.failure()) {
    return error;
  }
  if (cols < 0) {
    return ffi::Error::InvalidArgument(Prefix(op) + "cols must be >= 0, got " +
                                       std::to_string(cols));
  }
  return ffi::Error::Success();
}

ffi::Error CheckCompressed(const char* op, ffi::Buffer<ffi::U32> masks, ffi::Buffer<ffi::U8> slots,
                           ffi::Buffer<ffi::U32> words, ffi::Buffer<ffi::U16> codes,
                           ffi::Buffer<ffi::S32> row_offsets, ffi::Buffer<ffi::BF16> minmax,
                           Dims batch, int64_t cols, CompressedOperands* operands) {
  operands->batch.assign(batch.begin(), batch.end());
  const std::vector<int64_t>& leading = operands->batch;
  int64_t rows = 0;
  if (auto error = CheckCompressedShapes(op, masks, slots, words, codes, row_offsets, minmax,
                                         leading, cols, &rows);
      error.failure()) {
    return error;
  }
  const std::vector<int64_t> minmax_index = BatchIndex(minmax.dimensions(), leading);
  const std::vector<int64_t> codes_index = BatchIndex(codes.dimensions(), leading);
  const std::vector<int64_t> offsets_index = BatchIndex(row_offsets.dimensions(), leading);
  const int64_t n_codes = codes.dimensions().back();
  operands->row_offsets = row_offsets.typed_data();
  operands->offsets_matrices = row_offsets.element_count() / (rows + 1);
  operands->n_codes = n_codes;
  const uint8_t* slot_table = slots.typed_data();
  const uint32_t* word_table = words.typed_data();
  operands->dictionary = {masks.typed_data(),
                          slot_table,
                          (slot_table[kSlotMetaByte] & kSlotsTableOverflows) != 0,
                          word_table,
                          (word_table[0] & kWordsTableOverflows) != 0,
                          (word_table[0] & kWordsTableHasFourth) != 0};
  operands->rows = rows;
  operands->cols = cols;
  operands->padded_cols = PaddedCols(cols);
  operands->batch_size = static_cast<int64_t>(codes_index.size());
  operands->matrix_of_batch.resize(operands->batch_size);
  for (int64_t b = 0; b < operands->batch_size; ++b) {
    operands->matrix_of_batch[b] = {codes.typed_data() + codes_index[b] * n_codes,
                                    row_offsets.typed_data() + offsets_index[b] * (rows + 1),
                                    minmax.typed_data() + minmax_index[b] * rows * 2, b};
  }
  return ffi::Error::Success();
}

ffi::Error CheckRowOffsets(const char* op, const CompressedOperands& operands,
                           const std::vector<int64_t>* used_tokens) {
  const int64_t per_matrix = operands.rows + 1;
  std::vector<bool> read(operands.offsets_matrices, used_tokens == nullptr);
  if (used_tokens != nullptr) {
    for (int64_t b = 0; b < operands.batch_size; ++b) {
      if ((*used_tokens)[b] == 0) continue;
      read[(operands.matrix_of_batch[b].row_offsets - operands.row_offsets) / per_matrix] = true;
    }
  }
  for (int64_t index = 0; index < operands.offsets_matrices; ++index) {
    if (!read[index]) continue;
    if (auto error = CheckOffsetsOfMatrix(op, operands.row_offsets + index * per_matrix,
                                          operands.rows, operands.n_codes,
                                          OfBatch(operands.batch, index));
        error.failure()) {
      return error;
    }
  }
  return ffi::Error::Success();
}

ffi::Error CheckCounts(const char* op, ffi::Buffer<ffi::S32> counts,
                       const std::vector<int64_t>& batch, int64_t tokens,
                       std::vector<int64_t>* used_tokens) {
  if (auto error = CheckBroadcastShape(op, "counts", counts.dimensions(),
                                       "[B...] (tokens in use per batch entry)", batch, {});
      error.failure()) {
    return error;
  }
  const std::vector<int64_t> counts_index = BatchIndex(counts.dimensions(), batch);
  used_tokens->resize(counts_index.size());
  for (size_t b = 0; b < counts_index.size(); ++b) {
    (*used_tokens)[b] = std::clamp<int64_t>(counts.typed_data()[counts_index[b]], 0, tokens);
  }
  return ffi::Error::Success();
}

ffi::Error CheckDense(const char* op, const char* name, Dims dims,
                      const std::vector<int64_t>& batch, int64_t tokens, int64_t width,
                      std::vector<int64_t>* in_batch_index) {
  if (auto error = CheckBroadcastShape(
          op, name, dims, "[B..., " + std::to_string(tokens) + ", " + std::to_string(width) + "]",
          batch, {tokens, width});
      error.failure()) {
    return error;
  }
  *in_batch_index = BatchIndex(dims, batch);
  return ffi::Error::Success();
}

std::vector<TokenGroup> GroupTokens(const CompressedOperands& operands,
                                    const std::vector<int64_t>& in_batch_index, int64_t tokens,
                                    const std::vector<int64_t>& used_tokens) {
  std::vector<TokenGroup> groups;
  std::map<std::tuple<const void*, const void*, const void*>, size_t> group_of_matrix;
  for (int64_t b = 0; b < operands.batch_size; ++b) {
    if (used_tokens[b] == 0) continue;
    const WeightMatrix& matrix = operands.matrix_of_batch[b];
    const auto key = std::make_tuple(static_cast<const void*>(matrix.codes),
                                     static_cast<const void*>(matrix.row_offsets),
                                     static_cast<const void*>(matrix.minmax));
    auto [it, inserted] = group_of_matrix.emplace(key, groups.size());
    if (inserted) groups.push_back({matrix, {}, {}});
    TokenGroup& group = groups[it->second];
    for (int64_t n = 0; n < used_tokens[b]; ++n) {
      group.in_rows.push_back(in_batch_index[b] * tokens + n);
      group.out_rows.push_back(b * tokens + n);
    }
  }
  return groups;
}

ffi::Error BadRowError(const char* op, const CompressedOperands& operands,
                       const WeightMatrix& matrix, int64_t row) {
  int64_t weights = 0;
  for (int32_t k = matrix.row_offsets[row]; k < matrix.row_offsets[row + 1]; ++k) {
    weights += EntryLength(operands.dictionary, matrix.codes[k]);
  }
  std::string expected = std::to_string(operands.padded_cols) +
                         " (cols = " + std::to_string(operands.cols) +
                         (operands.cols % 2 ? ", padded to even)" : ")");
  return ffi::Error::InvalidArgument(
      Prefix(op) + "row " + std::to_string(row) + OfBatch(operands.batch, matrix.batch_index) +
      " decodes to " + std::to_string(weights) + " weights, expected " + expected +
      "; the codes are corrupt or were encoded for another shape or dictionary");
}

}  // namespace qmoe::cpu
