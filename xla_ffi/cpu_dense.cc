// CPU handler of "qmoe_dense_matmul" (contract in cpu_dense.h): validation,
// then tiles of R rows x T tokens, each weight converted once per tile in
// registers and multiplied into R*T float32 accumulators. Conversions per 8
// weights: int8 a sign-extending load and a convert; bfloat16 half a load and
// one bit operation (pair tiles), against float32's load alone. A task's rows
// are read as R long streams at once (TokenGroup).
#include "cpu_dense.h"

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "cpu_operands.h"
#include "cpu_parallel.h"
#include "cpu_row_kernels.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace qmoe::cpu {
namespace {

constexpr const char* kDenseMatmul = "qmoe_dense_matmul";
// Tokens per task: a block of x (48 x cols floats) stays in L2 while a task's
// rows pass over it.
constexpr int64_t kTokenBlock = 48;
// Rows per task at most and at least (a multiple of 8, the widest row tile).
constexpr int64_t kMaxRowBlock = 256;
constexpr int64_t kMinRowBlock = 16;
// Tasks per thread when there are few tokens (Run).
constexpr int64_t kTasksPerThread = 2;

#define QMOE_DENSE_AVX2 __attribute__((target("avx2,fma")))
#define QMOE_DENSE_AVX2_INLINE QMOE_DENSE_AVX2 __attribute__((always_inline)) inline

inline float ToFloat(int8_t w) { return static_cast<float>(w); }
inline float ToFloat(float w) { return w; }
inline float ToFloat(uint16_t w) {
  const uint32_t bits = static_cast<uint32_t>(w) << 16;
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
}

// One tile: out[t * R + r] = sum_j w[r * stride + j] * x[t * cols + j], portable
// code.
template <typename W, int R, int T>
void TilePortable(const W* w, int64_t stride, const float* x, int64_t cols, float* out) {
  float sums[T][R] = {};
  for (int64_t j = 0; j < cols; ++j) {
    float weights[R];
    for (int r = 0; r < R; ++r) weights[r] = ToFloat(w[r * stride + j]);
    for (int t = 0; t < T; ++t) {
      const float value = x[t * cols + j];
      for (int r = 0; r < R; ++r) sums[t][r] += weights[r] * value;
    }
  }
  for (int t = 0; t < T; ++t) {
    for (int r = 0; r < R; ++r) out[t * R + r] = sums[t][r];
  }
}

QMOE_DENSE_AVX2_INLINE __m256 LoadWeights8(const int8_t* w) {
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(w));
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
}

QMOE_DENSE_AVX2_INLINE __m256 LoadWeights8(const uint16_t* w) {
  const __m128i halves = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(halves), 16));
}

QMOE_DENSE_AVX2_INLINE __m256 LoadWeights8(const float* w) { return _mm256_loadu_ps(w); }

QMOE_DENSE_AVX2_INLINE float Sum8(__m256 v) {
  __m128 sum = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  sum = _mm_add_ps(sum, _mm_movehl_ps(sum, sum));
  sum = _mm_add_ss(sum, _mm_movehdup_ps(sum));
  return _mm_cvtss_f32(sum);
}

// The same tile with AVX2: 8 columns per step, R * T accumulators (at most 12,
// so that they, the T loads of x and one converted weight vector fit the 16
// registers). The tile's R rows are `stride` weights apart: R streams of memory, each of which
// goes on in the row after (TokenGroup).
//
// The int8 tiles also prefetch, once per cache line they read, the same line of each stream's
// next row; the bfloat16 tiles leave their streams to the hardware prefetchers. Each decoded
// fastest that way (docs/dense_forms.md).
template <typename W, int R>
QMOE_DENSE_AVX2_INLINE void PrefetchNextRows(const W* w, int64_t stride, int64_t cols, int64_t j) {
  if constexpr (std::is_same_v<W, int8_t>) {
    if (j % 64 != 0) return;
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      _mm_prefetch(reinterpret_cast<const char*>(w + r * stride + cols + j), _MM_HINT_T0);
    }
  }
}

