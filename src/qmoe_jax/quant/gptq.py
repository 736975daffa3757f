"""GPTQ for one matrix (Frantar et al. 2022), as QMoE §3 uses it.

Lingo: W[rows, cols] in y = W·x orientation; H[cols, cols] = XᵀX of the
matrix's calibration inputs (see hessian.py); damping λ = 0.1 × mean diag(H)
is added to diag(H). GPTQ's hinv is U, the upper Cholesky factor of H⁻¹
(UᵀU = H⁻¹). Columns are quantized left to right in blocks of B = 128: inside
a block, each column is rounded to its row's grid and its error is fed to the
block's later columns; after a block, one rank-B "lazy" update carries the
block's errors to all later columns. Dead columns (H_ii = 0: the input is
always zero) get H_ii = 1 and W[:, i] = 0, as in GPTQ. Act-order (an option,
off by default) quantizes columns by descending diag(H).

We run the same recurrence without inverting H. With R upper triangular and
H = R·Rᵀ (the Cholesky factor of H with rows and columns reversed), U = R⁻¹.
GPTQ's errors E (column k: (w̃_k − q_k)/U_kk, w̃_k the updated column when it
is rounded) satisfy W − Q = E·U, so E = (W − Q)·R and

    w̃_k = w_k + Σ_{j<k} (w_j − q_j)·S_jk,   S_jk = R_jk / R_kk,

which is what ``_sweep`` computes, blockwise: one Cholesky instead of GPTQ's
Cholesky, inverse and second Cholesky, and the same lazy block updates with
S and the residuals D = W − Q in place of U and E. Blocks nest (B = 128, then
sub-blocks of 16, then single columns) so the per-column work stays in cache;
the result does not depend on the block sizes beyond float rounding. The
block levels push their corrections forward (right-looking: after a block,
one matmul adds its residuals' share to the later columns); the column level
pulls them (left-looking): column k of a sub-block reads the residuals of the
sub-block's earlier columns in one product S[:, k]ᵀ·D_sub (the rows of D_sub
from k on are still zero), so each step writes one row of residuals instead
of updating the whole sub-block's corrections (about 20% faster on CPU).

The outer blocks run unrolled by default (``GPTQConfig.unroll_blocks``): each
block's lazy update is one matmul onto the later columns only, S[block, later]ᵀ·D,
about half the FLOPs of a ``fori_loop`` over blocks, whose fixed shapes make
every update span all n columns (the entries for earlier columns are products
with S's zeros below the diagonal, and the block's own columns are never read
again). With ``GPTQConfig.super_blocks = 1``, every correction a later column
reads is the same sum of the same products in the same order either way, and
XLA's matmul rounds an output element alike whatever the output's width, so
the codes are bit-identical (a test checks it, also vmapped); the unrolled
program compiles slower (one copy of the inner loops per block).

By default the unrolled sweep adds one more level above the blocks: every 4
blocks form a super-block, a block's update reaches only the rest of its
super-block, and one update per super-block (a matmul over 512 rows instead
of 128) carries its residuals to all later columns, so the later columns'
corrections are read and written a quarter as often. That groups the sums
differently: codes differ by float rounding only (99.9994-100% of them equal
on switch-base shapes, benchmarks/gptq_rate.py).

On CPU, the levels inside each outer block run in a native kernel instead
(``GPTQConfig.native_block``, the FFI target ``qmoe_gptq_block``,
xla_ffi/cpu_gptq.h): per row, columns in order, each residual pushed to the
block's later columns at once (right-looking), rows split across threads.
XLA:CPU's per-column loops cost more than their arithmetic; the kernel has
none. Its float sums come in another order than the jnp levels' (its twin,
which other platforms run), so codes differ by rounding only; its own
results are the same on every instruction set and in every batch.

Failures are data: when H is not positive definite after damping (or no
column is live), ``ok`` is False and the matrix is rounded to nearest (R =
identity, the original weights), never an exception.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from qmoe_jax.quant.grids import GridConfig, grid_params, quantize
from qmoe_jax.quant.linalg import exact_product, native_on_cpu, pairwise_sum, reversed_cholesky

_HIGHEST = lax.Precision.HIGHEST


@dataclasses.dataclass(frozen=True)
class GPTQConfig:
    """Options of the GPTQ solver.

    Attributes:
      block_size: columns per lazy-update block (GPTQ and QMoE use 128).
      damping: λ = damping × mean diag(H) is added to diag(H) (QMoE uses 0.1).
      act_order: quantize columns by descending diag(H) (codes come back in the original order).
      sub_block_size: a second lazy-update level inside each block, for speed only; must divide
        block_size (1 or block_size: none).
      unroll_blocks: run the outer blocks unrolled, each lazy update onto the later columns only (about
        half the update FLOPs, same codes, slower compile); False: one ``fori_loop`` over blocks.
      native_block: on CPU, the columns inside each block run in the native kernel (xla_ffi/cpu_gptq.h:
        rows in parallel, each row's corrections in L1; sub_block_size is then unused); False, and on
        other platforms: the jnp levels. The two differ only by the order of float sums.
      native_cholesky: on CPU, the diagonal blocks of H's Cholesky run in the native kernel
        (xla_ffi/cpu_cholesky.h); False, and on other platforms: linalg.py's jnp loop. The two differ
        only by the order of float sums.
      super_blocks: with ``unroll_blocks``, a lazy-update level above the blocks: every ``super_blocks``
        consecutive blocks form a super-block; each block's update reaches only the later columns of its
        super-block, and one update per super-block carries its errors to all later columns (a matmul
        over super_blocks × block_size rows instead of block_size, and that many times fewer passes over
        the later columns' corrections). For speed only: codes differ from super_blocks = 1 (no extra
        level) by float rounding.
    """

    block_size: int = 128
    damping: float = 0.1
    act_order: bool = False
    sub_block_size: int = 16
    unroll_blocks: bool = True
    native_block: bool = True
    native_cholesky: bool = True
    super_blocks: int = 4

    def __post_init__(self):
        if not (isinstance(self.block_size, int) and self.block_size > 0):
            raise ValueError(f"GPTQConfig.block_size must be a positive int, got {self.block_size!r}")
        if not (isinstance(self.sub_block_size, int) and self.sub_block_size > 0
                and self.block_size % self.sub_block_size == 0):
            raise ValueError(f"GPTQConfig.sub_block_size must divide block_size={self.block_size}, "
                             f"got {self.sub_block_size!r}")
        if not (isinstance(self.super_blocks, int) and self.super_blocks > 0):
            raise ValueError(f"GPTQConfig.super_blocks must be a positive int (blocks per super-block), "
                             f"got {self.super_blocks!r}")
        if not self.damping > 0:
            raise ValueError(f"GPTQConfig.damping must be > 0 (relative to mean diag(H)), got {self.damping!r}")

    @property
    def block_sizes(self) -> tuple[int, ...]:
        """Nested block sizes of the sweep, outermost first, ending at single columns."""
        return tuple(dict.fromkeys((self.block_size, self.sub_block_size, 1)))


class GPTQResult(NamedTuple):
    """Output of ``gptq`` for one matrix W[rows, cols] (batched: a leading E axis on every field).

    Attributes:
      codes: uint8[rows, cols], grid codes (ternary: 0 = zero, 1 = min, 2 = max).
      grid_params: [rows, 2] per-row grid (bfloat16 (min, max) for ternary, float32 (scale, zero) for minmax).
      ok: bool[], False when the Hessian was unusable and the matrix was rounded to nearest.
      loss: float32[], GPTQ's proxy loss Σ (w̃ − q)² / (2 U_kk²) over all weights (H's scale).
    """

    codes: jax.Array
    grid_params: jax.Array
    ok: jax.Array
    loss: jax.Array


def hessian_factor(hessian: jax.Array, native: bool = True, diagonal: jax.Array | None = None) -> jax.Array:
    """R, upper triangular with H = R·Rᵀ, for a positive definite H[n, n] (non-finite entries if it is not).

    U = R⁻¹ is GPTQ's hinv (UᵀU = H⁻¹); the sweep uses R itself. The Cholesky is linalg.py's, in plain lax
    and (with ``native``, on CPU) its native kernel for the diagonal blocks: jaxlib's batched LAPACK kernels
    can deadlock when several host devices run them at once. ``diagonal`` (float[n], optional): H's diagonal
    in place of the one ``hessian`` holds (the damped one), without copying H.
    """
    return reversed_cholesky(hessian, native=native, diagonal=diagonal)


def _columns(weights_t, corrections_t, scaled, factor_diag, params, grid: GridConfig):
    """The column level of ``_sweep`` on a sub-block Wᵀ[m, rows]: columns one by one, each target
    w_k + c_k + Σ_{j<k} D_j·S_jk read as one product with the residuals so far (left-looking)."""

    def quantize_column(k, state):
        residuals_t, codes_t, squared_errors = state
        weights_k = lax.dynamic_index_in_dim(weights_t, k, keepdims=False)
        earlier = jnp.matmul(lax.dynamic_index_in_dim(scaled, k, axis=1, keepdims=False), residuals_t,
                             precision=_HIGHEST)  # S[:, k]ᵀ·D: rows of D from k on are still zero
        target = weights_k + lax.dynamic_index_in_dim(corrections_t, k, keepdims=False) + earlier
        dequantized, codes = quantize(target, params, grid)
        error = (target - dequantized) * factor_diag[k]
        residuals_t = lax.dynamic_update_index_in_dim(residuals_t, weights_k - dequantized, k, 0)
        codes_t = lax.dynamic_update_index_in_dim(codes_t, codes, k, 0)
        return residuals_t, codes_t, squared_errors + error * error

    state = (jnp.zeros_like(weights_t), jnp.zeros_like(weights_t, dtype=jnp.uint8), jnp.zeros_like(weights_t[0]))
    return lax.fori_loop(0, weights_t.shape[0], quantize_column, state)


def _block_levels(weights_t, corrections_t, scaled, factor_diag, params, grid: GridConfig,
                  inner_sizes: tuple[int, ...], native: bool):
    """``_sweep`` inside one outer block (``inner_sizes`` its levels): with ``native``, the CPU kernel
    (``_kernels.gptq_block_call``) where the program runs on CPU and the jnp levels elsewhere; else the jnp levels."""

    def jnp_levels(*operands):
        return _sweep(*operands, grid, inner_sizes)

    operands = (weights_t, corrections_t, scaled, factor_diag, params)
    if not native:
        return jnp_levels(*operands)
    return native_on_cpu("gptq_block_call", jnp_levels, *operands, levels=grid.levels)


def _sweep(weights_t, corrections_t, scaled, factor_diag, params, grid: GridConfig, block_sizes: tuple[int, ...],
           native: bool = False):
    """Quantize the columns of Wᵀ[n, rows] in order, in nested blocks of ``block_sizes`` (n divisible by the first;
    the last is 1, the column level); with ``native``, each outer block's inner levels as ``_block_levels`` runs them.

    ``corrections_t`` holds Σ_{j<k} D_j·S_jk from columns before this block; returns
    (residuals D = w − q [n, rows], codes uint8[n, rows], squared errors summed per row [rows]: twice the
    proxy loss of each row, which the caller sums in a fixed order).
    """
    if block_sizes == (1,):
        return _columns(weights_t, corrections_t, scaled, factor_diag, params, grid)
    size, inner_sizes = block_sizes[0], block_sizes[1:]

    def quantize_block(b, state):
        corrections_t, residuals_t, codes_t, squared_errors = state
        start = b * size
        rows_of = functools.partial(lax.dynamic_slice_in_dim, start_index=start, slice_size=size, axis=0)
        block_scaled = lax.dynamic_slice(scaled, (start, start), (size, size))
        block_residuals, block_codes, block_squared_errors = _block_levels(
            rows_of(weights_t), rows_of(corrections_t), block_scaled, rows_of(factor_diag), params, grid, inner_sizes,
            native)
        corrections_t = corrections_t + jnp.matmul(rows_of(scaled).T, block_residuals, precision=_HIGHEST)
        residuals_t = lax.dynamic_update_slice_in_dim(residuals_t, block_residuals, start, 0)
        codes_t = lax.dynamic_update_slice_in_dim(codes_t, block_codes, start, 0)
        return corrections_t, residuals_t, codes_t, squared_errors + block_squared_errors

    state = (corrections_t, jnp.zeros_like(weights_t), jnp.zeros_like(weights_t, dtype=jnp.uint8),
             jnp.zeros_like(weights_t[0]))
    _, residuals_t, codes_t, squared_errors = lax.fori_loop(0, weights_t.shape[0] // size, quantize_block, state)
    return residuals_t, codes_t, squared_errors


def _push_forward(corrections_t, scaled, residuals, start: int, stop: int, later: int, end: int):
    """A lazy update from columns start:stop onto columns later:end: S[start:stop, later:end]ᵀ·D[start:stop] added to
    their corrections."""
    update = jnp.matmul(scaled[start:stop, later:end].T, residuals, precision=_HIGHEST)
    return corrections_t.at[later:end].add(update)


def unrolled_updates(cols: int, size: int, super_blocks: int):
    """The unrolled sweep's plan: per block of ``size`` columns, (start, stop, updates), where updates are the lazy
    updates (start, stop, later, end) due once that block is quantized: its own onto the rest of its super-block, and
    after a super-block's last block the super-block's onto all later columns."""
    span = size * super_blocks
    for first in range(0, cols, span):
        last = min(first + span, cols)
        for start in range(first, last, size):
            stop = start + size
            updates = [(start, stop, stop, last)] if stop < last else []
            if stop == last < cols:
                updates.append((first, last, last, cols))
            yield start, stop, updates


def _sweep_unrolled(weights_t, scaled, factor_diag, params, grid: GridConfig, block_sizes: tuple[int, ...],
                    super_blocks: int, native: bool = False):
    """``_sweep`` from zero corrections with its outer block loop unrolled (static shapes per block) and one more
    level above it: every ``super_blocks`` blocks form a super-block. Block b's lazy update S[b, later]ᵀ·D_b reaches
    the later columns of its super-block only; after a super-block, S[super, later]ᵀ·D_super carries its residuals
    to all later columns in one matmul (``unrolled_updates``). The inner levels are ``_block_levels``'."""
    size, inner_sizes = block_sizes[0], block_sizes[1:] or (1,)  # block_size 1: each block is one column
    corrections_t = jnp.zeros_like(weights_t)
    residuals, codes, squared_errors = [], [], jnp.zeros_like(weights_t[0])
    for start, stop, updates in unrolled_updates(weights_t.shape[0], size, super_blocks):
        block_residuals, block_codes, block_squared_errors = _block_levels(
            weights_t[start:stop], corrections_t[start:stop], scaled[start:stop, start:stop], factor_diag[start:stop],
            params, grid, inner_sizes, native)
        residuals.append(block_residuals)
        codes.append(block_codes)
        squared_errors = squared_errors + block_squared_errors
        for first, last, later, end in updates:
            corrections_t = _push_forward(corrections_t, scaled, jnp.concatenate(residuals[first // size:last // size]),
                                          first, last, later, end)
    return jnp.concatenate(residuals), jnp.concatenate(codes), squared_errors


def gptq(weights: jax.Array, hessian: jax.Array, grid: GridConfig, config: GPTQConfig = GPTQConfig()) -> GPTQResult:
    """Quantize one matrix with GPTQ.

    Args:
      weights: float[rows, cols], y = W·x orientation (transpose T5X's x·K kernels first: W = K.T).
      hessian: float32[cols, cols], H = XᵀX of the matrix's inputs (any positive scale).
      grid: the per-row grid (its parameters come from the original weights).
      config: block size, damping, act-order.

    Returns:
      GPTQResult(codes uint8[rows, cols], grid_params [rows, 2], ok bool[], loss float32[]).
      ``dequantize_codes(codes, grid_params, grid)`` is GPTQ's quantized W.
    """
    if jnp.ndim(weights) != 2 or jnp.shape(hessian) != (weights.shape[1],) * 2:
        raise ValueError(f"gptq expects weights [rows, cols] and hessian [cols, cols]; got {jnp.shape(weights)} and "
                         f"{jnp.shape(hessian)} (T5X kernels are x·K: pass W = K.T)")
    cols = jnp.shape(weights)[1]
    weights = jnp.asarray(weights, jnp.float32)
    hessian = jnp.asarray(hessian, jnp.float32)
    params = grid_params(weights, grid)

    diag = jnp.diagonal(hessian)
    dead = diag == 0
    diag = jnp.where(dead, 1.0, diag)
    # λ = damping × mean diag(H), to 12 significant bits: exact, so it adds alike in every program (linalg.py)
    damping_term = exact_product(jnp.float32(config.damping / cols), pairwise_sum(diag))
    damped = diag + damping_term  # H's diagonal, given to the Cholesky (no copy of H with it written in)
    if config.act_order:
        order = jnp.argsort(-diag)
        hessian, damped, weights, dead = hessian[order][:, order], damped[order], weights[:, order], dead[order]
    factor = hessian_factor(hessian, config.native_cholesky, diagonal=damped)
    # A non-finite entry anywhere in R reaches its row's pivot (R_ii² = H_ii − Σ_j>i R_ij²), and a failing
    # pivot makes every column before it NaN (linalg.py): checking the diagonal is checking R, at 1/n the reads.
    ok = jnp.isfinite(jnp.diagonal(factor)).all() & ~dead.all()
    weights = jnp.where(ok & dead[None, :], 0.0, weights)

    padding = -cols % config.block_size
    if padding:  # padded columns: R = identity there (no pass over a full-size matrix when there are none)
        padded = jnp.arange(cols, cols + padding)
        factor = jnp.pad(factor, ((0, padding), (0, padding))).at[padded, padded].set(1.0)
    # Where not ok, R = identity (the original weights, rounded to nearest). Selected elementwise inside S, so
    # that XLA fuses it into the slices the sweep reads instead of writing a selected copy of R.
    factor_diag = jnp.where(ok, jnp.diagonal(factor), 1.0)
    identity = jnp.eye(cols + padding, dtype=jnp.float32)
    scaled = jnp.where(ok, factor * (1 / factor_diag)[None, :], identity)  # S = R_jk / R_kk (batch-invariant)
    weights_t = jnp.pad(weights.T, ((0, padding), (0, 0))) if padding else weights.T
    if config.unroll_blocks:
        _, codes_t, squared_errors = _sweep_unrolled(weights_t, scaled, factor_diag, params, grid, config.block_sizes,
                                                     config.super_blocks, config.native_block)
    else:
        _, codes_t, squared_errors = _sweep(weights_t, jnp.zeros_like(weights_t), scaled, factor_diag, params, grid,
                                            config.block_sizes, config.native_block)
    codes = codes_t[:cols].T
    if config.act_order:
        codes = codes[:, jnp.argsort(order)]
    return GPTQResult(codes, params, ok, 0.5 * pairwise_sum(squared_errors))
