// "qmoe_cholesky_base" on the CPU: see cpu_cholesky.h for the contract.
//
// L is built column-major in a scratch (n x n floats, 64 KiB at n = 128), so
// that both updates are loops over contiguous floats that the compiler
// vectorizes for each instruction set (the same source, built three times
// through target attributes):
//   column j:   c_i = A_ij − Σ_{k<j} L_ik·L_jk   for rows i ≥ j, k in order
//   row j of L⁻¹: v_c = δ_jc − Σ_{r<j} L_jr·(L⁻¹)_rc   for c ≤ j, r in order
#include "cpu_cholesky.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "cpu_operands.h"
#include "cpu_parallel.h"
#include "cpu_units.h"
#include "xla/ffi/api/ffi.h"

namespace qmoe::cpu {
namespace {

namespace ffi = xla::ffi;

constexpr const char* kCholeskyBase = "qmoe_cholesky_base";

// One n x n item: A (row-major) in, L and L⁻¹ (row-major) out; `columns` holds n * n floats.
__attribute__((always_inline)) inline void FactorItem(const float* matrix, int64_t n, float* lower,
                                                      float* inverse, float* columns) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (int64_t j = 0; j < n; ++j) {
    float* column = columns + j * n;  // column j of L, rows j ... n − 1 in use
    for (int64_t i = j; i < n; ++i) column[i] = matrix[i * n + j];
    for (int64_t k = 0; k < j; ++k) {
      const float* earlier = columns + k * n;
      const float factor = earlier[j];  // L_jk
      for (int64_t i = j; i < n; ++i) column[i] = column[i] - earlier[i] * factor;
    }
    const float pivot = column[j] > 0.0f ? std::sqrt(column[j]) : nan;
    const float reciprocal = 1.0f / pivot;  // multiplied, as the twin does
    std::fill(column, column + j, 0.0f);
    column[j] = pivot;
    for (int64_t i = j + 1; i < n; ++i) column[i] = column[i] * reciprocal;

    float* row = inverse + j * n;
    std::fill(row, row + n, 0.0f);
    row[j] = 1.0f;
    for (int64_t r = 0; r < j; ++r) {
      const float factor = columns[r * n + j];  // L_jr
      const float* earlier = inverse + r * n;   // row r of L⁻¹: zero after column r
      for (int64_t c = 0; c <= r; ++c) row[c] = row[c] - factor * earlier[c];
    }
    // Entries after the diagonal are 0 · 1/pivot: zero, or NaN once a pivot has failed (as in
    // the twin).
    for (int64_t c = 0; c < n; ++c) row[c] = row[c] * reciprocal;
  }
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = 0; j < n; ++j) lower[i * n + j] = columns[j * n + i];
  }
}

using ItemFunction = void (*)(const float*, int64_t, float*, float*, float*);

void FactorItemPortable(const float* matrix, int64_t n, float* lower, float* inverse,
                        float* columns) {
  FactorItem(matrix, n, lower, inverse, columns);
}

__attribute__((target("avx2"))) void FactorItemAvx2(const float* matrix, int64_t n, float* lower,
                                                    float* inverse, float* columns) {
  FactorItem(matrix, n, lower, inverse, columns);
}

QMOE_AVX512_TARGET("avx512f,avx512vl,avx512bw,avx512dq") void FactorItemAvx512(
    const float* matrix, int64_t n, float* lower, float* inverse, float* columns) {
  FactorItem(matrix, n, lower, inverse, columns);
}

ffi::Error CholeskyBaseImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> matrix,
                            ffi::Result<ffi::Buffer<ffi::F32>> lower,
                            ffi::Result<ffi::Buffer<ffi::F32>> inverse) {
  const Dims dims = matrix.dimensions();
  if (dims.size() < 2 || dims[dims.size() - 1] != dims[dims.size() - 2]) {
    return ffi::Error::InvalidArgument(std::string(kCholeskyBase) +
                                       ": matrix must be [B..., n, n]; got " + ShapeString(dims));
  }
  const auto same = [&](Dims other) {
    return std::equal(other.begin(), other.end(), dims.begin(), dims.end());
  };
  if (!same(lower->dimensions()) || !same(inverse->dimensions())) {
    return ffi::Error::InvalidArgument(
        std::string(kCholeskyBase) + ": lower and inverse must have the matrix's " + "shape " +
        ShapeString(dims) + "; got " + ShapeString(lower->dimensions()));
  }
  ItemFunction factor_item;
  if (auto error = SelectIsaBuild<ItemFunction>(kCholeskyBase, FactorItemPortable, FactorItemAvx2,
                                                FactorItemAvx512, &factor_item);
      error.failure()) {
    return error;
  }
  const int64_t n = dims[dims.size() - 1];
  const int64_t batch = LeadingProduct(dims, 2);
  if (batch == 0 || n == 0) return ffi::Error::Success();
  ParallelFor(pool, batch, [&](int64_t b) {
    thread_local std::vector<float> columns;
    columns.resize(static_cast<size_t>(n * n));
    factor_item(matrix.typed_data() + b * n * n, n, lower->typed_data() + b * n * n,
                inverse->typed_data() + b * n * n, columns.data());
  });
  return ffi::Error::Success();
}

}  // namespace
}  // namespace qmoe::cpu

XLA_FFI_DEFINE_HANDLER_SYMBOL(QmoeCholeskyBaseCpu, qmoe::cpu::CholeskyBaseImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()               // XLA's intra-op pool
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()    // matrix [B..., n, n]
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()    // lower [B..., n, n]
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>());  // inverse [B..., n, n]