template <typename W, int R, int T>
QMOE_DENSE_AVX2 void TileAvx2(const W* w, int64_t stride, const float* x, int64_t cols,
                              float* out) {
  static_assert(R * T + T + 1 <= 16, "the tile must fit the 16 vector registers");
  __m256 sums[T][R];
#pragma GCC unroll 16
  for (int t = 0; t < T; ++t) {
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) sums[t][r] = _mm256_setzero_ps();
  }
  int64_t j = 0;
  for (; j + 8 <= cols; j += 8) {
    PrefetchNextRows<W, R>(w, stride, cols, j);
    __m256 values[T];
#pragma GCC unroll 16
    for (int t = 0; t < T; ++t) values[t] = _mm256_loadu_ps(x + t * cols + j);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const __m256 weights = LoadWeights8(w + r * stride + j);
#pragma GCC unroll 16
      for (int t = 0; t < T; ++t) sums[t][r] = _mm256_fmadd_ps(weights, values[t], sums[t][r]);
    }
  }
#pragma GCC unroll 16
  for (int t = 0; t < T; ++t) {
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      float sum = Sum8(sums[t][r]);
      for (int64_t k = j; k < cols; ++k) sum += ToFloat(w[r * stride + k]) * x[t * cols + k];
      out[t * R + r] = sum;
    }
  }
}

// bfloat16 weights, cols a multiple of 16: each 32-bit lane of a load holds a pair of weights,
// (j, j + 1), and two bit operations make float32 vectors of the even and of the odd weights
// with no shuffle. The tokens come split the same way: `x_pairs` holds x[t, 0::2] then
// x[t, 1::2] per token. R * T accumulators, 2 * T loads of x, two weight vectors and the mask:
// at most 16 registers.
template <int R, int T>
QMOE_DENSE_AVX2 void TileAvx2Pairs(const uint16_t* w, int64_t stride, const float* x_pairs,
                                   int64_t cols, float* out) {
  static_assert(R * T + 2 * T + 3 <= 16, "the tile must fit the 16 vector registers");
  const int64_t half = cols / 2;
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  __m256 sums[T][R];
#pragma GCC unroll 16
  for (int t = 0; t < T; ++t) {
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) sums[t][r] = _mm256_setzero_ps();
  }
  for (int64_t j = 0; j < half; j += 8) {
    __m256 even[T], odd[T];
#pragma GCC unroll 16
    for (int t = 0; t < T; ++t) {
      even[t] = _mm256_loadu_ps(x_pairs + t * cols + j);
      odd[t] = _mm256_loadu_ps(x_pairs + t * cols + half + j);
    }
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const __m256i pairs =
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + r * stride + 2 * j));
      const __m256 low_weights = _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16));
      const __m256 high_weights = _mm256_castsi256_ps(_mm256_and_si256(pairs, high));
#pragma GCC unroll 16
      for (int t = 0; t < T; ++t) {
        sums[t][r] = _mm256_fmadd_ps(low_weights, even[t], sums[t][r]);
        sums[t][r] = _mm256_fmadd_ps(high_weights, odd[t], sums[t][r]);
      }
    }
  }
#pragma GCC unroll 16
  for (int t = 0; t < T; ++t) {
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) out[t * R + r] = Sum8(sums[t][r]);
  }
}

struct Problem {
  const float* x;        // [tokens, cols]
  const float* x_pairs;  // [tokens, cols] split into even and odd columns, or null
  const void* w;         // [rows, cols]
  const float* scales;   // [rows] or null
  float* y;              // [tokens, rows]
  int64_t tokens;
  int64_t rows;
  int64_t cols;
};

// The bfloat16 pair tiles apply (AVX2 code, a split copy of x made).
inline bool UsesPairs(const Problem& p) { return p.x_pairs != nullptr; }

// One tile of R rows, `stride` weights apart, from row r, times tokens [t, t + T).
template <typename W, bool kAvx2, int R, int T>
void Tile(const Problem& p, int64_t r, int64_t stride, int64_t t, float* out) {
  const W* w = static_cast<const W*>(p.w) + r * p.cols;
  if constexpr (kAvx2 && std::is_same_v<W, uint16_t> && R * T + 2 * T + 3 <= 16) {
    if (UsesPairs(p)) {
      TileAvx2Pairs<R, T>(w, stride, p.x_pairs + t * p.cols, p.cols, out);
      return;
    }
  }
  if constexpr (kAvx2) {
    TileAvx2<W, R, T>(w, stride, p.x + t * p.cols, p.cols, out);
  } else {
    TilePortable<W, R, T>(w, stride, p.x + t * p.cols, p.cols, out);
  }
}

