// "qmoe_gptq_block" on the CPU: see cpu_gptq.h for the contract.
//
// Each task takes kRowsPerTask rows of one batch item. Their weights and
// corrections for the whole block are copied into a small column-major
// scratch (m x kRowsPerTask floats each, 16 KiB at m = 128), so that a
// column's update of the later columns, c_j += D_k·S_kj, is a short loop over
// contiguous rows that the compiler vectorizes for each instruction set (the
// same source, built three times through target attributes; rows past the
// matrix's end carry D = 0). Residuals and codes are gathered column-major the
// same way and written back to the operands' row-major [rows, m] at the end.
#include "cpu_gptq.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "cpu_operands.h"
#include "cpu_parallel.h"
#include "cpu_units.h"
#include "xla/ffi/api/ffi.h"

namespace qmoe::cpu {
namespace {

namespace ffi = xla::ffi;

constexpr const char* kGptqBlock = "qmoe_gptq_block";
constexpr int64_t kTernaryLevels = 3;
constexpr int64_t kMaxLevels = 256;  // codes are u8
// Rows per task: their corrections (m x kRowsPerTask floats) stay in L1.
constexpr int64_t kRowsPerTask = 32;

// One batch item's operands and results.
struct Block {
  const float* weights;      // [rows, m]
  const float* corrections;  // [rows, m]
  const float* scaled;       // [m, m]
  const float* factor_diag;  // [m]
  const float* params;       // [rows, 2]
  float* residuals;          // [rows, m]
  uint8_t* codes;            // [rows, m]
  float* squared_errors;     // [rows]
  int64_t m;
  int64_t rows;
  int64_t levels;
};

// Rows [begin, begin + count) of a row-major [rows, m] operand into a column-major tile
// (tile[k * kRowsPerTask + i] = operand[begin + i][k]), rows from `count` on zero.
__attribute__((always_inline)) inline void LoadTile(const float* operand, int64_t m, int64_t begin,
                                                    int64_t count, float* tile) {
  for (int64_t i = 0; i < count; ++i) {
    const float* row = operand + (begin + i) * m;
    for (int64_t k = 0; k < m; ++k) tile[k * kRowsPerTask + i] = row[k];
  }
  for (int64_t k = 0; k < m; ++k)
    std::fill(tile + k * kRowsPerTask + count, tile + (k + 1) * kRowsPerTask, 0.0f);
}

// The inverse of LoadTile for the tile's first `count` rows.
template <typename T>
__attribute__((always_inline)) inline void StoreTile(const T* tile, int64_t m, int64_t begin,
                                                     int64_t count, T* operand) {
  for (int64_t i = 0; i < count; ++i) {
    T* row = operand + (begin + i) * m;
    for (int64_t k = 0; k < m; ++k) row[k] = tile[k * kRowsPerTask + i];
  }
}

// Rounds the targets of kRowsPerTask rows to their grids (grids.py's `quantize`, tie rules
// included), without branches, so that the loop vectorizes (random data made the branches
// mispredict: they took most of the kernel's time). Padding rows (past the matrix's end) hold grid
// parameters that keep them at code 0.
__attribute__((always_inline)) inline void RoundTargets(const float* target, const float* first,
                                                        const float* second, bool ternary,
                                                        float top, float* dequantized,
                                                        float* code) {
  if (ternary) {  // first = min, second = max; ties and zero levels go to code 0
    for (int64_t i = 0; i < kRowsPerTask; ++i) {
      const bool to_max = (target[i] > 0.5f * second[i]) & (second[i] > 0.0f);
      const bool to_min = (target[i] < 0.5f * first[i]) & (first[i] < 0.0f);
      dequantized[i] = to_max ? second[i] : (to_min ? first[i] : 0.0f);
      code[i] = to_max ? 2.0f : (to_min ? 1.0f : 0.0f);
    }
  } else {
    // first = scale, second = zero: clip(round(x / scale) + zero, 0, levels − 1),
    // round half to even
    for (int64_t i = 0; i < kRowsPerTask; ++i) {
      const float level = std::min(std::max(std::nearbyint(target[i] / first[i]) + second[i], 0.0f),
                                   top);
      code[i] = level;
      dequantized[i] = first[i] * (level - second[i]);
    }
  }
}

// Rows [begin, begin + count) of `block` (count <= kRowsPerTask); `scratch` holds
// kScratchTiles * m * kRowsPerTask floats. Every loop runs over all kRowsPerTask rows:
// rows past `count` carry weights and corrections 0, so their residuals stay 0 and
// they never change the others.
// The tiles: corrections, weights, residuals, codes (as bytes, in a float tile).
constexpr int64_t kScratchTiles = 4;

__attribute__((always_inline)) inline void QuantizeRows(const Block& block, int64_t begin,
                                                        int64_t count, float* scratch) {
  const bool ternary = block.levels == kTernaryLevels;
  const float top = static_cast<float>(block.levels - 1);
  // Ternary: first = min, second = max; minmax: first = scale, second = zero. Padding rows get a
  // grid that rounds their zero targets to code 0: ternary (0, 0), minmax scale 1, zero 0.
  float first[kRowsPerTask], second[kRowsPerTask], squared[kRowsPerTask];
  float target[kRowsPerTask], dequantized[kRowsPerTask], code[kRowsPerTask];
  for (int64_t i = 0; i < kRowsPerTask; ++i) {
    const bool in = i < count;
    first[i] = in ? block.params[2 * (begin + i)] : (ternary ? 0.0f : 1.0f);
    second[i] = in ? block.params[2 * (begin + i) + 1] : 0.0f;
    squared[i] = 0.0f;
  }
  const int64_t tile = block.m * kRowsPerTask;
  float* weight_tile = scratch + tile;
  float* residual_tile = scratch + 2 * tile;
  uint8_t* code_tile = reinterpret_cast<uint8_t*>(scratch + 3 * tile);
  LoadTile(block.corrections, block.m, begin, count, scratch);
  LoadTile(block.weights, block.m, begin, count, weight_tile);
  // Column k: round its targets, record residuals and codes in their tiles, accumulate squared
  // errors; returns the column's residuals.
  const auto quantize_column = [&](int64_t k) __attribute__((always_inline)) {
    float* residual = residual_tile + k * kRowsPerTask;
    const float* weights = weight_tile + k * kRowsPerTask;
    const float* corrections = scratch + k * kRowsPerTask;
    const float diag = block.factor_diag[k];
    for (int64_t i = 0; i < kRowsPerTask; ++i) target[i] = weights[i] + corrections[i];
    RoundTargets(target, first, second, ternary, top, dequantized, code);
    for (int64_t i = 0; i < kRowsPerTask; ++i) {
      const float error = (target[i] - dequantized[i]) * diag;
      squared[i] = squared[i] + error * error;
      residual[i] = weights[i] - dequantized[i];
    }
    uint8_t* codes = code_tile + k * kRowsPerTask;
    for (int64_t i = 0; i < kRowsPerTask; ++i) codes[i] = static_cast<uint8_t>(code[i]);
    return static_cast<const float*>(residual);
  };
  // Columns in pairs (k, k + 1): k's residual goes to column k + 1 first, which is then rounded,
  // and both residuals go to the later columns in one pass, each correction still rounded after
  // each product and each sum in the same order as one column at a time (so the bits are the same),
  // with half the loads and stores of the corrections.
  for (int64_t k = 0; k < block.m; k += 2) {
    const float* residual = quantize_column(k);
    const float* row_k = block.scaled + k * block.m;
    if (k + 1 == block.m) break;
    float* next = scratch + (k + 1) * kRowsPerTask;
    for (int64_t i = 0; i < kRowsPerTask; ++i) next[i] = next[i] + residual[i] * row_k[k + 1];
    const float* paired = quantize_column(k + 1);
    const float* row_next = block.scaled + (k + 1) * block.m;
    for (int64_t j = k + 2; j < block.m; ++j) {
      const float factor = row_k[j], factor_next = row_next[j];
      float* later = scratch + j * kRowsPerTask;
      for (int64_t i = 0; i < kRowsPerTask; ++i) {
        later[i] = (later[i] + residual[i] * factor) + paired[i] * factor_next;
      }
    }
  }
  StoreTile(residual_tile, block.m, begin, count, block.residuals);
  StoreTile(code_tile, block.m, begin, count, block.codes);
  std::memcpy(block.squared_errors + begin, squared, count * sizeof(float));
}

using RowsFunction = void (*)(const Block&, int64_t, int64_t, float*);

void QuantizeRowsPortable(const Block& block, int64_t begin, int64_t count, float* scratch) {
  QuantizeRows(block, begin, count, scratch);
}

__attribute__((target("avx2"))) void QuantizeRowsAvx2(const Block& block, int64_t begin,
                                                      int64_t count, float* scratch) {
  QuantizeRows(block, begin, count, scratch);
}

QMOE_AVX512_TARGET("avx512f,avx512vl,avx512bw,avx512dq") void QuantizeRowsAvx512(
    const Block& block, int64_t begin, int64_t count, float* scratch) {
  QuantizeRows(block, begin, count, scratch);
}

ffi::Error ShapeError(const std::string& what, Dims dims) {
  return ffi::Error::InvalidArgument(std::string(kGptqBlock) + ": " + what + "; got " +
                                     ShapeString(dims));
}

bool SameLeading(Dims dims, Dims reference, size_t trailing, size_t reference_trailing) {
  if (dims.size() < trailing || dims.size() - trailing != reference.size() - reference_trailing)
    return false;
  return std::equal(dims.begin(), dims.end() - trailing, reference.begin());
}

ffi::Error GptqBlockImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> weights,
                         ffi::Buffer<ffi::F32> corrections, ffi::Buffer<ffi::F32> scaled,
                         ffi::Buffer<ffi::F32> factor_diag, ffi::Buffer<ffi::F32> params,
                         int64_t levels, ffi::Result<ffi::Buffer<ffi::F32>> residuals,
                         ffi::Result<ffi::Buffer<ffi::U8>> codes,
                         ffi::Result<ffi::Buffer<ffi::F32>> squared_errors) {
  const Dims dims = weights.dimensions();
  if (dims.size() < 2) return ShapeError("weights must be [B..., rows, m]", dims);
  const int64_t rows = dims[dims.size() - 2];
  const int64_t m = dims[dims.size() - 1];
  const auto same = [&](Dims other) {
    return std::equal(other.begin(), other.end(), dims.begin(), dims.end());
  };
  if (!same(corrections.dimensions())) {
    return ShapeError("corrections must have the shape of weights " + ShapeString(dims),
                      corrections.dimensions());
  }
  const Dims scaled_dims = scaled.dimensions();
  if (!SameLeading(scaled_dims, dims, 2, 2) || scaled_dims[scaled_dims.size() - 2] != m ||
      scaled_dims[scaled_dims.size() - 1] != m) {
    return ShapeError("scaled must be [B..., m, m] for weights " + ShapeString(dims), scaled_dims);
  }
  const Dims diag_dims = factor_diag.dimensions();
  if (!SameLeading(diag_dims, dims, 1, 2) || diag_dims[diag_dims.size() - 1] != m) {
    return ShapeError("factor_diag must be [B..., m] for weights " + ShapeString(dims), diag_dims);
  }
  const Dims params_dims = params.dimensions();
  if (!SameLeading(params_dims, dims, 2, 2) || params_dims[params_dims.size() - 2] != rows ||
      params_dims[params_dims.size() - 1] != 2) {
    return ShapeError("params must be [B..., rows, 2] for weights " + ShapeString(dims),
                      params_dims);
  }
  if (!same(residuals->dimensions()) || !same(codes->dimensions())) {
    return ShapeError("residuals and codes must have weights's shape " + ShapeString(dims),
                      residuals->dimensions());
  }
  const Dims errors_dims = squared_errors->dimensions();
  if (!SameLeading(errors_dims, dims, 1, 2) || errors_dims[errors_dims.size() - 1] != rows) {
    return ShapeError("squared_errors must be [B..., rows] for weights " + ShapeString(dims),
                      errors_dims);
  }
  if (levels != kTernaryLevels && (levels < 2 || levels > kMaxLevels)) {
    return ffi::Error::InvalidArgument(std::string(kGptqBlock) +
                                       ": levels must be 3 (ternary) or a minmax " +
                                       "grid's 2 ... 256 codes; got " + std::to_string(levels));
  }
  RowsFunction quantize_rows;
  if (auto error = SelectIsaBuild<RowsFunction>(kGptqBlock, QuantizeRowsPortable, QuantizeRowsAvx2,
                                                QuantizeRowsAvx512, &quantize_rows);
      error.failure()) {
    return error;
  }

  const int64_t batch = LeadingProduct(dims, 2);
  if (batch == 0 || m == 0 || rows == 0) {
    std::fill(squared_errors->typed_data(), squared_errors->typed_data() + batch * rows, 0.0f);
    return ffi::Error::Success();
  }
  const int64_t chunks = (rows + kRowsPerTask - 1) / kRowsPerTask;
  ParallelFor(pool, batch * chunks, [&](int64_t task) {
    const int64_t b = task / chunks;
    const int64_t begin = (task % chunks) * kRowsPerTask;
    const Block block{weights.typed_data() + b * m * rows,
                      corrections.typed_data() + b * m * rows,
                      scaled.typed_data() + b * m * m,
                      factor_diag.typed_data() + b * m,
                      params.typed_data() + b * rows * 2,
                      residuals->typed_data() + b * m * rows,
                      codes->typed_data() + b * m * rows,
                      squared_errors->typed_data() + b * rows,
                      m,
                      rows,
                      levels};
    thread_local std::vector<float> scratch;
    scratch.resize(static_cast<size_t>(kScratchTiles * m * kRowsPerTask));
    quantize_rows(block, begin, std::min(kRowsPerTask, rows - begin), scratch.data());
  });
  return ffi::Error::Success();
}

}  // namespace
}  // namespace qmoe::cpu

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    QmoeGptqBlockCpu, qmoe::cpu::GptqBlockImpl,
    xla::ffi::Ffi::Bind()
        .Ctx<xla::ffi::ThreadPool>()               // XLA's intra-op pool
        .Arg<xla::ffi::Buffer<xla::ffi::F32>>()    // weights [B..., rows, m]
        .Arg<xla::ffi::Buffer<xla::ffi::F32>>()    // corrections [B..., rows, m]
        .Arg<xla::ffi::Buffer<xla::ffi::F32>>()    // scaled [B..., m, m]
        .Arg<xla::ffi::Buffer<xla::ffi::F32>>()    // factor_diag [B..., m]
        .Arg<xla::ffi::Buffer<xla::ffi::F32>>()    // params [B..., rows, 2]
        .Attr<int64_t>("levels")                   // 3 ternary, else minmax codes
        .Ret<xla::ffi::Buffer<xla::ffi::F32>>()    // residuals [B..., rows, m]
        .Ret<xla::ffi::Buffer<xla::ffi::U8>>()     // codes [B..., rows, m]
        .Ret<xla::ffi::Buffer<xla::ffi::F32>>());  // squared_errors [B..., rows]
