// CPU handlers of "qmoe_matmul_routed" and "qmoe_matmul_routed_t" (contract in cpu_routed.h):
// the tokens of a call, each with the index of its expert in a stack, grouped by expert on the
// host, so that each routed expert is decoded once for all its tokens and no [E, slots, cols]
// dispatch buffer exists anywhere. The units of work and their threads are those of
// "qmoe_matmul" (cpu_units.h).
#include "cpu_routed.h"

#include <cstring>
#include <string>
#include <vector>

#include "cpu_operands.h"
#include "cpu_parallel.h"
#include "cpu_row_kernels.h"
#include "cpu_units.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace qmoe::cpu {
namespace {

constexpr const char* kMatmulRouted = "qmoe_matmul_routed";
constexpr const char* kMatmulRoutedTransposed = "qmoe_matmul_routed_t";

ffi::Error Invalid(const char* op, const std::string& message) {
  return ffi::Error::InvalidArgument(std::string(op) + ": " + message);
}

// The operands of a routed call, checked: the stack's matrices, the tokens grouped by expert
// (in token order inside each group), and which tokens no expert takes.
struct Routed {
  CompressedOperands w;
  std::vector<TokenGroup> groups;
  std::vector<int64_t> dropped;
};

// Checks the stack (leading dims [E] on minmax), `in` [N, in_width], `out` [N, out_width] and
// expert_index i32[N], then groups the tokens. `in_is_rows`: `in` has the stack's rows as its
// width (matmul_routed_t's g) instead of its columns.
ffi::Error CheckRouted(const char* op, ffi::Buffer<ffi::U32> masks, ffi::Buffer<ffi::U8> slots,
                       ffi::Buffer<ffi::U32> words, ffi::Buffer<ffi::U16> codes,
                       ffi::Buffer<ffi::S32> row_offsets, ffi::Buffer<ffi::BF16> minmax,
                       const DenseArg& in, const DenseArg& out, bool in_is_rows,
                       ffi::Buffer<ffi::S32> expert_index, Routed* routed) {
  if (auto error = CheckDenseArgs(op, in, out); error.failure()) return error;
  const Dims minmax_dims = minmax.dimensions();
  if (minmax_dims.size() != 3) {
    return Invalid(op,
                   "minmax must be [E, rows, 2], an expert stack; got " + ShapeString(minmax_dims));
  }
  if (in.dims.size() != 2 || out.dims.size() != 2 || in.dims[0] != out.dims[0]) {
    return Invalid(op, std::string(in.name) + " and " + out.name +
                           " must be [N, width] with the same N; got " + ShapeString(in.dims) +
                           " and " + ShapeString(out.dims));
  }
  const int64_t tokens = in.dims[0];
  const int64_t rows = minmax_dims[1];
  const int64_t cols = in_is_rows ? out.dims[1] : in.dims[1];
  if ((in_is_rows ? in.dims[1] : out.dims[1]) != rows) {
    return Invalid(op, std::string(in_is_rows ? in.name : out.name) + " must have " +
                           std::to_string(rows) + " columns (rows of minmax); got " +
                           ShapeString(in_is_rows ? in.dims : out.dims));
  }
  const Dims index_dims = expert_index.dimensions();
  if (index_dims.size() != 1 || index_dims[0] != tokens) {
    return Invalid(op, "expert_index must be i32[" + std::to_string(tokens) +
                           "], one expert per token; got " + ShapeString(index_dims));
  }
  if (auto error = CheckCompressed(op, masks, slots, words, codes, row_offsets, minmax,
                                   Dims(minmax_dims.begin(), 1), cols, &routed->w);
      error.failure()) {
    return error;
  }
  const int64_t experts = routed->w.batch_size;
  std::vector<int64_t> used_tokens(experts, 0);
  std::vector<int64_t> group_of_expert(experts, -1);
  const int32_t* index = expert_index.typed_data();
  for (int64_t n = 0; n < tokens; ++n) {
    if (index[n] < 0 || index[n] >= experts) {
      routed->dropped.push_back(n);
      continue;
    }
    const int64_t e = index[n];
    if (group_of_expert[e] < 0) {
      group_of_expert[e] = static_cast<int64_t>(routed->groups.size());
      routed->groups.push_back({routed->w.matrix_of_batch[e], {}, {}});
    }
    TokenGroup& group = routed->groups[group_of_expert[e]];
    group.in_rows.push_back(n);
    group.out_rows.push_back(n);
    ++used_tokens[e];
  }
  return CheckRowOffsets(op, routed->w, &used_tokens);
}

void ZeroRows(const DenseRows& out, const std::vector<int64_t>& rows) {
  const int64_t row_bytes = out.width * (out.bf16 ? sizeof(uint16_t) : sizeof(float));
  for (const int64_t row : rows) {
    std::memset(static_cast<char*>(out.data) + row * row_bytes, 0, row_bytes);
  }
}

ffi::Error FailureError(const char* op, const Routed& routed, const FirstFailure& failure) {
  const int64_t index = failure.index();
  return BadRowError(op, routed.w, routed.groups[index / routed.w.rows].matrix,
                     index % routed.w.rows);
}

// One routed call: x [N, cols] to y [N, rows] through each token's expert, or (transposed)
// g [N, rows] to dx [N, cols], the input gradient.
ffi::Error RoutedImpl(const char* op, bool transposed, ffi::ThreadPool& pool,
                      ffi::Buffer<ffi::U32> masks, ffi::Buffer<ffi::U8> slots,
                      ffi::Buffer<ffi::U32> words, ffi::Buffer<ffi::U16> codes,
                      ffi::Buffer<ffi::S32> row_offsets, ffi::Buffer<ffi::BF16> minmax,
                      ffi::AnyBuffer in, ffi::Buffer<ffi::S32> expert_index,
                      ffi::Result<ffi::AnyBuffer> out) {
  const DenseArg in_arg{transposed ? "g" : "x", in.element_type(), in.dimensions(),
                        transposed ? "rows" : "cols"};
  const DenseArg out_arg{transposed ? "dx" : "y", out->element_type(), out->dimensions(),
                         transposed ? "cols" : "rows"};
  Routed routed;
  if (auto error = CheckRouted(op, masks, slots, words, codes, row_offsets, minmax, in_arg, out_arg,
                               /*in_is_rows=*/transposed, expert_index, &routed);
      error.failure()) {
    return error;
  }
  const RowKernels* kernels;
  if (auto error = SelectKernels(op, &kernels); error.failure()) return error;
  const CompressedOperands& w = routed.w;
  const bool bf16 = in.element_type() == ffi::DataType::BF16;
  const DenseRows in_rows{in.untyped_data(), bf16, transposed ? w.rows : w.cols};
  const DenseRows out_rows{out->untyped_data(), bf16, transposed ? w.cols : w.rows};
  ZeroRows(out_rows, routed.dropped);
  if (out_rows.width == 0) return ffi::Error::Success();
  FirstFailure failure;
  if (transposed) {
    RunTransposed(pool, w, *kernels, routed.groups, in_rows, out_rows, failure);
  } else {
    RunMatmul(pool, w, *kernels, routed.groups, in_rows, out_rows, failure);
  }
  if (failure.failed()) return FailureError(op, routed, failure);
  return ffi::Error::Success();
}

ffi::Error MatmulRoutedImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::U32> masks,
                            ffi::Buffer<ffi::U8> slots, ffi::Buffer<ffi::U32> words,
                            ffi::Buffer<ffi::U16> codes, ffi::Buffer<ffi::S32> row_offsets,
                            ffi::Buffer<ffi::BF16> minmax, ffi::AnyBuffer x,
                            ffi::Buffer<ffi::S32> expert_index, ffi::Result<ffi::AnyBuffer> y) {
  return RoutedImpl(kMatmulRouted, /*transposed=*/false, pool, masks, slots, words, codes,
                    row_offsets, minmax, x, expert_index, y);
}

ffi::Error MatmulRoutedTransposedImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::U32> masks,
                                      ffi::Buffer<ffi::U8> slots, ffi::Buffer<ffi::U32> words,
                                      ffi::Buffer<ffi::U16> codes,
                                      ffi::Buffer<ffi::S32> row_offsets,
                                      ffi::Buffer<ffi::BF16> minmax, ffi::AnyBuffer g,
                                      ffi::Buffer<ffi::S32> expert_index,
                                      ffi::Result<ffi::AnyBuffer> dx) {
  return RoutedImpl(kMatmulRoutedTransposed, /*transposed=*/true, pool, masks, slots, words, codes,
                    row_offsets, minmax, g, expert_index, dx);
}

}  // namespace
}  // namespace qmoe::cpu

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    QmoeMatmulRoutedCpu, qmoe::cpu::MatmulRoutedImpl,
    xla::ffi::Ffi::Bind()
        .Ctx<xla::ffi::ThreadPool>()              // XLA's intra-op pool
        .Arg<xla::ffi::Buffer<xla::ffi::U32>>()   // masks u32[65536, 2]
        .Arg<xla::ffi::Buffer<xla::ffi::U8>>()    // slots u8[65536, 16]
        .Arg<xla::ffi::Buffer<xla::ffi::U32>>()   // words u32[65536]
        .Arg<xla::ffi::Buffer<xla::ffi::U16>>()   // codes u16[E, n_codes]
        .Arg<xla::ffi::Buffer<xla::ffi::S32>>()   // row_offsets i32[E, rows + 1]
        .Arg<xla::ffi::Buffer<xla::ffi::BF16>>()  // minmax bf16[E, rows, 2]
        .Arg<xla::ffi::AnyBuffer>()               // x f32|bf16[N, cols]
        .Arg<xla::ffi::Buffer<xla::ffi::S32>>()   // expert_index i32[N]
        .Ret<xla::ffi::AnyBuffer>());             // y [N, rows]

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    QmoeMatmulRoutedTransposedCpu, qmoe::cpu::MatmulRoutedTransposedImpl,
    xla::ffi::Ffi::Bind()
        .Ctx<xla::ffi::ThreadPool>()              // XLA's intra-op pool
        .Arg<xla::ffi::Buffer<xla::ffi::U32>>()   // masks u32[65536, 2]
        .Arg<xla::ffi::Buffer<xla::ffi::U8>>()    // slots u8[65536, 16]
        .Arg<xla::ffi::Buffer<xla::ffi::U32>>()   // words u32[65536]
        .Arg<xla::ffi::Buffer<xla::ffi::U16>>()   // codes u16[E, n_codes]
        .Arg<xla::ffi::Buffer<xla::ffi::S32>>()   // row_offsets i32[E, rows + 1]
        .Arg<xla::ffi::Buffer<xla::ffi::BF16>>()  // minmax bf16[E, rows, 2]
        .Arg<xla::ffi::AnyBuffer>()               // g f32|bf16[N, rows]
        .Arg<xla::ffi::Buffer<xla::ffi::S32>>()   // expert_index i32[N]
        .Ret<xla::ffi::AnyBuffer>());             // dx [N, cols]
