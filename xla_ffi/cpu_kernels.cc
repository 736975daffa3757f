// CPU handlers of the qmoe_jax FFI targets (contract in cpu_kernels.h):
// validation, then units of work (cpu_units.h) spread over XLA's thread pool.
// Units cover the tokens in use only (matrices without any get none); when
// there are fewer units than threads, each unit's rows are split too.
#include "cpu_kernels.h"

#include <algorithm>
#include <string>

#include "cpu_operands.h"
#include "cpu_parallel.h"
#include "cpu_row_kernels.h"
#include "cpu_units.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace qmoe::cpu {
namespace {

constexpr const char* kMatmul = "qmoe_matmul";
constexpr const char* kMatmulTransposed = "qmoe_matmul_t";
constexpr const char* kDequantize = "qmoe_dequantize";

ffi::Error FailureError(const char* op, const CompressedOperands& w,
                        const std::vector<TokenGroup>& groups, const FirstFailure& failure) {
  const int64_t index = failure.index();
  return BadRowError(op, w, groups[index / w.rows].matrix, index % w.rows);
}

ffi::Error MatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::U32> masks, ffi::Buffer<ffi::U8> slots,
                      ffi::Buffer<ffi::U32> words, ffi::Buffer<ffi::U16> codes,
                      ffi::Buffer<ffi::S32> row_offsets, ffi::Buffer<ffi::BF16> minmax,
                      ffi::AnyBuffer x, ffi::Buffer<ffi::S32> counts,
                      ffi::Result<ffi::AnyBuffer> y) {
  const Dims y_dims = y->dimensions();
  const Dims x_dims = x.dimensions();
  if (auto error = CheckDenseArgs(kMatmul, {"x", x.element_type(), x_dims, "cols"},
                                  {"y", y->element_type(), y_dims, "rows"});
      error.failure()) {
    return error;
  }
  const Dims batch(y_dims.begin(), y_dims.size() - 2);
  const int64_t tokens = y_dims[y_dims.size() - 2];
  CompressedOperands w;
  if (auto error = CheckCompressed(kMatmul, masks, slots, words, codes, row_offsets, minmax, batch,
                                   x_dims.back(), &w);
      error.failure()) {
    return error;
  }
  if (y_dims.back() != w.rows) {
    return ffi::Error::InvalidArgument(std::string(kMatmul) + ": y must have " +
                                       std::to_string(w.rows) + " columns (rows of minmax); got " +
                                       ShapeString(y_dims));
  }
  std::vector<int64_t> x_batch_index;
  if (auto error = CheckDense(kMatmul, "x", x_dims, w.batch, tokens, w.cols, &x_batch_index);
      error.failure()) {
    return error;
  }
  std::vector<int64_t> used_tokens;
  if (auto error = CheckCounts(kMatmul, counts, w.batch, tokens, &used_tokens); error.failure()) {
    return error;
  }
  if (auto error = CheckRowOffsets(kMatmul, w, &used_tokens); error.failure()) return error;
  const RowKernels* kernels;
  if (auto error = SelectKernels(kMatmul, &kernels); error.failure()) return error;
  if (tokens == 0 || w.rows == 0 || w.batch_size == 0) return ffi::Error::Success();

  const bool bf16 = x.element_type() == ffi::DataType::BF16;
  const DenseRows x_rows{x.untyped_data(), bf16, w.cols};
  const DenseRows y_rows{y->untyped_data(), bf16, w.rows};
  ZeroUnusedTokens(y_rows, tokens, used_tokens);
  const std::vector<TokenGroup> groups = GroupTokens(w, x_batch_index, tokens, used_tokens);
  FirstFailure failure;
  RunMatmul(pool, w, *kernels, groups, x_rows, y_rows, failure);
  if (failure.failed()) return FailureError(kMatmul, w, groups, failure);
  return ffi::Error::Success();
}

