// The CUDA handlers of the qmoe_jax FFI targets, registered for platform
// "CUDA" when the extension is built with -DQMOE_CUDA=ON.
//
// They implement the contract of cpu_kernels.h ("qmoe_matmul",
// "qmoe_matmul_t", "qmoe_dequantize": same operands, attribute and results;
// the slots operand's shape is checked, its bytes unused) on the stream XLA
// passes in. CUDA specifics:
//   - Operand shapes are checked on the host and give INVALID_ARGUMENT as on
//     the CPU. The operands' bytes are on the device: whatever they hold, the
//     kernels stay in bounds, and a corrupt row turns what depends on it into
//     NaN (its y entries; all of dx for its tokens; its row of W). The CPU's
//     errors naming the row come with QMOE_CUDA_VALIDATE=1, at the cost of a
//     stream synchronization per call (cuda_validate.h explains the choice).
//   - Tokens in use (counts): the counts are read on the device, so the
//     kernels skip the entries without tokens in use themselves (no host
//     round trip; cuda_tokens.cuh). QMOE_CUDA_VALIDATE=1 checks every matrix
//     of the call, in use or not (stricter than the CPU handlers, which
//     validate only the matrices they read).
//   - Sums accumulate in float32; bf16 results are rounded to nearest even.
//     qmoe_matmul_t adds with atomics, in an order that varies between runs.
//   - qmoe_matmul and qmoe_dequantize are command-buffer compatible (XLA may
//     capture them into CUDA graphs). qmoe_matmul_t is not: for bf16 results
//     it allocates float32 scratch sums.
//   - Launch failures come back as INTERNAL errors naming the CUDA error.
// Kernel design: cuda_decode.cuh; launch heuristics: cuda_launch.h.
#pragma once

#include "xla/ffi/api/api.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(QmoeMatmulCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(QmoeMatmulTransposedCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(QmoeDequantizeCuda);
