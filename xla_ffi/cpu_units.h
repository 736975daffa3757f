// Units of work of the CPU handlers: the tokens of one weight matrix, either
// one token at a time (each row decoded straight into a dot product with a
// padded f32 copy of x) or blocks of up to 64 tokens stored token-major in
// tables of 16, so that a row is decoded once and each of its nonzero
// weights adds one 16-lane row per table.
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

#include "cpu_operands.h"
#include "cpu_parallel.h"
#include "cpu_row_kernels.h"
#include "xla/ffi/api/ffi.h"

namespace qmoe::cpu {

// An f32 or bf16 array viewed as rows of `width` values.
struct DenseRows {
  void* data;
  bool bf16;
  int64_t width;

  float Get(int64_t row, int64_t j) const;
  void Set(int64_t row, int64_t j, float value) const;
};

float Bf16ToFloat(uint16_t bits);

// Zeros the result rows of the tokens not in use: rows b * tokens + n of
// `out` for n >= used_tokens[b].
void ZeroUnusedTokens(const DenseRows& out, int64_t tokens,
                      const std::vector<int64_t>& used_tokens);

// The row kernels for this call: the best the CPU runs, or QMOE_CPU_ISA's.
xla::ffi::Error SelectKernels(const char* op, const RowKernels** kernels);

// For kernels outside the row kernels, built once per instruction set: the build of the set
// SelectKernels picks for `op` (the same choice, so QMOE_CPU_ISA forces it too).
template <typename Function>
xla::ffi::Error SelectIsaBuild(const char* op, Function portable, Function avx2, Function avx512,
                               Function* selected) {
  const RowKernels* kernels;
  if (auto error = SelectKernels(op, &kernels); error.failure()) return error;
  const std::string_view isa = kernels->isa;
  *selected = isa == "avx512" ? avx512 : isa == "avx2" ? avx2 : portable;
  return xla::ffi::Error::Success();
}

inline constexpr int64_t kTokensPerBlock = 4 * kTokenLanes;

// Tokens [first, first + count) of groups[group], computed together.
struct Unit {
  int64_t group;
  int64_t first;
  int64_t count;
  bool block;
};

// Cuts each group's tokens into blocks of up to kTokensPerBlock; a block of
// fewer than kBlockTokens tokens goes one token at a time unless always_blocks.
std::vector<Unit> Units(const std::vector<TokenGroup>& groups, bool always_blocks);

struct RowRange {
  int64_t begin;
  int64_t end;
};

// Part `split` of `splits` near-equal parts of [0, total).
RowRange Split(int64_t total, int64_t splits, int64_t split);

// Row ranges per unit when there are too few units to keep `workers` busy.
int64_t RowSplits(int64_t rows, int64_t units, int64_t workers);

// Token-major tables of a block unit, each [PaddedCols(width) + kDensePad][16].
int64_t Tables(const Unit& unit);
int64_t TableSize(int64_t width);

// Floats of a unit's token buffer (LoadTokens): the tables of a block, or one
// row with kRowsDotSlack zeros behind it (rows_dot's x).
int64_t TokenBufferSize(int64_t width, const Unit& unit);

// A unit's dense rows (rows[first..], `dense.width` values each) as f32: one
// zero-padded row, or Tables(unit) token-major tables for a block (token t
// in lane t % 16 of table t / 16).
void LoadTokens(const Unit& unit, const std::vector<int64_t>& rows, const DenseRows& dense,
                float* buffer);

// Per-thread buffers, reused across tasks and calls.
struct Scratch {
  std::vector<float> tokens;
  std::vector<float> sums;
  std::vector<int32_t> plus;
  std::vector<int32_t> minus;
};
Scratch& ThreadScratch();

template <typename T>
T* Reserve(std::vector<T>& buffer, int64_t size) {
  if (static_cast<int64_t>(buffer.size()) < size) buffer.resize(size);
  return buffer.data();
}

// Decodes rows into the columns of their +max and -min weights, in this
// thread's scratch lists (valid until the thread's next RowDecoder).
class RowDecoder {
 public:
  RowDecoder(const CompressedOperands& w, const RowKernels& kernels);
  // Row r of `matrix`; false when its codes do not decode to exactly the row's columns.
  bool Decode(const WeightMatrix& matrix, int64_t r);

  int32_t* plus_index;
  int32_t* minus_index;
  int64_t plus_count = 0;
  int64_t minus_count = 0;

 private:
  const CompressedOperands& w_;
  const RowKernels& kernels_;
};

// y rows of a unit's tokens for W rows in `rows`; a row that fails to decode
// is recorded as unit.group * w.rows + row.
void MatmulRows(const CompressedOperands& w, const RowKernels& kernels,
                const std::vector<TokenGroup>& groups, const Unit& unit, const float* tokens,
                RowRange rows, const DenseRows& y, FirstFailure& failure);

// Adds (W rows in `rows`)ᵀ · g for a block unit into `sums`, Tables(unit)
// token-major tables of width cols; `gradient` holds the unit's g as tables
// of width rows (LoadTokens). Failures are recorded as in MatmulRows.
void TransposedRows(const CompressedOperands& w, const RowKernels& kernels,
                    const std::vector<TokenGroup>& groups, const Unit& unit, const float* gradient,
                    RowRange rows, float* sums, FirstFailure& failure);

// Every group's tokens through its matrix: y rows = W · x rows, spread over the pool (units of
// one matrix's tokens; with fewer units than twice the threads, each unit's rows are split too).
// A row that fails to decode is recorded in `failure` as group * w.rows + row.
void RunMatmul(xla::ffi::ThreadPool& pool, const CompressedOperands& w, const RowKernels& kernels,
               const std::vector<TokenGroup>& groups, const DenseRows& x, const DenseRows& y,
               FirstFailure& failure);

// The same for the input gradient: dx rows = Wᵀ · g rows (g viewed with width w.rows, dx with
// w.cols). Nothing is written once a row has failed.
void RunTransposed(xla::ffi::ThreadPool& pool, const CompressedOperands& w,
                   const RowKernels& kernels, const std::vector<TokenGroup>& groups,
                   const DenseRows& g, const DenseRows& dx, FirstFailure& failure);

}  // namespace qmoe::cpu
