// The XLA FFI contract of the qmoe_jax kernels, and the CPU handlers.
//
// Targets (platform "cpu" here; CUDA handlers implement the same contract):
//
//   "qmoe_matmul"      y[..., n, r]  = sum_j W[r, j] * x[..., n, j]   for n < counts[...], else 0
//       operands  masks, slots, words, codes, row_offsets, minmax, x f32|bf16[B..., N, cols],
//                 counts i32[B...]
//       result    y [B..., N, rows], dtype of x
//   "qmoe_matmul_t"    dx[..., n, j] = sum_r W[r, j] * g[..., n, r]   for n < counts[...], else 0
//       operands  masks, slots, words, codes, row_offsets, minmax, g f32|bf16[B..., N, rows],
//                 counts i32[B...]                                    (input gradient)
//       result    dx [B..., N, cols], dtype of g; cols comes from dx's shape
//   "qmoe_dequantize"  w[..., r, j] = W[r, j]
//       operands  masks, slots, words, codes, row_offsets, minmax
//       attribute cols (int64)
//       result    w bf16[B..., rows, cols]
//
// Operands shared by all targets, in this order (format v1, qmoe_format.h):
//   masks        u32[65536, 2]       Dictionary.masks (plus mask | pair count << 28, minus mask)
//   slots        u8[65536, 16]       the sparse form of the same dictionary (qmoe_format.h);
//                                    the AVX-512 kernels read it, a CUDA kernel may ignore it
//   words        u32[65536]          the compact form of the same dictionary (qmoe_format.h);
//                                    the AVX2 and portable kernels read it, CUDA ignores it
//   codes        u16[B..., n_codes]  each matrix's code stream; codes past
//                                    row_offsets[-1] are padding and ignored
//   row_offsets  i32[B..., rows + 1] row r owns codes[row_offsets[r] : row_offsets[r + 1]]
//   minmax       bf16[B..., rows, 2] (min_r, max_r): code 1 means min_r, 2 means max_r
//
// B... are the leading batch dims (an expert stack, vmapped axes; possibly
// none): the result's leading dims. Each operand has as many leading dims,
// each equal to the result's or 1 (broadcast, as jax's vmap_method
// "expand_dims" produces); the dictionary forms may carry leading 1s too. A
// matrix shared by several batch entries is decoded once for all their
// tokens. Sums accumulate in f32; bf16 results are rounded to nearest even.
//
// Tokens in use (matmul and matmul_t): counts[b] says how many tokens of
// batch entry b, the first ones along N, are computed (routing fills an
// expert's slots from the front). Counts are clamped to [0, N]: a count
// above N (tokens dropped at capacity) computes all N, a negative one none.
// The result rows of the other tokens are zeros and their x (g) rows are
// not read; an entry with no token in use reads nothing of its matrix, so
// its codes are not decoded and its row_offsets not validated. The work of
// a call is proportional to the tokens in use, not to B... x N.
//
// Handlers validate everything they read before use and return
// INVALID_ARGUMENT with a message naming the operand, batch index and row:
// operand shapes; row_offsets start at 0, never decrease and end within
// codes; each row decodes to exactly 2 * ceil(cols / 2) weights. Whatever
// bytes they get, they never read or write out of bounds.
//
// CPU specifics: the handlers run on XLA's intra-op thread pool and pick
// AVX-512, AVX2 or portable code at run time; the environment variable
// QMOE_CPU_ISA=avx512|avx2|portable forces one (for tests and benchmarks).
//
// GPTQ's block kernel, "qmoe_gptq_block", and the Cholesky's diagonal-block kernel,
// "qmoe_cholesky_base", have their own contracts in cpu_gptq.h and cpu_cholesky.h.
#pragma once

#include <pybind11/pybind11.h>

#include "xla/ffi/api/api.h"

namespace qmoe::cpu {

// Adds to the extension module: cpu_isas() -> instruction sets this CPU
// runs, fastest first. (module.cc registers the handlers below.)
void RegisterCpuKernels(pybind11::module_& module);

}  // namespace qmoe::cpu

XLA_FFI_DECLARE_HANDLER_SYMBOL(QmoeMatmulCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(QmoeMatmulTransposedCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(QmoeDequantizeCpu);
