#include "cuda_operands.h"

#include <limits>
#include <string>

#include "cpu_operands.h"

namespace ffi = xla::ffi;

namespace qmoe::cuda {
namespace {

using Dims = ffi::Span<const int64_t>;
using cpu::ShapeString;

std::string Prefix(const char* op) { return std::string(op) + ": "; }

std::string VectorString(const std::vector<int64_t>& dims) {
  return ShapeString(Dims(dims.data(), dims.size()));
}

// The element stride of an operand [B'..., trailing...] along each dim of B'
// (0 where it broadcasts); the shape was checked by cpu::CheckBroadcastShape.
std::vector<int64_t> BatchStrides(Dims dims, size_t batch_rank) {
  int64_t stride = 1;
  for (size_t i = batch_rank; i < dims.size(); ++i) stride *= dims[i];
  std::vector<int64_t> strides(batch_rank, 0);
  for (size_t i = batch_rank; i-- > 0;) {
    strides[i] = dims[i] == 1 ? 0 : stride;
    stride *= dims[i];
  }
  return strides;
}

}  // namespace

ffi::Error CheckOperands(const char* op, ffi::Buffer<ffi::U32> masks, ffi::Buffer<ffi::U8> slots,
                         ffi::Buffer<ffi::U32> words, ffi::Buffer<ffi::U16> codes,
                         ffi::Buffer<ffi::S32> row_offsets, ffi::Buffer<ffi::BF16> minmax,
                         Dims batch, int64_t tokens, int64_t cols, const DenseOperand* dense,
                         Layout* layout) {
  const std::vector<int64_t> leading(batch.begin(), batch.end());
  int64_t rows = 0;
  if (auto error = cpu::CheckCompressedShapes(op, masks, slots, words, codes, row_offsets, minmax,
                                              leading, cols, &rows);
      error.failure()) {
    return error;
  }
  if (cols > kMaxCols || rows >= std::numeric_limits<int32_t>::max()) {
    return ffi::Error::InvalidArgument(
        Prefix(op) + "W[" + std::to_string(rows) + ", " + std::to_string(cols) +
        "] is too large for the CUDA kernels (at most 2^30 columns and 2^31 - 2 rows)");
  }
  const std::vector<int64_t> codes_strides = BatchStrides(codes.dimensions(), leading.size());
  const std::vector<int64_t> offsets_strides = BatchStrides(row_offsets.dimensions(),
                                                            leading.size());
  const std::vector<int64_t> minmax_strides = BatchStrides(minmax.dimensions(), leading.size());
  std::vector<int64_t> dense_strides(leading.size(), 0);
  std::vector<int64_t> counts_strides(leading.size(), 0);
  if (dense != nullptr) {
    const int64_t width = dense->width_is_rows ? rows : cols;
    if (auto error = cpu::CheckBroadcastShape(op, dense->name, dense->dims,
                                              "[B..., " + std::to_string(tokens) + ", " +
                                                  std::to_string(width) + "]",
                                              leading, {tokens, width});
        error.failure()) {
      return error;
    }
    if (auto error = cpu::CheckBroadcastShape(op, "counts", dense->counts_dims,
                                              "[B...] (tokens in use per batch entry)", leading,
                                              {});
        error.failure()) {
      return error;
    }
    dense_strides = BatchStrides(dense->dims, leading.size());
    counts_strides = BatchStrides(dense->counts_dims, leading.size());
  }

  // Fold trailing leading dims over which the matrix and the counts are
  // broadcast into the tokens.
  size_t rank = leading.size();
  int64_t fold = 1;
  while (dense != nullptr && rank > 0 && codes_strides[rank - 1] == 0 &&
         offsets_strides[rank - 1] == 0 && minmax_strides[rank - 1] == 0 &&
         counts_strides[rank - 1] == 0 && dense->dims[rank - 1] == leading[rank - 1]) {
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
  layout->entry_tokens = tokens;
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
    map.counts[i] = counts_strides[i];
  }
  return ffi::Error::Success();
}

}  // namespace qmoe::cuda