ffi::Error MatmulTransposedImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::U32> masks,
                                ffi::Buffer<ffi::U8> slots, ffi::Buffer<ffi::U32> words,
                                ffi::Buffer<ffi::U16> codes, ffi::Buffer<ffi::S32> row_offsets,
                                ffi::Buffer<ffi::BF16> minmax, ffi::AnyBuffer g,
                                ffi::Buffer<ffi::S32> counts, ffi::Result<ffi::AnyBuffer> dx) {
  const char* op = kMatmulTransposed;
  const Dims dx_dims = dx->dimensions();
  const Dims g_dims = g.dimensions();
  if (auto error = CheckDenseArgs(op, {"g", g.element_type(), g_dims, "rows"},
                                  {"dx", dx->element_type(), dx_dims, "cols"});
      error.failure()) {
    return error;
  }
  const Dims batch(dx_dims.begin(), dx_dims.size() - 2);
  const int64_t tokens = dx_dims[dx_dims.size() - 2];
  CompressedOperands w;
  if (auto error = CheckCompressed(op, masks, slots, words, codes, row_offsets, minmax, batch,
                                   dx_dims.back(), &w);
      error.failure()) {
    return error;
  }
  std::vector<int64_t> g_batch_index;
  if (auto error = CheckDense(op, "g", g_dims, w.batch, tokens, w.rows, &g_batch_index);
      error.failure()) {
    return error;
  }
  std::vector<int64_t> used_tokens;
  if (auto error = CheckCounts(op, counts, w.batch, tokens, &used_tokens); error.failure()) {
    return error;
  }
  if (auto error = CheckRowOffsets(op, w, &used_tokens); error.failure()) return error;
  const RowKernels* kernels;
  if (auto error = SelectKernels(op, &kernels); error.failure()) return error;
  if (tokens == 0 || w.cols == 0 || w.batch_size == 0) return ffi::Error::Success();

  const bool bf16 = g.element_type() == ffi::DataType::BF16;
  const DenseRows g_rows{g.untyped_data(), bf16, w.rows};
  const DenseRows dx_rows{dx->untyped_data(), bf16, w.cols};
  ZeroUnusedTokens(dx_rows, tokens, used_tokens);
  const std::vector<TokenGroup> groups = GroupTokens(w, g_batch_index, tokens, used_tokens);
  FirstFailure failure;
  RunTransposed(pool, w, *kernels, groups, g_rows, dx_rows, failure);
  if (failure.failed()) return FailureError(op, w, groups, failure);
  return ffi::Error::Success();
}

