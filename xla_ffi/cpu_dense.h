// Products with dense weights stored in fewer bytes than float32, on the CPU:
// the FFI target "qmoe_dense_matmul" (kernels/dense.py calls it for the
// non-expert kernels and the embedding of a model loaded with
// --dense_dtype bfloat16 or int8).
//
//   "qmoe_dense_matmul"   y[n, r] = scale[r] * sum_j W[r, j] * x[n, j]
//       operands  x       f32[N, cols]
//                 w       bf16|s8[rows, cols]   one output channel per row
//                 scales  f32[rows] (int8 weights: each row's scale)
//                         or f32[0] (bfloat16 weights: no scale)
//       result    y       f32[N, rows]
//
// The weights are converted to float32 in registers, never in memory, so a
// product reads each stored byte once: 2 (bfloat16) or 1 (int8) byte per
// weight against float32's 4, which is what a memory-bound decoding step
// costs. Sums accumulate in float32 with fused multiply-adds, the rows of a
// block of tokens sharing each load of x.
//
// Rows and tokens are split into blocks over XLA's intra-op thread pool. The
// AVX2 code runs where the CPU has AVX2 and FMA, unless QMOE_CPU_ISA=portable
// asks for the portable code (the same operation; the float sums may round
// differently).
#pragma once

#include "xla/ffi/api/api.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(QmoeDenseMatmulCpu);
