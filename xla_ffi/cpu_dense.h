// Dense products on the CPU for a decoding step: the FFI targets
// "qmoe_dense_matmul" (kernels/dense.py calls it for the packed non-expert
// kernels and the embedding of a model loaded with --dense_dtype bfloat16 or
// int8, and for an unpacked float32 embedding's logits) and
// "qmoe_dense_matmul_t" (for unpacked float32 T5X kernels [in, out]).
//
//   "qmoe_dense_matmul"   y[n, r] = scale[r] * sum_j W[r, j] * x[n, j]
//       operands  x       f32[N, cols]
//                 w       f32|bf16|s8[rows, cols]   one output channel per row
//                 scales  f32[rows] (int8 weights: each row's scale)
//                         or f32[0] (float32 or bfloat16 weights: no scale)
//       result    y       f32[N, rows]
//
//   "qmoe_dense_matmul_t" y[n, c] = sum_i x[n, i] * K[i, c]
//       operands  x       f32[N, in]
//                 k       f32[in, out]   a T5X kernel: one output channel per column
//       result    y       f32[N, out]
//
// Weights stored in fewer bytes are converted to float32 in registers, never
// in memory, so a product reads each stored byte once: 2 (bfloat16) or 1
// (int8) byte per weight against float32's 4, which is what a memory-bound
// decoding step costs. Sums accumulate in float32 with fused multiply-adds.
// Both targets read their weights as a few long streams at once, which the
// hardware prefetchers follow (docs/dense_forms.md): "qmoe_dense_matmul" the
// rows of W, "qmoe_dense_matmul_t" the rows of K, each adding its token
// values times a row of K into sums of the output channels held in the L1.
// "qmoe_dense_matmul_t" is for few tokens: it reads K once per 8 tokens.
//
// Work is split over XLA's intra-op thread pool. The AVX2 code runs where the
// CPU has AVX2 and FMA, unless QMOE_CPU_ISA=portable asks for the portable
// code (the same operation; the float sums may round differently).
#pragma once

#include "xla/ffi/api/api.h"
#include "xla/ffi/api/ffi.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(QmoeDenseMatmulCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(QmoeDenseMatmulTransposedCpu);

namespace qmoe::cpu {

bool CpuHasAvx2Fma();

// Sets *avx2 for the dense products: the AVX2 code unless QMOE_CPU_ISA=portable or the CPU
// lacks AVX2 and FMA; an error names `op` when QMOE_CPU_ISA asks for what the CPU lacks or is
// not a known value.
xla::ffi::Error SelectDenseIsa(const char* op, bool* avx2);

}  // namespace qmoe::cpu
