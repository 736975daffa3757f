// The XLA FFI contract of the routed products, and their CPU handlers.
//
//   "qmoe_matmul_routed"    y[n, r]  = sum_j W_e[r, j] * x[n, j],  e = expert_index[n]
//       operands  masks, slots, words, codes, row_offsets, minmax (an expert stack, leading
//                 dims [E]), x f32|bf16[N, cols], expert_index i32[N]
//       result    y [N, rows], dtype of x
//   "qmoe_matmul_routed_t"  dx[n, j] = sum_r W_e[r, j] * g[n, r],  e = expert_index[n]
//       operands  the same stack, g f32|bf16[N, rows], expert_index i32[N]   (input gradient)
//       result    dx [N, cols], dtype of g; cols comes from dx's shape
//
// Each token names its own expert; a token whose index is outside [0, E) (a token dropped at
// capacity) gets a zero row and its x (g) row is not read. The tokens of one expert are
// computed together, as the tokens of one matrix of "qmoe_matmul" are: the expert is decoded
// once for all of them, and an expert no token names is not read (its codes not decoded, its
// row_offsets not validated). The work of a call follows its N tokens and the experts they
// name, and it needs no [E, slots, cols] buffer: what a sparse layer's dispatch would fill.
//
// The compressed operands, the validation, the errors and the instruction-set choice are those
// of "qmoe_matmul" (cpu_kernels.h), with B... = [E] taken from minmax.
#pragma once

#include "xla/ffi/api/api.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(QmoeMatmulRoutedCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(QmoeMatmulRoutedTransposedCpu);