// Rows [r0, r1) times tokens [t, t + T). The rows are cut into R runs of equal length, and
// tile i takes row i of every run: each run is one long stream of memory, and the tiles read R
// of them at once (the rows left over one at a time). Tiles of R neighbouring rows read R short
// streams instead (a 768-column int8 row is 12 cache lines), which the hardware prefetchers do
// not follow: the kernel read 20-25 GB/s that way, where a plain loop over 4 to 8 long streams
// per core reads 42-45 (docs/dense_forms.md).
template <typename W, bool kAvx2, int R, int T>
void TokenGroup(const Problem& p, int64_t r0, int64_t r1, int64_t t) {
  float out[T * R];
  const int64_t run = (r1 - r0) / R;
  for (int64_t i = 0; i < run; ++i) {
    Tile<W, kAvx2, R, T>(p, r0 + i, run * p.cols, t, out);
    for (int k = 0; k < T; ++k) {
      for (int q = 0; q < R; ++q) {
        const int64_t r = r0 + q * run + i;
        const float scale = p.scales ? p.scales[r] : 1.0f;
        p.y[(t + k) * p.rows + r] = out[k * R + q] * scale;
      }
    }
  }
  for (int64_t r = r0 + R * run; r < r1; ++r) {
    Tile<W, kAvx2, 1, T>(p, r, p.cols, t, out);
    const float scale = p.scales ? p.scales[r] : 1.0f;
    for (int k = 0; k < T; ++k) p.y[(t + k) * p.rows + r] = out[k] * scale;
  }
}

// One task: rows [r0, r1) times tokens [t0, t1), three tokens at a time (the
// first tokens left over two or one at a time). One token takes tiles of 4 int8
// rows or 8 bfloat16 or float32 rows, the heights that decoded fastest
// (docs/dense_forms.md has the comparison).
template <typename W, bool kAvx2>
void Block(const Problem& p, int64_t r0, int64_t r1, int64_t t0, int64_t t1) {
  int64_t t = t0;
  if (UsesPairs(p)) {  // two tokens at a time: the split tokens take twice the registers
    for (; t + 2 <= t1; t += 2) TokenGroup<W, kAvx2, 4, 2>(p, r0, r1, t);
  }
  for (; t + 3 <= t1; t += 3) TokenGroup<W, kAvx2, 4, 3>(p, r0, r1, t);
  if (t1 - t == 2) TokenGroup<W, kAvx2, 4, 2>(p, r0, r1, t);
  if (t1 - t == 1) TokenGroup<W, kAvx2, std::is_same_v<W, int8_t> ? 4 : 8, 1>(p, r0, r1, t);
}

template <typename W>
void Run(ffi::ThreadPool& pool, const Problem& p, bool avx2) {
  const int64_t workers = Workers(pool);
  const int64_t token_blocks = (p.tokens + kTokenBlock - 1) / kTokenBlock;
  // Enough row blocks for 2 tasks per thread when there are few tokens, in
  // multiples of 8 rows. Each task starts its stream of rows cold, so small
  // matrices (a decoding step's 768x768 products) lose to many small tasks
  // (docs/dense_forms.md has the measurement against 8 per thread).
  int64_t row_block = p.rows / std::max<int64_t>(1, kTasksPerThread * workers / token_blocks);
  row_block = std::clamp<int64_t>((row_block + 7) / 8 * 8, kMinRowBlock, kMaxRowBlock);
  const int64_t row_blocks = (p.rows + row_block - 1) / row_block;
  ParallelFor(pool, row_blocks * token_blocks, [&](int64_t task) {
    const int64_t r0 = (task % row_blocks) * row_block;
    const int64_t t0 = (task / row_blocks) * kTokenBlock;
    const int64_t r1 = std::min(p.rows, r0 + row_block);
    const int64_t t1 = std::min(p.tokens, t0 + kTokenBlock);
    if (avx2) {
      Block<W, true>(p, r0, r1, t0, t1);
    } else {
      Block<W, false>(p, r0, r1, t0, t1);
    }
  });
}

}  // namespace

