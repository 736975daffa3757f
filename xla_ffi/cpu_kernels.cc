// CPU handlers of the qmoe_jax FFI targets (contract in cpu_kernels.h).
//
// Work is cut into units: the tokens of one weight matrix, either one token
// at a time (decode each row straight into a dot product with x) or blocks
// of up to 16 tokens stored token-major, so that each decoded nonzero weight
// adds one 16-lane row for all tokens at once. Units spread over XLA's
// thread pool; when there are fewer units than threads, rows are split too.
#include "cpu_kernels.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string_view>

#include "cpu_operands.h"
#include "cpu_parallel.h"
#include "cpu_row_kernels.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace qmoe::cpu {
namespace {

constexpr const char* kMatmul = "qmoe_matmul";
constexpr const char* kMatmulTransposed = "qmoe_matmul_t";
constexpr const char* kDequantize = "qmoe_dequantize";

// A matrix with fewer tokens than this runs the one-token dot per token.
constexpr int64_t kBlockTokens = 2;
// Rows of one task when rows are split between threads.
constexpr int64_t kMinRowsPerTask = 16;

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

float Bf16ToFloat(uint16_t bits) {
  const uint32_t word = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &word, sizeof(value));
  return value;
}

uint16_t FloatToBf16(float value) {
  uint32_t word;
  std::memcpy(&word, &value, sizeof(word));
  if ((word & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((word >> 16) | 0x40);
  word += 0x7FFFu + ((word >> 16) & 1u);
  return static_cast<uint16_t>(word >> 16);
}

// An f32 or bf16 array viewed as rows of `width` values.
struct DenseRows {
  void* data;
  bool bf16;
  int64_t width;

  float Get(int64_t row, int64_t j) const {
    const int64_t i = row * width + j;
    return bf16 ? Bf16ToFloat(static_cast<const uint16_t*>(data)[i])
                : static_cast<const float*>(data)[i];
  }
  void Set(int64_t row, int64_t j, float value) const {
    const int64_t i = row * width + j;
    if (bf16) {
      static_cast<uint16_t*>(data)[i] = FloatToBf16(value);
    } else {
      static_cast<float*>(data)[i] = value;
    }
  }
};

ffi::Error CheckFloat(const char* op, const char* name, ffi::DataType type) {
  if (type == ffi::DataType::F32 || type == ffi::DataType::BF16) return ffi::Error::Success();
  return ffi::Error::InvalidArgument(std::string(op) + ": " + name +
                                     " must be float32 or bfloat16");
}

ffi::Error SelectKernels(const char* op, const RowKernels** kernels) {
  const char* requested = std::getenv("QMOE_CPU_ISA");
  const std::string_view isa = requested ? requested : "";
  if (isa.empty() || isa == "auto") {
    *kernels = CpuHasAvx512() ? &Avx512RowKernels()
               : CpuHasAvx2() ? &Avx2RowKernels()
                              : &PortableRowKernels();
  } else if (isa == "avx512" && CpuHasAvx512()) {
    *kernels = &Avx512RowKernels();
  } else if (isa == "avx2" && CpuHasAvx2()) {
    *kernels = &Avx2RowKernels();
  } else if (isa == "portable") {
    *kernels = &PortableRowKernels();
  } else if (isa == "avx512" || isa == "avx2") {
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                      std::string(op) + ": QMOE_CPU_ISA=" + std::string(isa) +
                          " but this CPU lacks it; unset QMOE_CPU_ISA or pick another");
  } else {
    return ffi::Error::InvalidArgument(std::string(op) +
                                       ": QMOE_CPU_ISA must be auto, avx512, avx2 or portable; "
                                       "got '" + std::string(isa) + "'");
  }
  return ffi::Error::Success();
}

// Tokens [first, first + count) of a group, computed together: one token
// in a padded f32 row, or a block of up to 16 tokens stored token-major.
struct Unit {
  int64_t group;
  int64_t first;
  int64_t count;
  bool block;
};

std::vector<Unit> Units(const std::vector<TokenGroup>& groups, bool always_blocks) {
  std::vector<Unit> units;
  for (int64_t g = 0; g < static_cast<int64_t>(groups.size()); ++g) {
    const int64_t tokens = static_cast<int64_t>(groups[g].in_rows.size());
    if (always_blocks || tokens >= kBlockTokens) {
      for (int64_t first = 0; first < tokens; first += kTokenLanes) {
        units.push_back({g, first, std::min(kTokenLanes, tokens - first), true});
      }
    } else {
      for (int64_t n = 0; n < tokens; ++n) units.push_back({g, n, 1, false});
    }
  }
  return units;
}

// Per-thread buffers, reused across tasks and calls.
struct Scratch {
  std::vector<float> tokens;
  std::vector<float> sums;
  std::vector<int32_t> plus;
  std::vector<int32_t> minus;
};

Scratch& ThreadScratch() {
  thread_local Scratch scratch;
  return scratch;
}

template <typename T>
T* Reserve(std::vector<T>& buffer, int64_t size) {
  if (static_cast<int64_t>(buffer.size()) < size) buffer.resize(size);
  return buffer.data();
}

int64_t TokenBufferSize(const CompressedOperands& w, const Unit& unit) {
  const int64_t length = w.padded_cols + kDensePad;
  return unit.block ? length * kTokenLanes : length;
}

// A unit's dense rows (`width` values each) as f32: one zero-padded row, or
// token-major [width + pad][16] for a block.
void LoadTokens(const Unit& unit, const std::vector<int64_t>& rows, const DenseRows& dense,
                int64_t buffer_size, float* buffer) {
  std::fill(buffer, buffer + buffer_size, 0.0f);
  for (int64_t t = 0; t < unit.count; ++t) {
    const int64_t row = rows[unit.first + t];
    if (unit.block) {
      for (int64_t j = 0; j < dense.width; ++j) buffer[j * kTokenLanes + t] = dense.Get(row, j);
    } else {
      for (int64_t j = 0; j < dense.width; ++j) buffer[j] = dense.Get(row, j);
    }
  }
}

struct RowRange {
  int64_t begin;
  int64_t end;
};

// Decodes rows of one group's matrix and writes y for the unit's tokens.
void MatmulRows(const CompressedOperands& w, const RowKernels& kernels,
                const std::vector<TokenGroup>& groups, const Unit& unit, const float* tokens,
                RowRange rows, const DenseRows& y, FirstFailure& failure) {
  const TokenGroup& group = groups[unit.group];
  const WeightMatrix& matrix = group.matrix;
  Scratch& scratch = ThreadScratch();
  int32_t* plus_index = Reserve(scratch.plus, w.padded_cols + kIndexSlack);
  int32_t* minus_index = Reserve(scratch.minus, w.padded_cols + kIndexSlack);
  for (int64_t r = rows.begin; r < rows.end; ++r) {
    const int32_t begin = matrix.row_offsets[r];
    const int64_t count = matrix.row_offsets[r + 1] - begin;
    const float row_min = Bf16ToFloat(matrix.minmax[2 * r]);
    const float row_max = Bf16ToFloat(matrix.minmax[2 * r + 1]);
    if (!unit.block) {
      float plus, minus;
      if (!kernels.row_dot(w.dictionary, matrix.codes + begin, count, tokens, w.padded_cols,
                           &plus, &minus)) {
        failure.Record(unit.group * w.rows + r);
        return;
      }
      y.Set(group.out_rows[unit.first], r, row_max * plus + row_min * minus);
      continue;
    }
    int64_t plus_count, minus_count;
    if (!kernels.row_nonzeros(w.dictionary, matrix.codes + begin, count, w.padded_cols,
                              plus_index, &plus_count, minus_index, &minus_count)) {
      failure.Record(unit.group * w.rows + r);
      return;
    }
    alignas(64) float plus[kTokenLanes];
    alignas(64) float minus[kTokenLanes];
    kernels.gather_token_rows(tokens, plus_index, plus_count, plus);
    kernels.gather_token_rows(tokens, minus_index, minus_count, minus);
    for (int64_t t = 0; t < unit.count; ++t) {
      y.Set(group.out_rows[unit.first + t], r, row_max * plus[t] + row_min * minus[t]);
    }
  }
}

// Adds rows of W^T g for one unit of tokens into `sums` ([padded_cols + pad][16]).
void TransposedRows(const CompressedOperands& w, const RowKernels& kernels,
                    const std::vector<TokenGroup>& groups, const Unit& unit,
                    const float* gradient, RowRange rows, float* sums, FirstFailure& failure) {
  const WeightMatrix& matrix = groups[unit.group].matrix;
  Scratch& scratch = ThreadScratch();
  int32_t* plus_index = Reserve(scratch.plus, w.padded_cols + kIndexSlack);
  int32_t* minus_index = Reserve(scratch.minus, w.padded_cols + kIndexSlack);
  for (int64_t r = rows.begin; r < rows.end; ++r) {
    const int32_t begin = matrix.row_offsets[r];
    int64_t plus_count, minus_count;
    if (!kernels.row_nonzeros(w.dictionary, matrix.codes + begin,
                              matrix.row_offsets[r + 1] - begin, w.padded_cols, plus_index,
                              &plus_count, minus_index, &minus_count)) {
      failure.Record(unit.group * w.rows + r);
      return;
    }
    const float row_min = Bf16ToFloat(matrix.minmax[2 * r]);
    const float row_max = Bf16ToFloat(matrix.minmax[2 * r + 1]);
    alignas(64) float plus[kTokenLanes];
    alignas(64) float minus[kTokenLanes];
    for (int64_t t = 0; t < kTokenLanes; ++t) {
      plus[t] = row_max * gradient[r * kTokenLanes + t];
      minus[t] = row_min * gradient[r * kTokenLanes + t];
    }
    kernels.scatter_token_rows(sums, plus_index, plus_count, plus);
    kernels.scatter_token_rows(sums, minus_index, minus_count, minus);
  }
}

// Tasks per unit when there are fewer units than threads to keep busy.
int64_t RowSplits(const CompressedOperands& w, int64_t units, int64_t workers) {
  return std::max<int64_t>(1, std::min(CeilDiv(4 * workers, std::max<int64_t>(units, 1)),
                                       CeilDiv(w.rows, kMinRowsPerTask)));
}

RowRange Split(int64_t total, int64_t splits, int64_t split) {
  const int64_t size = CeilDiv(total, splits);
  return {std::min(total, split * size), std::min(total, (split + 1) * size)};
}

ffi::Error FailureError(const char* op, const CompressedOperands& w,
                        const std::vector<TokenGroup>& groups, const FirstFailure& failure) {
  const int64_t index = failure.index();
  return BadRowError(op, w, groups[index / w.rows].matrix, index % w.rows);
}

ffi::Error MatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::U32> masks,
                      ffi::Buffer<ffi::U8> slots, ffi::Buffer<ffi::U16> codes,
                      ffi::Buffer<ffi::S32> row_offsets, ffi::Buffer<ffi::BF16> minmax,
                      ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y) {
  if (auto error = CheckFloat(kMatmul, "x", x.element_type()); error.failure()) return error;
  const Dims y_dims = y->dimensions();
  const Dims x_dims = x.dimensions();
  if (y->element_type() != x.element_type() || y_dims.size() < 2 ||
      x_dims.size() != y_dims.size()) {
    return ffi::Error::InvalidArgument(
        std::string(kMatmul) + ": x [B..., N, cols] and y [B..., N, rows] must share rank and "
        "dtype; got x " + ShapeString(x_dims) + ", y " + ShapeString(y_dims));
  }
  const Dims batch(y_dims.begin(), y_dims.size() - 2);
  const int64_t tokens = y_dims[y_dims.size() - 2];
  CompressedOperands w;
  if (auto error = CheckCompressed(kMatmul, masks, slots, codes, row_offsets, minmax, batch,
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
  const RowKernels* kernels;
  if (auto error = SelectKernels(kMatmul, &kernels); error.failure()) return error;
  if (tokens == 0 || w.rows == 0 || w.batch_size == 0) return ffi::Error::Success();

  const bool bf16 = x.element_type() == ffi::DataType::BF16;
  const DenseRows x_rows{x.untyped_data(), bf16, w.cols};
  const DenseRows y_rows{y->untyped_data(), bf16, w.rows};
  const std::vector<TokenGroup> groups = GroupTokens(w, x_batch_index, tokens);
  const std::vector<Unit> units = Units(groups, /*always_blocks=*/false);
  const int64_t unit_count = static_cast<int64_t>(units.size());
  const int64_t workers = Workers(pool);
  FirstFailure failure;
  if (unit_count >= 2 * workers) {
    ParallelFor(pool, unit_count, [&](int64_t u) {
      const int64_t size = TokenBufferSize(w, units[u]);
      float* buffer = Reserve(ThreadScratch().tokens, size);
      LoadTokens(units[u], groups[units[u].group].in_rows, x_rows, size, buffer);
      MatmulRows(w, *kernels, groups, units[u], buffer, {0, w.rows}, y_rows, failure);
    });
  } else {
    std::vector<std::vector<float>> buffers(unit_count);
    ParallelFor(pool, unit_count, [&](int64_t u) {
      buffers[u].resize(TokenBufferSize(w, units[u]));
      LoadTokens(units[u], groups[units[u].group].in_rows, x_rows, buffers[u].size(),
                 buffers[u].data());
    });
    const int64_t splits = RowSplits(w, unit_count, workers);
    ParallelFor(pool, unit_count * splits, [&](int64_t task) {
      const int64_t u = task / splits;
      MatmulRows(w, *kernels, groups, units[u], buffers[u].data(),
                 Split(w.rows, splits, task % splits), y_rows, failure);
    });
  }
  if (failure.failed()) return FailureError(kMatmul, w, groups, failure);
  return ffi::Error::Success();
}

ffi::Error MatmulTransposedImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::U32> masks,
                                ffi::Buffer<ffi::U8> slots, ffi::Buffer<ffi::U16> codes,
                                ffi::Buffer<ffi::S32> row_offsets, ffi::Buffer<ffi::BF16> minmax,
                                ffi::AnyBuffer g, ffi::Result<ffi::AnyBuffer> dx) {
  const char* op = kMatmulTransposed;
  if (auto error = CheckFloat(op, "g", g.element_type()); error.failure()) return error;
  const Dims dx_dims = dx->dimensions();
  const Dims g_dims = g.dimensions();
  if (dx->element_type() != g.element_type() || dx_dims.size() < 2 ||
      g_dims.size() != dx_dims.size()) {
    return ffi::Error::InvalidArgument(
        std::string(op) + ": g [B..., N, rows] and dx [B..., N, cols] must share rank and "
        "dtype; got g " + ShapeString(g_dims) + ", dx " + ShapeString(dx_dims));
  }
  const Dims batch(dx_dims.begin(), dx_dims.size() - 2);
  const int64_t tokens = dx_dims[dx_dims.size() - 2];
  CompressedOperands w;
  if (auto error = CheckCompressed(op, masks, slots, codes, row_offsets, minmax, batch,
                                   dx_dims.back(), &w);
      error.failure()) {
    return error;
  }
  std::vector<int64_t> g_batch_index;
  if (auto error = CheckDense(op, "g", g_dims, w.batch, tokens, w.rows, &g_batch_index);
      error.failure()) {
    return error;
  }
  const RowKernels* kernels;
  if (auto error = SelectKernels(op, &kernels); error.failure()) return error;
  if (tokens == 0 || w.cols == 0 || w.batch_size == 0) return ffi::Error::Success();

  const bool bf16 = g.element_type() == ffi::DataType::BF16;
  const DenseRows g_rows{g.untyped_data(), bf16, w.rows};
  const DenseRows dx_rows{dx->untyped_data(), bf16, w.cols};
  const std::vector<TokenGroup> groups = GroupTokens(w, g_batch_index, tokens);
  const std::vector<Unit> units = Units(groups, /*always_blocks=*/true);
  const int64_t unit_count = static_cast<int64_t>(units.size());
  const int64_t workers = Workers(pool);
  const int64_t gradient_size = std::max<int64_t>(w.rows, 1) * kTokenLanes;
  const int64_t sums_size = (w.padded_cols + kDensePad) * kTokenLanes;
  // Writes dx for a unit's tokens, columns [columns.begin, columns.end), from partial sums.
  const auto store = [&](const Unit& unit, const float* const* parts, int64_t part_count,
                         RowRange columns) {
    const TokenGroup& group = groups[unit.group];
    for (int64_t t = 0; t < unit.count; ++t) {
      for (int64_t j = columns.begin; j < columns.end; ++j) {
        float total = 0.0f;
        for (int64_t p = 0; p < part_count; ++p) total += parts[p][j * kTokenLanes + t];
        dx_rows.Set(group.out_rows[unit.first + t], j, total);
      }
    }
  };
  FirstFailure failure;
  if (unit_count >= 2 * workers) {
    ParallelFor(pool, unit_count, [&](int64_t u) {
      Scratch& scratch = ThreadScratch();
      float* gradient = Reserve(scratch.tokens, gradient_size);
      float* sums = Reserve(scratch.sums, sums_size);
      LoadTokens(units[u], groups[units[u].group].in_rows, g_rows, gradient_size, gradient);
      std::fill(sums, sums + sums_size, 0.0f);
      TransposedRows(w, *kernels, groups, units[u], gradient, {0, w.rows}, sums, failure);
      store(units[u], &sums, 1, {0, w.cols});
    });
  } else {
    const int64_t splits = RowSplits(w, unit_count, workers);
    std::vector<std::vector<float>> gradients(unit_count);
    std::vector<std::vector<float>> partial(unit_count * splits);
    ParallelFor(pool, unit_count, [&](int64_t u) {
      gradients[u].resize(gradient_size);
      LoadTokens(units[u], groups[units[u].group].in_rows, g_rows, gradient_size,
                 gradients[u].data());
    });
    ParallelFor(pool, unit_count * splits, [&](int64_t task) {
      const int64_t u = task / splits;
      partial[task].assign(sums_size, 0.0f);
      TransposedRows(w, *kernels, groups, units[u], gradients[u].data(),
                     Split(w.rows, splits, task % splits), partial[task].data(), failure);
    });
    if (failure.failed()) return FailureError(op, w, groups, failure);
    ParallelFor(pool, unit_count * splits, [&](int64_t task) {
      const int64_t u = task / splits;
      std::vector<const float*> parts(splits);
      for (int64_t p = 0; p < splits; ++p) parts[p] = partial[u * splits + p].data();
      store(units[u], parts.data(), splits, Split(w.cols, splits, task % splits));
    });
  }
  if (failure.failed()) return FailureError(op, w, groups, failure);
  return ffi::Error::Success();
}

ffi::Error DequantizeImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::U32> masks,
                          ffi::Buffer<ffi::U8> slots, ffi::Buffer<ffi::U16> codes,
                          ffi::Buffer<ffi::S32> row_offsets, ffi::Buffer<ffi::BF16> minmax,
                          int64_t cols, ffi::Result<ffi::Buffer<ffi::BF16>> weights) {
  const Dims dims = weights->dimensions();
  if (dims.size() < 2 || dims.back() != cols) {
    return ffi::Error::InvalidArgument(std::string(kDequantize) +
                                       ": the result must have shape [B..., rows, cols] with "
                                       "cols = " + std::to_string(cols) + "; got " +
                                       ShapeString(dims));
  }
  CompressedOperands w;
  if (auto error = CheckCompressed(kDequantize, masks, slots, codes, row_offsets, minmax,
                                   Dims(dims.begin(), dims.size() - 2), cols, &w);
      error.failure()) {
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

  const int64_t splits = RowSplits(w, w.batch_size, Workers(pool));
  FirstFailure failure;
  ParallelFor(pool, w.batch_size * splits, [&](int64_t task) {
    const int64_t b = task / splits;
    const WeightMatrix& matrix = w.matrix_of_batch[b];
    Scratch& scratch = ThreadScratch();
    int32_t* plus_index = Reserve(scratch.plus, w.padded_cols + kIndexSlack);
    int32_t* minus_index = Reserve(scratch.minus, w.padded_cols + kIndexSlack);
    const RowRange rows = Split(w.rows, splits, task % splits);
    for (int64_t r = rows.begin; r < rows.end; ++r) {
      const int32_t begin = matrix.row_offsets[r];
      int64_t plus_count, minus_count;
      if (!kernels->row_nonzeros(w.dictionary, matrix.codes + begin,
                                 matrix.row_offsets[r + 1] - begin, w.padded_cols, plus_index,
                                 &plus_count, minus_index, &minus_count)) {
        failure.Record(b * w.rows + r);
        return;
      }
      uint16_t* out = weights->typed_data() + (b * w.rows + r) * cols;
      std::fill(out, out + cols, uint16_t{0});
      for (int64_t i = 0; i < plus_count; ++i) {
        if (plus_index[i] < cols) out[plus_index[i]] = matrix.minmax[2 * r + 1];
      }
      for (int64_t i = 0; i < minus_count; ++i) {
        if (minus_index[i] < cols) out[minus_index[i]] = matrix.minmax[2 * r];
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

std::vector<std::string> SupportedIsas() {
  std::vector<std::string> isas;
  if (CpuHasAvx512()) isas.push_back("avx512");
  if (CpuHasAvx2()) isas.push_back("avx2");
  isas.push_back("portable");
  return isas;
}

}  // namespace qmoe::cpu

XLA_FFI_DEFINE_HANDLER_SYMBOL(QmoeMatmulCpu, qmoe::cpu::MatmulImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()              // XLA's intra-op pool
                                  .Arg<xla::ffi::Buffer<xla::ffi::U32>>()   // masks u32[65536, 2]
                                  .Arg<xla::ffi::Buffer<xla::ffi::U8>>()    // slots u8[65536, 16]
                                  .Arg<xla::ffi::Buffer<xla::ffi::U16>>()   // codes u16[B..., n_codes]
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()   // row_offsets i32[B..., rows + 1]
                                  .Arg<xla::ffi::Buffer<xla::ffi::BF16>>()  // minmax bf16[B..., rows, 2]
                                  .Arg<xla::ffi::AnyBuffer>()               // x f32|bf16[B..., N, cols]
                                  .Ret<xla::ffi::AnyBuffer>());             // y [B..., N, rows]

XLA_FFI_DEFINE_HANDLER_SYMBOL(QmoeMatmulTransposedCpu, qmoe::cpu::MatmulTransposedImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()              // XLA's intra-op pool
                                  .Arg<xla::ffi::Buffer<xla::ffi::U32>>()   // masks u32[65536, 2]
                                  .Arg<xla::ffi::Buffer<xla::ffi::U8>>()    // slots u8[65536, 16]
                                  .Arg<xla::ffi::Buffer<xla::ffi::U16>>()   // codes u16[B..., n_codes]
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()   // row_offsets i32[B..., rows + 1]
                                  .Arg<xla::ffi::Buffer<xla::ffi::BF16>>()  // minmax bf16[B..., rows, 2]
                                  .Arg<xla::ffi::AnyBuffer>()               // g f32|bf16[B..., N, rows]
                                  .Ret<xla::ffi::AnyBuffer>());             // dx [B..., N, cols]

XLA_FFI_DEFINE_HANDLER_SYMBOL(QmoeDequantizeCpu, qmoe::cpu::DequantizeImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()              // XLA's intra-op pool
                                  .Arg<xla::ffi::Buffer<xla::ffi::U32>>()   // masks u32[65536, 2]
                                  .Arg<xla::ffi::Buffer<xla::ffi::U8>>()    // slots u8[65536, 16]
                                  .Arg<xla::ffi::Buffer<xla::ffi::U16>>()   // codes u16[B..., n_codes]
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()   // row_offsets i32[B..., rows + 1]
                                  .Arg<xla::ffi::Buffer<xla::ffi::BF16>>()  // minmax bf16[B..., rows, 2]
                                  .Attr<int64_t>("cols")                    // columns of W
                                  .Ret<xla::ffi::Buffer<xla::ffi::BF16>>());  // w bf16[B..., rows, cols]
