// The diagonal blocks of quant/linalg.py's blockwise Cholesky, on the CPU:
// the FFI target "qmoe_cholesky_base" (linalg.py calls it for each block and
// keeps the matmuls between blocks in XLA).
//
// Lingo as in quant/linalg.py: A[n, n] symmetric positive definite, L lower
// triangular with A = L·Lᵀ, L⁻¹ its inverse.
//
//   "qmoe_cholesky_base"
//       operands  matrix   f32[B..., n, n]  A; only its lower triangle is read
//       results   lower    f32[B..., n, n]  L (zero above the diagonal)
//                 inverse  f32[B..., n, n]  L⁻¹ (zero above the diagonal)
//
// One step per column j, as linalg.py's `_base_factor` (its jnp twin):
// column j of L from L's columns < j (left-looking), which completes row j
// of L, then row j of L⁻¹ from its rows < j (forward substitution). Where A
// is not positive definite, the first pivot that is not > 0 (or is NaN)
// becomes NaN, and so does L on and below the diagonal from that column on,
// and L⁻¹ from that row on: the same non-finite entries as the twin.
//
// Batch items run in parallel on XLA's intra-op threads (never waiting on a
// task that has not started). Every product and sum is rounded on its own
// (-ffp-contract=off), in a fixed order, so the AVX-512, AVX2 and portable
// builds return the same bits, and so does any batch an item comes in. The
// result differs from the twin only by the order of the float sums.
#pragma once

#include "xla/ffi/api/api.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(QmoeCholeskyBaseCpu);