bool CpuHasAvx2Fma() { return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"); }

// AVX2 unless QMOE_CPU_ISA=portable (or the CPU lacks it); avx512 runs the AVX2
// code, which reads memory as fast.
ffi::Error SelectDenseIsa(const char* op, bool* avx2) {
  const char* requested = std::getenv("QMOE_CPU_ISA");
  const std::string_view isa = requested ? requested : "";
  if (isa.empty() || isa == "auto") {
    *avx2 = CpuHasAvx2Fma();
  } else if (isa == "portable") {
    *avx2 = false;
  } else if ((isa == "avx2" && CpuHasAvx2()) || (isa == "avx512" && CpuHasAvx512())) {
    *avx2 = true;
  } else if (isa == "avx2" || isa == "avx512") {
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                      std::string(op) + ": QMOE_CPU_ISA=" + std::string(isa) +
                          " but this CPU lacks it; unset QMOE_CPU_ISA or pick another");
  } else {
    return ffi::Error::InvalidArgument(std::string(op) +
                                       ": QMOE_CPU_ISA must be auto, avx512, avx2 or portable; "
                                       "got '" +
                                       std::string(isa) + "'");
  }
  return ffi::Error::Success();
}

namespace {

ffi::Error Invalid(const std::string& message) {
  return ffi::Error::InvalidArgument(std::string(kDenseMatmul) + ": " + message);
}

ffi::Error DenseMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w,
                           ffi::Buffer<ffi::F32> scales, ffi::Result<ffi::Buffer<ffi::F32>> y) {
  const Dims x_dims = x.dimensions();
  const Dims w_dims = w.dimensions();
  const Dims scale_dims = scales.dimensions();
  const Dims y_dims = y->dimensions();
  const bool int8 = w.element_type() == ffi::DataType::S8;
  const bool f32 = w.element_type() == ffi::DataType::F32;
  if (!int8 && !f32 && w.element_type() != ffi::DataType::BF16) {
    return Invalid("w must be float32, bfloat16 or int8");
  }
  if (w_dims.size() != 2) return Invalid("w must be [rows, cols]; got " + ShapeString(w_dims));
  const int64_t rows = w_dims[0], cols = w_dims[1];
  if (x_dims.size() != 2 || x_dims[1] != cols) {
    return Invalid("x must be [N, " + std::to_string(cols) + "] (the columns of w); got " +
                   ShapeString(x_dims));
  }
  const int64_t tokens = x_dims[0];
  if (y_dims.size() != 2 || y_dims[0] != tokens || y_dims[1] != rows) {
    return Invalid("y must be [" + std::to_string(tokens) + ", " + std::to_string(rows) +
                   "]; got " + ShapeString(y_dims));
  }
  const int64_t expected_scales = int8 ? rows : 0;
  if (scale_dims.size() != 1 || scale_dims[0] != expected_scales) {
    return Invalid(std::string("scales must be [") + std::to_string(expected_scales) + "] (" +
                   (int8 ? "one per row of int8 weights" : "none for float32 or bfloat16 weights") +
                   "); got " + ShapeString(scale_dims));
  }
  bool avx2 = false;
  if (auto error = SelectDenseIsa(kDenseMatmul, &avx2); error.failure()) return error;
  if (tokens == 0 || rows == 0) return ffi::Error::Success();
  // bfloat16 rows of whole 16-column steps take the pair tiles, with x split into its even and
  // odd columns once per call.
  std::vector<float> x_pairs;
  if (!int8 && !f32 && avx2 && cols % 16 == 0) {
    x_pairs.resize(tokens * cols);
    const float* source = x.typed_data();
    for (int64_t t = 0; t < tokens; ++t) {
      float* split = x_pairs.data() + t * cols;
      for (int64_t j = 0; j < cols / 2; ++j) {
        split[j] = source[t * cols + 2 * j];
        split[cols / 2 + j] = source[t * cols + 2 * j + 1];
      }
    }
  }
  const Problem problem{x.typed_data(),
                        x_pairs.empty() ? nullptr : x_pairs.data(),
                        w.untyped_data(),
                        int8 ? scales.typed_data() : nullptr,
                        y->typed_data(),
                        tokens,
                        rows,
                        cols};
  if (f32) {
    Run<float>(pool, problem, avx2);
  } else if (int8) {
    Run<int8_t>(pool, problem, avx2);
  } else {
    Run<uint16_t>(pool, problem, avx2);
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace qmoe::cpu

XLA_FFI_DEFINE_HANDLER_SYMBOL(QmoeDenseMatmulCpu, qmoe::cpu::DenseMatmulImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()             // XLA's intra-op pool
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // x f32[N, cols]
                                  .Arg<xla::ffi::AnyBuffer>()              // w bf16|s8[rows, cols]
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // scales f32[rows] | [0]
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>());  // y f32[N, rows]
