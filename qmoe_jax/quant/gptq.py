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

which is what the sweep computes, blockwise: one Cholesky instead of GPTQ's
Cholesky, inverse and second Cholesky, and the same lazy block updates with
S and the residuals D = W − Q in place of U and E. Blocks nest (B = 128, then
sub-blocks of 16, then single columns) so the per-column work stays in cache;
the result does not depend on the block sizes beyond float rounding. Inside
a block, the sub-block level pushes its corrections forward (right-looking:
after a sub-block, one matmul adds its residuals' share to the block's later
columns); the column level pulls them (left-looking): column k of a
sub-block reads the residuals of the sub-block's earlier columns in one
product D_sub·S[:, k] (the columns of D_sub from k on are still zero), so
each step writes one column of residuals instead of updating the whole
sub-block's corrections, which is faster on CPU.

Everything runs on W[rows, cols] as it is: a block's columns are W[:, s:e],
and every matmul has its contracted axis where XLA:CPU's matmul wants it
(the minor one of its left operand, the major one of its right), so no
operand is transposed on the way. The outer blocks run unrolled by default
(``GPTQConfig.unroll_blocks``) and left-looking: block s:e first takes all
earlier blocks' share in one matmul, D[:, :s]·S[:s, s:e], whose long inner
dimension (s) suits the matmul better than one thin update per block, and
which writes each block's corrections once instead of adding into all later
columns after every block. Total FLOPs are rows·cols², half those of a
``fori_loop`` over blocks (``unroll_blocks=False``, right-looking: its fixed
shapes make every update span all n columns; the entries for earlier
columns are products with S's zeros below the diagonal). The two group the
sums differently, so codes differ by float rounding only (tests check it);
with exact sums they agree bit for bit. The unrolled program compiles
slower (one copy of the inner loops per block).

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
import math
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
      unroll_blocks: run the outer blocks unrolled and left-looking, each block's corrections from
        all earlier blocks in one matmul (half the update FLOPs of the fori_loop, slower compile);
        False: one ``fori_loop`` over blocks, right-looking. The two differ only by the order of
        float sums.
      native_block: on CPU, the columns inside each block run in the native kernel
        (xla_ffi/cpu_gptq.h: rows in parallel, each row's corrections in L1; sub_block_size is then
        unused); False, and on other platforms: the jnp levels. The two differ only by the order of
        float sums.
      native_cholesky: on CPU, the diagonal blocks of H's Cholesky run in the native kernel
        (xla_ffi/cpu_cholesky.h); False, and on other platforms: linalg.py's jnp loop. The two
        differ only by the order of float sums.
    """

    block_size: int = 128
    damping: float = 0.1
    act_order: bool = False
    sub_block_size: int = 16
    unroll_blocks: bool = True
    native_block: bool = True
    native_cholesky: bool = True

    def __post_init__(self):
        if not (isinstance(self.block_size, int) and self.block_size > 0):
            raise ValueError(
                f"GPTQConfig.block_size must be a positive int, got {self.block_size!r}"
            )
        if not (
            isinstance(self.sub_block_size, int)
            and self.sub_block_size > 0
            and self.block_size % self.sub_block_size == 0
        ):
            raise ValueError(
                f"GPTQConfig.sub_block_size must divide block_size={self.block_size}, "
                f"got {self.sub_block_size!r}"
            )
        if not 0 < self.damping < math.inf:
            raise ValueError(
                "GPTQConfig.damping must be > 0 and finite (relative to mean diag(H)), got "
                f"{self.damping!r}"
            )

    @property
    def block_sizes(self) -> tuple[int, ...]:
        """Nested block sizes of the sweep, outermost first, ending at single columns."""
        return tuple(dict.fromkeys((self.block_size, self.sub_block_size, 1)))


class GPTQResult(NamedTuple):
    """Output of ``gptq`` for one matrix W[rows, cols] (batched: a leading E axis on every field).

    Attributes:
      codes: uint8[rows, cols], grid codes (ternary: 0 = zero, 1 = min, 2 = max).
      grid_params: [rows, 2] per-row grid (bfloat16 (min, max) for ternary, float32 (scale, zero)
        for minmax).
      ok: bool[], False when the Hessian was unusable and the matrix was rounded to nearest.
      loss: float32[], GPTQ's proxy loss Σ (w̃ − q)² / (2 U_kk²) over all weights (H's scale).
    """

    codes: jax.Array
    grid_params: jax.Array
    ok: jax.Array
    loss: jax.Array


def hessian_factor(
    hessian: jax.Array, native: bool = True, diagonal: jax.Array | None = None
) -> jax.Array:
    """R, upper triangular with H = R·Rᵀ, for a positive definite H[n, n] (non-finite entries if it
    is not).

    U = R⁻¹ is GPTQ's hinv (UᵀU = H⁻¹); the sweep uses R itself. The Cholesky is linalg.py's, in
    plain lax and (with ``native``, on CPU) its native kernel for the diagonal blocks: jaxlib's
    batched LAPACK kernels can deadlock when several host devices run them at once. ``diagonal``
    (float[n], optional): H's diagonal in place of the one ``hessian`` holds (the damped one),
    without copying H.
    """
    return reversed_cholesky(hessian, native=native, diagonal=diagonal)


def _columns(weights, corrections, scaled, factor_diag, params, grid: GridConfig):
    """The column level of ``_sweep`` on a sub-block W[rows, m]: columns one by one, each target
    w_k + c_k + Σ_{j<k} D_j·S_jk read as one product with the residuals so far (left-looking)."""

    def quantize_column(k, state):
        residuals, codes, squared_errors = state
        weights_k = lax.dynamic_index_in_dim(weights, k, axis=1, keepdims=False)
        earlier = jnp.matmul(
            residuals,
            lax.dynamic_index_in_dim(scaled, k, axis=1, keepdims=False),
            precision=_HIGHEST,
        )  # D·S[:, k]: columns of D from k on are still zero
        target = (
            weights_k + lax.dynamic_index_in_dim(corrections, k, axis=1, keepdims=False) + earlier
        )
        dequantized, codes_k = quantize(target, params, grid)
        error = (target - dequantized) * factor_diag[k]
        residuals = lax.dynamic_update_index_in_dim(residuals, weights_k - dequantized, k, 1)
        codes = lax.dynamic_update_index_in_dim(codes, codes_k, k, 1)
        return residuals, codes, squared_errors + error * error

    state = (
        jnp.zeros_like(weights),
        jnp.zeros_like(weights, dtype=jnp.uint8),
        jnp.zeros_like(weights[:, 0]),
    )
    return lax.fori_loop(0, weights.shape[1], quantize_column, state)


def _block_levels(
    weights,
    corrections,
    scaled,
    factor_diag,
    params,
    grid: GridConfig,
    inner_sizes: tuple[int, ...],
    native: bool,
):
    """``_sweep`` inside one outer block (``inner_sizes`` its levels): with ``native``, the CPU
    kernel (``kernels.bindings.gptq_block_call``) where the program runs on CPU and the jnp levels
    elsewhere; else the jnp levels."""

    def jnp_levels(*operands):
        return _sweep(*operands, grid, inner_sizes)

    operands = (weights, corrections, scaled, factor_diag, params)
    if not native:
        return jnp_levels(*operands)
    return native_on_cpu("gptq_block_call", jnp_levels, *operands, levels=grid.levels)


def _sweep(
    weights,
    corrections,
    scaled,
    factor_diag,
    params,
    grid: GridConfig,
    block_sizes: tuple[int, ...],
    native: bool = False,
):
    """Quantize the columns of W[rows, n] in order, in nested blocks of ``block_sizes`` (n divisible
    by the first; the last is 1, the column level), each block level right-looking in a
    ``fori_loop``; with ``native``, each outer block's inner levels as ``_block_levels`` runs them.

    ``corrections`` [rows, n] holds Σ_{j<k} D_j·S_jk from columns before this block; returns
    (residuals D = w − q [rows, n], codes uint8[rows, n], squared errors summed per row [rows]:
    twice the proxy loss of each row, which the caller sums in a fixed order).
    """
    if block_sizes == (1,):
        return _columns(weights, corrections, scaled, factor_diag, params, grid)
    size, inner_sizes = block_sizes[0], block_sizes[1:]

    def quantize_block(b, state):
        corrections, residuals, codes, squared_errors = state
        start = b * size
        columns_of = functools.partial(
            lax.dynamic_slice_in_dim, start_index=start, slice_size=size, axis=1
        )
        block_scaled = lax.dynamic_slice(scaled, (start, start), (size, size))
        block_residuals, block_codes, block_squared_errors = _block_levels(
            columns_of(weights),
            columns_of(corrections),
            block_scaled,
            lax.dynamic_slice_in_dim(factor_diag, start, size),
            params,
            grid,
            inner_sizes,
            native,
        )
        later = lax.dynamic_slice_in_dim(
            scaled, start, size, axis=0
        )  # S[block, :]: zero before the block, and
        # the block's own columns are never read again
        corrections = corrections + jnp.matmul(block_residuals, later, precision=_HIGHEST)
        residuals = lax.dynamic_update_slice_in_dim(residuals, block_residuals, start, 1)
        codes = lax.dynamic_update_slice_in_dim(codes, block_codes, start, 1)
        return corrections, residuals, codes, squared_errors + block_squared_errors

    state = (
        corrections,
        jnp.zeros_like(weights),
        jnp.zeros_like(weights, dtype=jnp.uint8),
        jnp.zeros_like(weights[:, 0]),
    )
    _, residuals, codes, squared_errors = lax.fori_loop(
        0, weights.shape[1] // size, quantize_block, state
    )
    return residuals, codes, squared_errors


def left_looking_corrections(residuals, scaled, start: int, stop: int) -> jax.Array:
    """Block start:stop's share of all earlier blocks in the left-looking sweep: D[:,
    :start]·S[:start, start:stop] (rows × start times start × (stop − start)), one matmul."""
    return jnp.matmul(residuals[:, :start], scaled[:start, start:stop], precision=_HIGHEST)


def _sweep_unrolled(
    weights,
    scaled,
    factor_diag,
    params,
    grid: GridConfig,
    block_sizes: tuple[int, ...],
    native: bool = False,
):
    """``_sweep`` from zero corrections with its outer block loop unrolled (static shapes per block)
    and left-looking: block b (columns s:e) first takes all earlier blocks' share in one matmul,
    D[:, :s]·S[:s, s:e] (rows × s times s × e−s), then runs its inner levels (``_block_levels``)."""
    size, inner_sizes = (
        block_sizes[0],
        block_sizes[1:] or (1,),
    )  # block_size 1: each block is one column
    residuals, codes, squared_errors = jnp.zeros_like(weights), [], jnp.zeros_like(weights[:, 0])
    for start in range(0, weights.shape[1], size):
        stop = start + size
        corrections = (
            left_looking_corrections(residuals, scaled, start, stop)
            if start
            else jnp.zeros_like(weights[:, :size])
        )  # zeros_like: varying where W is, in shard_map
        block_residuals, block_codes, block_squared_errors = _block_levels(
            weights[:, start:stop],
            corrections,
            scaled[start:stop, start:stop],
            factor_diag[start:stop],
            params,
            grid,
            inner_sizes,
            native,
        )
        # in place, at a static offset (``.at[].set`` would add a bounds check and a select)
        residuals = lax.dynamic_update_slice(residuals, block_residuals, (0, start))
        codes.append(block_codes)
        squared_errors = squared_errors + block_squared_errors
    return residuals, jnp.concatenate(codes, axis=1), squared_errors


def gptq(
    weights: jax.Array, hessian: jax.Array, grid: GridConfig, config: GPTQConfig = GPTQConfig()
) -> GPTQResult:
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
        raise ValueError(
            "gptq expects weights [rows, cols] and hessian [cols, cols]; got "
            f"{jnp.shape(weights)} and "
            f"{jnp.shape(hessian)} (T5X kernels are x·K: pass W = K.T)"
        )
    cols = jnp.shape(weights)[1]
    weights = jnp.asarray(weights, jnp.float32)
    hessian = jnp.asarray(hessian, jnp.float32)
    params = grid_params(weights, grid)

    diag = jnp.diagonal(hessian)
    dead = diag == 0
    diag = jnp.where(dead, 1.0, diag)
    # λ = damping × mean diag(H), to 12 significant bits: exact, so it adds alike in every program
    # (linalg.py)
    damping_term = exact_product(jnp.float32(config.damping / cols), pairwise_sum(diag))
    damped = (
        diag + damping_term
    )  # H's diagonal, given to the Cholesky (no copy of H with it written in)
    if config.act_order:
        order = jnp.argsort(-diag)
        hessian, damped, weights, dead = (
            hessian[order][:, order],
            damped[order],
            weights[:, order],
            dead[order],
        )
    factor = hessian_factor(hessian, config.native_cholesky, diagonal=damped)
    # A non-finite entry anywhere in R reaches its row's pivot (R_ii² = H_ii − Σ_j>i R_ij²), and a
    # failing pivot makes every column before it NaN (linalg.py): checking the diagonal is checking
    # R, at 1/n the reads.
    ok = jnp.isfinite(jnp.diagonal(factor)).all() & ~dead.all()
    weights = jnp.where(ok & dead[None, :], 0.0, weights)

    padding = -cols % config.block_size
    if (
        padding
    ):  # padded columns: R = identity there (no pass over a full-size matrix when there are none)
        padded = jnp.arange(cols, cols + padding)
        factor = jnp.pad(factor, ((0, padding), (0, padding))).at[padded, padded].set(1.0)
    # Where not ok, R = identity (the original weights, rounded to nearest). Selected elementwise
    # inside S, so that XLA fuses it into the slices the sweep reads instead of writing a selected
    # copy of R.
    factor_diag = jnp.where(ok, jnp.diagonal(factor), 1.0)
    identity = jnp.eye(cols + padding, dtype=jnp.float32)
    scaled = jnp.where(
        ok, factor * (1 / factor_diag)[None, :], identity
    )  # S = R_jk / R_kk (batch-invariant)
    if padding:
        weights = jnp.pad(weights, ((0, 0), (0, padding)))
    if config.unroll_blocks:
        _, codes, squared_errors = _sweep_unrolled(
            weights, scaled, factor_diag, params, grid, config.block_sizes, config.native_block
        )
    else:
        _, codes, squared_errors = _sweep(
            weights,
            jnp.zeros_like(weights),
            scaled,
            factor_diag,
            params,
            grid,
            config.block_sizes,
            config.native_block,
        )
    codes = codes[:, :cols] if padding else codes
    if config.act_order:
        codes = codes[:, jnp.argsort(order)]
    return GPTQResult(codes, params, ok, 0.5 * pairwise_sum(squared_errors))
