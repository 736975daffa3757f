#include "cuda_operands.h"

#include <limits>
#include <string>

#include "cpu_operands.h"
#include "qmoe_format.h"

namespace ffi = xla::ffi;

namespace qmoe::cuda {
namespace {

using Dims = ffi::Span<const int64_t>;
using cpu::CheckDictionaryForm;
using cpu::ShapeString;

std::string Prefix(const char* op) { return std::string(op) + ": "; }

std::string VectorString(const std::vector<int64_t>& dims) {
  return ShapeString(Dims(dims.data(), dims.size()));
}

// cpu::CheckBroadcastShape, then the operand's element stride along each batch
// dim (0 where it broadcasts).
ffi::Error CheckLeading(const char* op, const char* name, Dims dims, const std::string& expected,
                        const std::vector<int64_t>& batch, const std::vector<int64_t>& trailing,
                        std::vector<int64_t>* strides) {
  if (auto error = cpu::CheckBroadcastShape(op, name, dims, expected, batch, trailing);
      error.failure()) {
    return error;
  }
  const size_t rank = batch.size() + trailing.size();
  int64_t stride = 1;
  for (size_t i = batch.size(); i < rank; ++i) stride *= dims[i];
  strides->assign(batch.size(), 0);
  for (size_t i = batch.size(); i-- > 0;) {
    (*strides)[i] = dims[i] == 1 ? 0 : stride;
    stride *= dims[i];
  }
  return ffi::Error::Success();
}

}  // namespace

ffi::Error CheckOperands(const char* op, ffi::Buffer<ffi::U32> masks, ffi::Buffer<ffi::U8> slots,
                         ffi::Buffer<ffi::U16> codes, ffi::Buffer<ffi::S32> row_offsets,
                         ffi::Buffer<ffi::BF16> minmax, Dims batch, int64_t tokens, int64_t cols,
                         const DenseOperand* dense, Layout* layout) {
  if (auto error = CheckDictionaryForm(op, "masks", masks.dimensions(), 2, "Dictionary.masks");
      error.failure()) {
    return error;
  }
  if (auto error = CheckDictionaryForm(op, "slots", slots.dimensions(), kSlotBytes,
                                       "the sparse dictionary form of qmoe_jax.ops");
      error.failure()) {
    return error;
  }
  const std::vector<int64_t> leading(batch.begin(), batch.end());
  const Dims minmax_dims = minmax.dimensions();
  if (minmax_dims.size() != leading.size() + 2) {
    return ffi::Error::InvalidArgument(Prefix(op) +
                                       "minmax must have shape [B..., rows, 2] with B... = " +
                                       VectorString(leading) + "; got " + ShapeString(minmax_dims));
  }
  const int64_t rows = minmax_dims[leading.size()];
  std::vector<int64_t> codes_strides, offsets_strides, minmax_strides, dense_strides;
  if (auto error = CheckLeading(op, "minmax", minmax_dims, "[B..., rows, 2]", leading, {rows, 2},
                                &minmax_strides);
      error.failure()) {
    return error;
  }
  if (auto error = CheckLeading(op, "codes", codes.dimensions(), "[B..., n_codes]", leading, {-1},
                                &codes_strides);
      error.failure()) {
    return error;
  }
  if (auto error = CheckLeading(op, "row_offsets", row_offsets.dimensions(),
                                "[B..., rows + 1] with rows = " + std::to_string(rows), leading,
                                {rows + 1}, &offsets_strides);
      error.failure()) {
    return error;
  }
  if (cols < 0) {
    return ffi::Error::InvalidArgument(Prefix(op) + "cols must be >= 0, got " +
                                       std::to_string(cols));
  }
  if (cols > kMaxCols || rows >= std::numeric_limits<int32_t>::max()) {
    return ffi::Error::InvalidArgument(
        Prefix(op) + "W[" + std::to_string(rows) + ", " + std::to_string(cols) +
        "] is too large for the CUDA kernels (at most 2^30 columns and 2^31 - 2 rows)");
  }
  dense_strides.assign(leading.size(), 0);
  if (dense != nullptr) {
    const int64_t width = dense->width_is_rows ? rows : cols;
    if (auto error = CheckLeading(op, dense->name, dense->dims,
                                  "[B..., " + std::to_string(tokens) + ", " +
                                      std::to_string(width) + "]",
                                  leading, {tokens, width}, &dense_strides);
        error.failure()) {
      return error;
    }
  }

  // Fold trailing leading dims over which the matrix is broadcast into the tokens.
  size_t rank = leading.size();
  int64_t fold = 1;
  while (dense != nullptr && rank > 0 && codes_strides[rank - 1] == 0 &&
         offsets_strides[rank - 1] == 0 && minmax_strides[rank - 1] == 0 &&
         dense->dims[rank - 1] == leading[rank - 1]) {
    fold *= leading[rank - 1];
    --rank;
  }
  int64_t batch_size = 1;
  for (int64_t dim : leading) batch_size *= dim;
  if (batch_size > kMaxBatchSize) {
    return ffi::Error::InvalidArgument(Prefix(op) + "the CUDA kernels take at most 2^31 - 1 " +
                                       "batch entries; got B... = " + VectorString(leading));
  }
  if (rank > static_cast<size_t>(kMaxBatchRank)) {
    return ffi::Error::InvalidArgument(
        Prefix(op) + "the CUDA kernels take at most " + std::to_string(kMaxBatchRank) +
        " leading dims B... over which the compressed matrices vary; got B... = " +
        VectorString(leading) + " (reshape them into fewer dims)");
  }
  layout->rows = rows;
  layout->cols = cols;
  layout->n_codes = codes.dimensions().back();
  layout->offsets_matrices = row_offsets.element_count() / (rows + 1);
  layout->result_batch = leading;
  layout->fold = fold;
  layout->tokens = tokens * fold;
  BatchMap& map = layout->batch;
  map.rank = static_cast<int>(rank);
  map.size = 1;
  for (size_t i = 0; i < rank; ++i) {
    map.dims[i] = leading[i];
    map.size *= leading[i];
    map.codes[i] = codes_strides[i];
    map.row_offsets[i] = offsets_strides[i];
    map.minmax[i] = minmax_strides[i];
    map.dense[i] = dense_strides[i];
  }
  return ffi::Error::Success();
}

}  // namespace qmoe::cuda