ffi::Error DequantizeImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::U32> masks,
                          ffi::Buffer<ffi::U8> slots, ffi::Buffer<ffi::U32> words,
                          ffi::Buffer<ffi::U16> codes, ffi::Buffer<ffi::S32> row_offsets,
                          ffi::Buffer<ffi::BF16> minmax, int64_t cols,
                          ffi::Result<ffi::Buffer<ffi::BF16>> weights) {
  const Dims dims = weights->dimensions();
  if (auto error = CheckDequantizeResult(kDequantize, dims, cols); error.failure()) return error;
  CompressedOperands w;
  if (auto error = CheckCompressed(kDequantize, masks, slots, words, codes, row_offsets, minmax,
                                   Dims(dims.begin(), dims.size() - 2), cols, &w);
      error.failure()) {
    return error;
  }
  if (auto error = CheckRowOffsets(kDequantize, w, /*used_tokens=*/nullptr); error.failure()) {
    return error;
  }
  if (dims[dims.size() - 2] != w.rows) {
    return ffi::Error::InvalidArgument(std::string(kDequantize) + ": the result must have " +
                                       std::to_string(w.rows) + " rows (rows of minmax); got " +
                                       ShapeString(dims));
  }
  const RowKernels* kernels;
  if (auto error = SelectKernels(kDequantize, &kernels); error.failure()) return error;
  if (w.rows == 0 || w.batch_size == 0) return ffi::Error::Success();

  const int64_t splits = RowSplits(w.rows, w.batch_size, Workers(pool));
  FirstFailure failure;
  ParallelFor(pool, w.batch_size * splits, [&](int64_t task) {
    const int64_t b = task / splits;
    const WeightMatrix& matrix = w.matrix_of_batch[b];
    RowDecoder decoder(w, *kernels);
    const RowRange rows = Split(w.rows, splits, task % splits);
    for (int64_t r = rows.begin; r < rows.end; ++r) {
      if (!decoder.Decode(matrix, r)) {
        failure.Record(b * w.rows + r);
        return;
      }
      uint16_t* out = weights->typed_data() + (b * w.rows + r) * cols;
      std::fill(out, out + cols, uint16_t{0});
      for (int64_t i = 0; i < decoder.plus_count; ++i) {
        const int32_t j = decoder.plus_index[i];
        if (j < cols) out[j] = matrix.minmax[2 * r + 1];
      }
      for (int64_t i = 0; i < decoder.minus_count; ++i) {
        const int32_t j = decoder.minus_index[i];
        if (j < cols) out[j] = matrix.minmax[2 * r];
      }
    }
  });
  if (failure.failed()) {
    const int64_t index = failure.index();
    return BadRowError(kDequantize, w, w.matrix_of_batch[index / w.rows], index % w.rows);
  }
  return ffi::Error::Success();
}

}  // namespace

}  // namespace qmoe::cpu

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    QmoeMatmulCpu, qmoe::cpu::MatmulImpl,
    xla::ffi::Ffi::Bind()
        .Ctx<xla::ffi::ThreadPool>()              // XLA's intra-op pool
        .Arg<xla::ffi::Buffer<xla::ffi::U32>>()   // masks u32[65536, 2]
        .Arg<xla::ffi::Buffer<xla::ffi::U8>>()    // slots u8[65536, 16]
        .Arg<xla::ffi::Buffer<xla::ffi::U32>>()   // words u32[65536]
        .Arg<xla::ffi::Buffer<xla::ffi::U16>>()   // codes u16[B..., n_codes]
        .Arg<xla::ffi::Buffer<xla::ffi::S32>>()   // row_offsets i32[B..., rows + 1]
        .Arg<xla::ffi::Buffer<xla::ffi::BF16>>()  // minmax bf16[B..., rows, 2]
        .Arg<xla::ffi::AnyBuffer>()               // x f32|bf16[B..., N, cols]
        .Arg<xla::ffi::Buffer<xla::ffi::S32>>()   // counts i32[B...], tokens in use
        .Ret<xla::ffi::AnyBuffer>());             // y [B..., N, rows]

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    QmoeMatmulTransposedCpu, qmoe::cpu::MatmulTransposedImpl,
    xla::ffi::Ffi::Bind()
        .Ctx<xla::ffi::ThreadPool>()              // XLA's intra-op pool
        .Arg<xla::ffi::Buffer<xla::ffi::U32>>()   // masks u32[65536, 2]
        .Arg<xla::ffi::Buffer<xla::ffi::U8>>()    // slots u8[65536, 16]
        .Arg<xla::ffi::Buffer<xla::ffi::U32>>()   // words u32[65536]
        .Arg<xla::ffi::Buffer<xla::ffi::U16>>()   // codes u16[B..., n_codes]
        .Arg<xla::ffi::Buffer<xla::ffi::S32>>()   // row_offsets i32[B..., rows + 1]
        .Arg<xla::ffi::Buffer<xla::ffi::BF16>>()  // minmax bf16[B..., rows, 2]
        .Arg<xla::ffi::AnyBuffer>()               // g f32|bf16[B..., N, rows]
        .Arg<xla::ffi::Buffer<xla::ffi::S32>>()   // counts i32[B...], tokens in use
        .Ret<xla::ffi::AnyBuffer>());             // dx [B..., N, cols]

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    QmoeDequantizeCpu, qmoe::cpu::DequantizeImpl,
    xla::ffi::Ffi::Bind()
        .Ctx<xla::ffi::ThreadPool>()                // XLA's intra-op pool
        .Arg<xla::ffi::Buffer<xla::ffi::U32>>()     // masks u32[65536, 2]
        .Arg<xla::ffi::Buffer<xla::ffi::U8>>()      // slots u8[65536, 16]
        .Arg<xla::ffi::Buffer<xla::ffi::U32>>()     // words u32[65536]
        .Arg<xla::ffi::Buffer<xla::ffi::U16>>()     // codes u16[B..., n_codes]
        .Arg<xla::ffi::Buffer<xla::ffi::S32>>()     // row_offsets i32[B..., rows + 1]
        .Arg<xla::ffi::Buffer<xla::ffi::BF16>>()    // minmax bf16[B..., rows, 2]
        .Attr<int64_t>("cols")                      // columns of W
        .Ret<xla::ffi::Buffer<xla::ffi::BF16>>());  // w bf16[B..., rows, cols]

namespace qmoe::cpu {

void RegisterCpuKernels(pybind11::module_& module) {
  namespace py = pybind11;
  module.def(
      "cpu_isas",
      [] {
        py::list isas;
        for (const char* isa : CpuIsas()) isas.append(isa);
        return isas;
      },
      "Instruction sets the CPU kernels can run here, fastest first.");
}

}  // namespace qmoe::cpu
