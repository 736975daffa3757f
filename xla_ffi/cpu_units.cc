#include "cpu_units.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>
#include <string_view>

namespace ffi = xla::ffi;

namespace qmoe::cpu {
namespace {

// Groups with fewer tokens than this run the one-token dot per token: a
// block decodes a row into position lists and adds 16-lane token rows, which
// costs a few one-token dots whatever its width (docs/cpu_kernels.md).
constexpr int64_t kBlockTokens = 4;
// Smallest row range worth a task of its own.
constexpr int64_t kMinRowsPerTask = 16;

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

uint16_t FloatToBf16(float value) {
  uint32_t word;
  std::memcpy(&word, &value, sizeof(word));
  if ((word & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((word >> 16) | 0x40);
  word += 0x7FFFu + ((word >> 16) & 1u);  // round to nearest even
  return static_cast<uint16_t>(word >> 16);
}

}  // namespace

float Bf16ToFloat(uint16_t bits) {
  const uint32_t word = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &word, sizeof(value));
  return value;
}

float DenseRows::Get(int64_t row, int64_t j) const {
  const int64_t i = row * width + j;
  return bf16 ? Bf16ToFloat(static_cast<const uint16_t*>(data)[i])
              : static_cast<const float*>(data)[i];
}

void DenseRows::Set(int64_t row, int64_t j, float value) const {
  const int64_t i = row * width + j;
  if (bf16) {
    static_cast<uint16_t*>(data)[i] = FloatToBf16(value);
  } else {
    static_cast<float*>(data)[i] = value;
  }
}

void ZeroUnusedTokens(const DenseRows& out, int64_t tokens,
                      const std::vector<int64_t>& used_tokens) {
  const int64_t row_bytes = out.width * (out.bf16 ? sizeof(uint16_t) : sizeof(float));
  for (size_t b = 0; b < used_tokens.size(); ++b) {
    const int64_t first = static_cast<int64_t>(b) * tokens + used_tokens[b];
    std::memset(static_cast<char*>(out.data) + first * row_bytes, 0,
                (tokens - used_tokens[b]) * row_bytes);
  }
}

std::vector<const char*> CpuIsas() {
  // AVX2 first wherever the CPU has it, AVX-512 after: on every AVX-512 CPU measured (AMD Zen 4,
  // Intel family 6 model 207) the AVX2 row kernels ran the one-token product and a sparse layer
  // step faster, the 16-token product as fast or faster (docs/cpu_kernels.md §1). The GPTQ block
  // and Cholesky kernels follow the same choice (SelectIsaBuild); their AVX2 and AVX-512 builds
  // give the same bits and ran at the same speed on both (docs/calibration.md §4).
  std::vector<const char*> isas;
  if (CpuHasAvx2()) isas.push_back("avx2");
  if (CpuHasAvx512()) isas.push_back("avx512");
  isas.push_back("portable");
  return isas;
}

ffi::Error SelectKernels(const char* op, const RowKernels** kernels) {
  const char* requested = std::getenv("QMOE_CPU_ISA");
  std::string_view isa = requested ? requested : "";
  static const char* const fastest = CpuIsas().front();
  if (isa.empty() || isa == "auto") isa = fastest;
  if (isa == "avx512" && CpuHasAvx512()) {
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
                                       "got '" +
                                       std::string(isa) + "'");
  }
  return ffi::Error::Success();
}

std::vector<Unit> Units(const std::vector<TokenGroup>& groups, bool always_blocks) {
  std::vector<Unit> units;
  for (int64_t g = 0; g < static_cast<int64_t>(groups.size()); ++g) {
    const int64_t tokens = static_cast<int64_t>(groups[g].in_rows.size());
    for (int64_t first = 0; first < tokens; first += kTokensPerBlock) {
      const int64_t count = std::min(kTokensPerBlock, tokens - first);
      if (always_blocks || count >= kBlockTokens) {
        units.push_back({g, first, count, true});
      } else {
        for (int64_t n = first; n < first + count; ++n) units.push_back({g, n, 1, false});
      }
    }
  }
  return units;
}

RowRange Split(int64_t total, int64_t splits, int64_t split) {
  const int64_t size = CeilDiv(total, splits);
  return {std::min(total, split * size), std::min(total, (split + 1) * size)};
}

int64_t RowSplits(int64_t rows, int64_t units, int64_t workers) {
  return std::max<int64_t>(1, std::min(CeilDiv(4 * workers, std::max<int64_t>(units, 1)),
                                       CeilDiv(rows, kMinRowsPerTask)));
}

int64_t Tables(const Unit& unit) { return CeilDiv(unit.count, kTokenLanes); }

int64_t TableSize(int64_t width) { return (PaddedCols(width) + kDensePad) * kTokenLanes; }

int64_t TokenBufferSize(int64_t width, const Unit& unit) {
  return unit.block ? Tables(unit) * TableSize(width) : PaddedCols(width) + kRowsDotSlack;
}

void LoadTokens(const Unit& unit, const std::vector<int64_t>& rows, const DenseRows& dense,
                float* buffer) {
  std::fill(buffer, buffer + TokenBufferSize(dense.width, unit), 0.0f);
  for (int64_t t = 0; t < unit.count; ++t) {
    const int64_t row = rows[unit.first + t];
    if (unit.block) {
      float* table = buffer + (t / kTokenLanes) * TableSize(dense.width) + t % kTokenLanes;
      for (int64_t j = 0; j < dense.width; ++j) table[j * kTokenLanes] = dense.Get(row, j);
    } else if (dense.bf16) {
      for (int64_t j = 0; j < dense.width; ++j) buffer[j] = dense.Get(row, j);
    } else {
      std::memcpy(buffer, static_cast<const float*>(dense.data) + row * dense.width,
                  dense.width * sizeof(float));
    }
  }
}

Scratch& ThreadScratch() {
  thread_local Scratch scratch;
  return scratch;
}

RowDecoder::RowDecoder(const CompressedOperands& w, const RowKernels& kernels)
    : w_(w), kernels_(kernels) {
  Scratch& scratch = ThreadScratch();
  plus_index = Reserve(scratch.plus, w.padded_cols + kIndexSlack);
  minus_index = Reserve(scratch.minus, w.padded_cols + kIndexSlack);
}

bool RowDecoder::Decode(const WeightMatrix& matrix, int64_t r) {
  const int32_t begin = matrix.row_offsets[r];
  return kernels_.row_nonzeros(w_.dictionary, matrix.codes + begin,
                               matrix.row_offsets[r + 1] - begin, w_.padded_cols, plus_index,
                               &plus_count, minus_index, &minus_count);
}

void MatmulRows(const CompressedOperands& w, const RowKernels& kernels,
                const std::vector<TokenGroup>& groups, const Unit& unit, const float* tokens,
                RowRange rows, const DenseRows& y, FirstFailure& failure) {
  const TokenGroup& group = groups[unit.group];
  const WeightMatrix& matrix = group.matrix;
  Scratch& scratch = ThreadScratch();
  const auto row_min = [&](int64_t r) { return Bf16ToFloat(matrix.minmax[2 * r]); };
  const auto row_max = [&](int64_t r) { return Bf16ToFloat(matrix.minmax[2 * r + 1]); };
  if (!unit.block) {
    const int64_t count = rows.end - rows.begin;
    float* plus = Reserve(scratch.sums, 2 * count);
    float* minus = plus + count;
    const int64_t end = kernels.rows_dot(w.dictionary,
                                         {matrix.codes, matrix.row_offsets, rows.begin, rows.end},
                                         tokens, w.padded_cols, plus, minus);
    if (end < rows.end) failure.Record(unit.group * w.rows + end);
    for (int64_t r = rows.begin; r < end; ++r) {
      const int64_t i = r - rows.begin;
      y.Set(group.out_rows[unit.first], r, row_max(r) * plus[i] + row_min(r) * minus[i]);
    }
    return;
  }
  RowDecoder decoder(w, kernels);
  for (int64_t r = rows.begin; r < rows.end; ++r) {
    if (!decoder.Decode(matrix, r)) {
      failure.Record(unit.group * w.rows + r);
      return;
    }
    for (int64_t table = 0; table < Tables(unit); ++table) {
      const float* token_table = tokens + table * TableSize(w.cols);
      alignas(64) float plus[kTokenLanes];
      alignas(64) float minus[kTokenLanes];
      kernels.gather_token_rows(token_table, decoder.plus_index, decoder.plus_count, plus);
      kernels.gather_token_rows(token_table, decoder.minus_index, decoder.minus_count, minus);
      const int64_t first = table * kTokenLanes;
      for (int64_t t = first; t < std::min(unit.count, first + kTokenLanes); ++t) {
        y.Set(group.out_rows[unit.first + t], r,
              row_max(r) * plus[t - first] + row_min(r) * minus[t - first]);
      }
    }
  }
}

void TransposedRows(const CompressedOperands& w, const RowKernels& kernels,
                    const std::vector<TokenGroup>& groups, const Unit& unit, const float* gradient,
                    RowRange rows, float* sums, FirstFailure& failure) {
  const WeightMatrix& matrix = groups[unit.group].matrix;
  RowDecoder decoder(w, kernels);
  for (int64_t r = rows.begin; r < rows.end; ++r) {
    if (!decoder.Decode(matrix, r)) {
      failure.Record(unit.group * w.rows + r);
      return;
    }
    const float row_min = Bf16ToFloat(matrix.minmax[2 * r]);
    const float row_max = Bf16ToFloat(matrix.minmax[2 * r + 1]);
    for (int64_t table = 0; table < Tables(unit); ++table) {
      const float* g = gradient + table * TableSize(w.rows) + r * kTokenLanes;
      alignas(64) float plus[kTokenLanes];
      alignas(64) float minus[kTokenLanes];
      for (int64_t t = 0; t < kTokenLanes; ++t) {
        plus[t] = row_max * g[t];
        minus[t] = row_min * g[t];
      }
      float* table_sums = sums + table * TableSize(w.cols);
      kernels.scatter_token_rows(table_sums, decoder.plus_index, decoder.plus_count, plus);
      kernels.scatter_token_rows(table_sums, decoder.minus_index, decoder.minus_count, minus);
    }
  }
}

void RunMatmul(ffi::ThreadPool& pool, const CompressedOperands& w, const RowKernels& kernels,
               const std::vector<TokenGroup>& groups, const DenseRows& x, const DenseRows& y,
               FirstFailure& failure) {
  const std::vector<Unit> units = Units(groups, /*always_blocks=*/false);
  const int64_t unit_count = static_cast<int64_t>(units.size());
  const int64_t workers = Workers(pool);
  if (unit_count >= 2 * workers) {
    ParallelFor(pool, unit_count, [&](int64_t u) {
      float* buffer = Reserve(ThreadScratch().tokens, TokenBufferSize(w.cols, units[u]));
      LoadTokens(units[u], groups[units[u].group].in_rows, x, buffer);
      MatmulRows(w, kernels, groups, units[u], buffer, {0, w.rows}, y, failure);
    });
    return;
  }
  std::vector<std::vector<float>> buffers(unit_count);
  ParallelFor(pool, unit_count, [&](int64_t u) {
    buffers[u].resize(TokenBufferSize(w.cols, units[u]));
    LoadTokens(units[u], groups[units[u].group].in_rows, x, buffers[u].data());
  });
  const int64_t splits = RowSplits(w.rows, unit_count, workers);
  ParallelFor(pool, unit_count * splits, [&](int64_t task) {
    const int64_t u = task / splits;
    MatmulRows(w, kernels, groups, units[u], buffers[u].data(),
               Split(w.rows, splits, task % splits), y, failure);
  });
}

void RunTransposed(ffi::ThreadPool& pool, const CompressedOperands& w, const RowKernels& kernels,
                   const std::vector<TokenGroup>& groups, const DenseRows& g, const DenseRows& dx,
                   FirstFailure& failure) {
  const std::vector<Unit> units = Units(groups, /*always_blocks=*/true);
  const int64_t unit_count = static_cast<int64_t>(units.size());
  const int64_t workers = Workers(pool);
  // Writes dx for a unit's tokens, columns [columns.begin, columns.end), from partial sums.
  const auto store = [&](const Unit& unit, const float* const* parts, int64_t part_count,
                         RowRange columns) {
    const TokenGroup& group = groups[unit.group];
    for (int64_t t = 0; t < unit.count; ++t) {
      const int64_t lane = (t / kTokenLanes) * TableSize(w.cols) + t % kTokenLanes;
      for (int64_t j = columns.begin; j < columns.end; ++j) {
        float total = 0.0f;
        for (int64_t p = 0; p < part_count; ++p) total += parts[p][lane + j * kTokenLanes];
        dx.Set(group.out_rows[unit.first + t], j, total);
      }
    }
  };
  if (unit_count >= 2 * workers) {
    ParallelFor(pool, unit_count, [&](int64_t u) {
      Scratch& scratch = ThreadScratch();
      const int64_t sums_size = TokenBufferSize(w.cols, units[u]);
      float* gradient = Reserve(scratch.tokens, TokenBufferSize(w.rows, units[u]));
      float* sums = Reserve(scratch.sums, sums_size);
      LoadTokens(units[u], groups[units[u].group].in_rows, g, gradient);
      std::fill(sums, sums + sums_size, 0.0f);
      TransposedRows(w, kernels, groups, units[u], gradient, {0, w.rows}, sums, failure);
      store(units[u], &sums, 1, {0, w.cols});
    });
    return;
  }
  const int64_t splits = RowSplits(w.rows, unit_count, workers);
  std::vector<std::vector<float>> gradients(unit_count);
  std::vector<std::vector<float>> partial(unit_count * splits);
  ParallelFor(pool, unit_count, [&](int64_t u) {
    gradients[u].resize(TokenBufferSize(w.rows, units[u]));
    LoadTokens(units[u], groups[units[u].group].in_rows, g, gradients[u].data());
  });
  ParallelFor(pool, unit_count * splits, [&](int64_t task) {
    const int64_t u = task / splits;
    partial[task].assign(TokenBufferSize(w.cols, units[u]), 0.0f);
    TransposedRows(w, kernels, groups, units[u], gradients[u].data(),
                   Split(w.rows, splits, task % splits), partial[task].data(), failure);
  });
  if (failure.failed()) return;
  ParallelFor(pool, unit_count * splits, [&](int64_t task) {
    const int64_t u = task / splits;
    std::vector<const float*> parts(splits);
    for (int64_t p = 0; p < splits; ++p) parts[p] = partial[u * splits + p].data();
    store(units[u], parts.data(), splits, Split(w.cols, splits, task % splits));
  });
}

}  // namespace qmoe::cpu
