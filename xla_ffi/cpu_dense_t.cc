// CPU handler of "qmoe_dense_matmul_t" (contract in cpu_dense.h): y = x · K for
// few tokens and a float32 T5X kernel K [in, out], read in its own layout.
//
// A task takes a range of K's rows (the input channels), and of its columns
// (the output channels) only when there are too few rows for the tasks. It
// cuts its rows into 4 runs of equal length and steps through them together,
// so that it reads 4 long streams of memory at once, and adds x[n, i] times
// each of the 4 rows into sums of its output channels, up to 8 tokens at a
// time. One token's sums stay whole in the L2 (even the 32128 of an untied
// logits kernel), so each row is read from end to end: tasks that read a few
// KB of each row and then skipped to the next read more slowly
// (docs/dense_forms.md). Tasks over different rows keep their own sums, which
// are added up at the end.
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "cpu_dense.h"
#include "cpu_operands.h"
#include "cpu_parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace qmoe::cpu {
namespace {

constexpr const char* kDenseMatmulTransposed = "qmoe_dense_matmul_t";
// Rows of K read at once: 4 streams.
constexpr int kRuns = 4;
// Tokens per pass over K.
constexpr int64_t kTokens = 8;
// Floats of sums per block (256 KB, half of a Zen 2 core's L2): the block's columns are this /
// tokens, every column of a decoding step's matrices for one token.
constexpr int64_t kBlockFloats = 65536;
// Tasks per thread; columns per task at least (a split over columns needs no adding up);
// rows per task at least.
constexpr int64_t kTasksPerThread = 2;
constexpr int64_t kMinTaskColumns = 1024;
constexpr int64_t kMinTaskRows = 32;
// Sums added up by the calling thread at most.
constexpr int64_t kSerialSums = 8192;

#define QMOE_DENSE_T_AVX2 __attribute__((target("avx2,fma")))

struct Problem {
  const float* x;  // [tokens, in]
  const float* k;  // [in, out]
  int64_t tokens;
  int64_t in;
  int64_t out;
};

// sums[t * stride + c - c0] += sum over rows i in `rows` of x[t0 + t, i] * k[i, c], for the T
// tokens from t0 and the columns [c0, c1). `rows[q]` lists kRuns row indexes, or 1.
template <int T, int R>
void AddRowsPortable(const Problem& p, const int64_t* rows, int64_t t0, int64_t c0, int64_t c1,
                     float* sums, int64_t stride) {
  float values[T][R];
  for (int t = 0; t < T; ++t) {
    for (int q = 0; q < R; ++q) values[t][q] = p.x[(t0 + t) * p.in + rows[q]];
  }
  for (int64_t c = c0; c < c1; ++c) {
    float weights[R];
    for (int q = 0; q < R; ++q) weights[q] = p.k[rows[q] * p.out + c];
    for (int t = 0; t < T; ++t) {
      float sum = sums[t * stride + c - c0];
      for (int q = 0; q < R; ++q) sum += values[t][q] * weights[q];
      sums[t * stride + c - c0] = sum;
    }
  }
}

template <int T, int R>
QMOE_DENSE_T_AVX2 void AddRowsAvx2(const Problem& p, const int64_t* rows, int64_t t0, int64_t c0,
                                   int64_t c1, float* sums, int64_t stride) {
  __m256 values[T][R];
  const float* k[R];
#pragma GCC unroll 8
  for (int q = 0; q < R; ++q) {
    k[q] = p.k + rows[q] * p.out;
#pragma GCC unroll 8
    for (int t = 0; t < T; ++t) values[t][q] = _mm256_set1_ps(p.x[(t0 + t) * p.in + rows[q]]);
  }
  int64_t c = c0;
  for (; c + 8 <= c1; c += 8) {
    __m256 weights[R];
#pragma GCC unroll 8
    for (int q = 0; q < R; ++q) weights[q] = _mm256_loadu_ps(k[q] + c);
#pragma GCC unroll 8
    for (int t = 0; t < T; ++t) {
      float* sum = sums + t * stride + c - c0;
      __m256 total = _mm256_loadu_ps(sum);
#pragma GCC unroll 8
      for (int q = 0; q < R; ++q) total = _mm256_fmadd_ps(weights[q], values[t][q], total);
      _mm256_storeu_ps(sum, total);
    }
  }
  for (; c < c1; ++c) {
    for (int t = 0; t < T; ++t) {
      float sum = sums[t * stride + c - c0];
      for (int q = 0; q < R; ++q) sum += p.x[(t0 + t) * p.in + rows[q]] * k[q][c];
      sums[t * stride + c - c0] = sum;
    }
  }
}

template <int T, bool kAvx2>
void AddRows(const Problem& p, const int64_t* rows, int n_rows, int64_t t0, int64_t c0, int64_t c1,
             float* sums, int64_t stride) {
  if (n_rows == kRuns) {
    if constexpr (kAvx2) {
      AddRowsAvx2<T, kRuns>(p, rows, t0, c0, c1, sums, stride);
    } else {
      AddRowsPortable<T, kRuns>(p, rows, t0, c0, c1, sums, stride);
    }
  } else if constexpr (kAvx2) {
    AddRowsAvx2<T, 1>(p, rows, t0, c0, c1, sums, stride);
  } else {
    AddRowsPortable<T, 1>(p, rows, t0, c0, c1, sums, stride);
  }
}

// sums[t * stride + c - c0] = sum over rows [r0, r1) of x[t0 + t, i] * k[i, c] for the T tokens
// from t0, in blocks of at most kBlockFloats sums (one block for one token of a decoding step's
// matrices).
template <int T, bool kAvx2>
void TokenGroup(const Problem& p, int64_t r0, int64_t r1, int64_t t0, int64_t c0, int64_t c1,
                float* sums, int64_t stride) {
  const int64_t block = std::max<int64_t>(64, kBlockFloats / T / 8 * 8);
  const int64_t run = (r1 - r0) / kRuns;
  for (int64_t b0 = c0; b0 < c1; b0 += block) {
    const int64_t b1 = std::min(c1, b0 + block);
    float* block_sums = sums + (b0 - c0);
    for (int t = 0; t < T; ++t)
      std::fill(block_sums + t * stride, block_sums + t * stride + (b1 - b0), 0.0f);
    for (int64_t i = 0; i < run; ++i) {
      int64_t rows[kRuns];
      for (int q = 0; q < kRuns; ++q) rows[q] = r0 + q * run + i;
      AddRows<T, kAvx2>(p, rows, kRuns, t0, b0, b1, block_sums, stride);
    }
    for (int64_t i = r0 + kRuns * run; i < r1; ++i) {
      AddRows<T, kAvx2>(p, &i, 1, t0, b0, b1, block_sums, stride);
    }
  }
}

// TokenGroup<T> for T = 1 .. kTokens, indexed by T - 1.
template <bool kAvx2, size_t... T>
constexpr auto TokenGroups(std::index_sequence<T...>) {
  return std::array{&TokenGroup<static_cast<int>(T) + 1, kAvx2>...};
}

template <bool kAvx2>
void Task(const Problem& p, int64_t r0, int64_t r1, int64_t c0, int64_t c1, float* sums) {
  static constexpr auto kGroups = TokenGroups<kAvx2>(std::make_index_sequence<kTokens>());
  // sums is [tokens, out] with the task's columns from c0.
  for (int64_t t0 = 0; t0 < p.tokens; t0 += kTokens) {
    const int64_t group = std::min(kTokens, p.tokens - t0);
    kGroups[group - 1](p, r0, r1, t0, c0, c1, sums + t0 * p.out + c0, p.out);
  }
}

// Bounds of part `index` of `parts` equal parts of [0, n), in multiples of `unit` but the last.
void Part(int64_t n, int64_t parts, int64_t index, int64_t unit, int64_t* begin, int64_t* end) {
  const int64_t units = (n + unit - 1) / unit;
  *begin = std::min(n, units * index / parts * unit);
  *end = std::min(n, units * (index + 1) / parts * unit);
}

void Run(ffi::ThreadPool& pool, const Problem& p, float* y, bool avx2) {
  const int64_t wanted = kTasksPerThread * Workers(pool);
  const int64_t row_parts = std::clamp<int64_t>(p.in / kMinTaskRows, 1, wanted);
  const int64_t column_parts = std::clamp<int64_t>(wanted / row_parts, 1,
                                                   std::max<int64_t>(1, p.out / kMinTaskColumns));
  // Row part 0 sums into y, the others into their own [tokens, out] buffers.
  std::vector<float> partial((row_parts - 1) * p.tokens * p.out);
  ParallelFor(pool, row_parts * column_parts, [&](int64_t task) {
    const int64_t part = task / column_parts;
    int64_t r0, r1, c0, c1;
    Part(p.in, row_parts, part, 1, &r0, &r1);
    Part(p.out, column_parts, task % column_parts, 8, &c0, &c1);
    float* sums = part == 0 ? y : partial.data() + (part - 1) * p.tokens * p.out;
    if (avx2) {
      Task<true>(p, r0, r1, c0, c1, sums);
    } else {
      Task<false>(p, r0, r1, c0, c1, sums);
    }
  });
  if (row_parts == 1) return;
  // Adding up: on this thread when the sums are few (a decoding step's), where a second round
  // over the pool would cost more than the additions.
  const int64_t total = p.tokens * p.out;
  const int64_t chunks = total <= kSerialSums ? 1 : std::min<int64_t>(Workers(pool), total / 4096);
  const auto add_up = [&](int64_t chunk) {
    int64_t begin, end;
    Part(total, chunks, chunk, 8, &begin, &end);
    for (int64_t part = 1; part < row_parts; ++part) {
      const float* add = partial.data() + (part - 1) * total;
      for (int64_t j = begin; j < end; ++j) y[j] += add[j];
    }
  };
  if (chunks == 1) {
    add_up(0);
  } else {
    ParallelFor(pool, chunks, add_up);
  }
}

ffi::Error Invalid(const std::string& message) {
  return ffi::Error::InvalidArgument(std::string(kDenseMatmulTransposed) + ": " + message);
}

ffi::Error DenseMatmulTransposedImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                                     ffi::Buffer<ffi::F32> k,
                                     ffi::Result<ffi::Buffer<ffi::F32>> y) {
  const Dims x_dims = x.dimensions();
  const Dims k_dims = k.dimensions();
  const Dims y_dims = y->dimensions();
  if (k_dims.size() != 2) return Invalid("k must be [in, out]; got " + ShapeString(k_dims));
  const int64_t in = k_dims[0], out = k_dims[1];
  if (x_dims.size() != 2 || x_dims[1] != in) {
    return Invalid("x must be [N, " + std::to_string(in) + "] (the rows of k); got " +
                   ShapeString(x_dims));
  }
  const int64_t tokens = x_dims[0];
  if (y_dims.size() != 2 || y_dims[0] != tokens || y_dims[1] != out) {
    return Invalid("y must be [" + std::to_string(tokens) + ", " + std::to_string(out) + "]; got " +
                   ShapeString(y_dims));
  }
  bool avx2 = false;
  if (auto error = SelectDenseIsa(kDenseMatmulTransposed, &avx2); error.failure()) return error;
  if (tokens == 0 || out == 0) return ffi::Error::Success();
  if (in == 0) {
    std::fill(y->typed_data(), y->typed_data() + tokens * out, 0.0f);
    return ffi::Error::Success();
  }
  Run(pool, Problem{x.typed_data(), k.typed_data(), tokens, in, out}, y->typed_data(), avx2);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace qmoe::cpu

XLA_FFI_DEFINE_HANDLER_SYMBOL(QmoeDenseMatmulTransposedCpu, qmoe::cpu::DenseMatmulTransposedImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()               // XLA's intra-op pool
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()    // x f32[N, in]
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()    // k f32[in, out]
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>());  // y f32[N, out]
