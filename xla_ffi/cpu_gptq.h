// GPTQ's column recurrence inside one block of columns, on the CPU: the FFI
// target "qmoe_gptq_block" (quant/gptq.py calls it for each 128-column block
// and keeps the lazy updates between blocks, matmuls, in XLA).
//
// Lingo as in quant/gptq.py: W[rows, cols] in y = W·x orientation; the block
// has m columns; S_jk = R_jk / R_kk and R_kk from the reversed Cholesky
// factor of H (H = R·Rᵀ); D = W − Q the residuals.
//
//   "qmoe_gptq_block"
//       operands  weights        f32[B..., rows, m]  the block's columns of W
//                 corrections    f32[B..., rows, m]  Σ_{j before the block} D_j·S_jk per column k
//                 scaled         f32[B..., m, m]     S on the block; only j < k is read
//                 factor_diag    f32[B..., m]        R_kk
//                 params         f32[B..., rows, 2]  each row's grid: ternary (min, max),
//                                                    minmax (scale, zero)
//       attribute levels (int64)  3: the ternary grid {min, 0, max}; else a minmax grid of
//                                 `levels` codes (4 ... 256)
//       results   residuals      f32[B..., rows, m]  D = w − q
//                 codes          u8[B..., rows, m]   grid codes (ternary: 0 zero, 1 min, 2 max)
//                 squared_errors f32[B..., rows]     Σ_k ((w̃_k − q_k)·R_kk)² per row
//
// For each row, columns k = 0 … m−1 in order: the target w̃_k = w_k + c_k is
// rounded to the row's grid (quant/grids.py's `quantize`, tie rules
// included), and its residual D_k = w_k − q_k is added to the corrections of
// the later columns, c_j += D_k·S_kj (right-looking, kept per row in L1).
// All operands carry the same leading dims B... (jax's vmap_method
// "broadcast_all"). Rows are independent, so they are split across XLA's
// intra-op threads.
//
// Every product and sum is rounded on its own (this file is compiled with
// -ffp-contract=off, and each row's arithmetic is elementwise), so the
// AVX-512, AVX2 and portable builds return the same bits, and so does any
// batch an item comes in. The result differs from the jnp sweep
// (quant/gptq.py) only by the order of the float sums.
#pragma once

#include "xla/ffi/api/api.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(QmoeGptqBlockCpu);
