"""Cholesky factorization and sums in plain ``lax``, for one matrix or vector (vmap them for a
batch).

Lingo: A[n, n] symmetric positive definite (SPD); L lower triangular with
A = L·Lᵀ; L⁻¹ its inverse. Columns are factored in blocks of ``BASE_SIZE``,
left to right and left-looking: block k (columns s:e) first takes the work of
all earlier blocks in one matmul, then factors its diagonal part and solves
for the rows below it,

    P = A[s:, s:e] − L[s:, :s]·L[s:e, :s]ᵀ,
    L[s:e, s:e] = chol(P[:e−s]),   L[e:, s:e] = P[e−s:]·L[s:e, s:e]⁻ᵀ.

The diagonal block is factored column by column, which also inverts its L
row by row (for the solve): on CPU in a native kernel (the FFI target
``qmoe_cholesky_base``, xla_ffi/cpu_cholesky.h; ``native=False`` turns it
off), elsewhere in one ``fori_loop`` (``_base_factor``, its twin), whose
per-column steps cost XLA:CPU more than their arithmetic. Nearly all the
work is the first matmul, which only ever forms the columns being factored:
about n³/3 FLOPs in all, what a Cholesky needs (a recursive form that also
forms the inverses of its leading halves would execute about twice that).

Why not ``jnp.linalg.cholesky`` / ``lax.linalg.triangular_solve``: on CPU,
batched calls go to jaxlib's LAPACK kernels, which split the batch into tasks
on XLA's intra-op thread pool and block until they finish. When several host
devices run such a call at once, every pool thread can be one of the blocked
callers and the tasks never run, so multi-device compression would hang. Here
everything is ordinary XLA ops, which no pool thread blocks on, and the
native kernel, which runs its batch items on the pool but never waits on a
task that has not started (xla_ffi/cpu_parallel.h).

Failures are data: where A is not positive definite, the first pivot that is
not > 0 (or is NaN) becomes NaN, and so does L on and below the diagonal
from that column on (callers test ``isfinite``).

Batch-invariant: an item's result has the same bits whatever the batch it is
vmapped in, so sharding experts over devices (a smaller batch per device)
cannot change codes. XLA's reductions (``jnp.sum``, ``mean``) lack this: their
summation order depends on the batch size, so ``pairwise_sum`` adds halves
elementwise instead. Two rewrites depend on the program around an op (one
device's or a shard's): XLA turns x / broadcast(p) into x · broadcast(1/p)
in some programs only, so divisions by a pivot are written as that product;
and XLA:CPU computes a·b + c as one FMA (rounded once) when both ops land in
one fused kernel, so a product that callers add to something else can be
made exact (``exact_product``), which rounds alike either way. The matmuls
keep it, and so does the native kernel, which rounds every product and sum
on its own in a fixed order, alike on every instruction set; its sums come
in another order than the twin's, so the two differ by rounding only (tests
check all of this).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

BASE_SIZE = 128
_HIGHEST = lax.Precision.HIGHEST


def _matmul(a: jax.Array, b: jax.Array) -> jax.Array:
    return jnp.matmul(a, b, precision=_HIGHEST)


def _base_factor(matrix: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(L, L⁻¹) of a small SPD matrix, one step per column j: column j of L from its columns < j
    (left-looking), which completes row j of L, then row j of L⁻¹ from its rows < j (forward
    substitution)."""
    size = matrix.shape[-1]
    rows = jnp.arange(size)
    identity = jnp.eye(size, dtype=matrix.dtype)

    def step(j, factors):
        lower, inverse = factors  # zero from column j on (lower) and from row j on (inverse)
        lower_row = lax.dynamic_index_in_dim(lower, j, axis=0, keepdims=False)
        column = lax.dynamic_index_in_dim(matrix, j, axis=1, keepdims=False) - _matmul(
            lower, lower_row
        )
        pivot = jnp.sqrt(jnp.where(column[j] > 0, column[j], jnp.nan))
        reciprocal = 1 / pivot  # see "Batch-invariant" above
        column = jnp.where(rows > j, column * reciprocal, jnp.where(rows == j, pivot, 0.0))
        lower = lax.dynamic_update_index_in_dim(lower, column, j, axis=1)
        inverse_row = (identity[j] - _matmul(lower_row, inverse)) * reciprocal
        return lower, lax.dynamic_update_index_in_dim(inverse, inverse_row, j, axis=0)

    return lax.fori_loop(0, size, step, (jnp.zeros_like(matrix), jnp.zeros_like(matrix)))


def native_on_cpu(kernel: str, twin: Callable, *operands, **attributes):
    """``twin(*operands)`` where the program runs on other platforms; on CPU the native kernel
    ``qmoe_jax.kernels.bindings.<kernel>(*operands, **attributes)``. The extension is imported
    only where a kernel is used, so quant/ imports without it."""

    def native(*operands):
        from qmoe_jax.kernels import bindings

        return getattr(bindings, kernel)(*operands, **attributes)

    return lax.platform_dependent(*operands, cpu=native, default=twin)


def _diagonal_factor(matrix: jax.Array, native: bool) -> tuple[jax.Array, jax.Array]:
    """(L, L⁻¹) of a diagonal block: with ``native``, the CPU kernel where the program runs on CPU
    and ``_base_factor`` elsewhere; else ``_base_factor``."""
    return (
        native_on_cpu("cholesky_base_call", _base_factor, matrix)
        if native
        else _base_factor(matrix)
    )


def _with_diagonal(block: jax.Array, diagonal: jax.Array | None) -> jax.Array:
    """A square block with its diagonal replaced by ``diagonal`` (None: as it is)."""
    if diagonal is None:
        return block
    index = jnp.arange(block.shape[-1])
    return block.at[index, index].set(diagonal)


def _factor(
    matrix: jax.Array, from_end: bool, native: bool, diagonal: jax.Array | None = None
) -> jax.Array:
    """L (module docstring), or with ``from_end`` R = J·chol(J·A·J)·J (J reverses the order of rows
    or columns)
    without reversing A or the result: the same steps on blocks taken from the last columns back,
      each index i
    of the reversed problem being n − 1 − i here, so R is upper triangular and A = R·Rᵀ. Every
    block's shapes are static. ``diagonal``: A's diagonal, replacing the one ``matrix`` holds
    (written into each diagonal block as it is read, so that a caller changing the diagonal, GPTQ's
    damping, copies no n×n matrix)."""
    size = matrix.shape[-1]
    flip = (
        (lambda block: block[::-1, ::-1]) if from_end else (lambda block: block)
    )  # only BASE_SIZE blocks
    if (
        size <= BASE_SIZE
    ):  # one block; not an update of zeros: XLA's simplifier aborted on reversing that
        return flip(_diagonal_factor(flip(_with_diagonal(matrix, diagonal)), native)[0])
    # Behind a barrier, the zeros are their own op (a parallel fill, free to run before the first
    # block is factored); without it XLA folds the first block's update into them as one
    # single-threaded pad of the whole n×n matrix after that block, on the critical path.
    factor = lax.optimization_barrier(jnp.zeros_like(matrix))
    for done in range(0, size, BASE_SIZE):
        width = min(BASE_SIZE, size - done)
        if (
            from_end
        ):  # block columns start:stop, done = the columns after them, rest = the rows before them
            start, stop = size - done - width, size - done
            panel = matrix[:stop, start:stop]
            if diagonal is not None:
                panel = panel.at[start:].set(_with_diagonal(panel[start:], diagonal[start:stop]))
            if done:
                panel = panel - _matmul(factor[:stop, stop:], factor[start:stop, stop:].T)
            block, block_inverse = (
                flip(part) for part in _diagonal_factor(flip(panel[start:]), native)
            )
            rest, solve = 0, panel[:start]
        else:
            # block columns start:stop, done = the columns before them, rest = the rows after them
            start, stop = done, done + width
            panel = matrix[start:, start:stop]
            if diagonal is not None:
                panel = panel.at[:width].set(_with_diagonal(panel[:width], diagonal[start:stop]))
            if done:
                panel = panel - _matmul(factor[start:, :start], factor[start:stop, :start].T)
            block, block_inverse = _diagonal_factor(panel[:width], native)
            rest, solve = stop, panel[width:]
        # In-place updates at static offsets (``.at[].set`` would add a bounds check and a select
        # per block).
        factor = lax.dynamic_update_slice(factor, block, (start, start))
        if (
            done + width < size
        ):  # rows ``rest`` on: the rows before the block (from_end) or after it
            factor = lax.dynamic_update_slice(
                factor, _matmul(solve, block_inverse.T), (rest, start)
            )
    return factor


def cholesky(
    matrix: jax.Array, native: bool = True, diagonal: jax.Array | None = None
) -> jax.Array:
    """Lower Cholesky factor L of an SPD matrix A[n, n] (A = L·Lᵀ), reading only A's lower triangle;
    NaNs from the first failing column on where A is not positive definite. ``native``: the diagonal
    blocks in the CPU kernel where the program runs on CPU (module docstring). ``diagonal``
    (float[n], optional): A's diagonal, in place of the one ``matrix`` holds; the same result as
    factoring the matrix with it written in, without a copy of the matrix."""
    _check_square(matrix, "cholesky", diagonal)
    return _factor(matrix, from_end=False, native=native, diagonal=diagonal)


def reversed_cholesky(
    matrix: jax.Array, native: bool = True, diagonal: jax.Array | None = None
) -> jax.Array:
    """Upper triangular R with A = R·Rᵀ for an SPD matrix A[n, n]: the Cholesky factor of A with the
    order of rows and columns reversed (``cholesky(A[::-1, ::-1])[::-1, ::-1]`` up to float
    rounding), reading only A's upper triangle. It runs from the last column to the first, so where
    A is not positive definite, the first failing column met that way and every column before it are
    NaN on and above the diagonal. ``native`` and ``diagonal`` as in ``cholesky``."""
    _check_square(matrix, "reversed_cholesky", diagonal)
    return _factor(matrix, from_end=True, native=native, diagonal=diagonal)


def _check_square(matrix: jax.Array, name: str, diagonal: jax.Array | None = None) -> None:
    if matrix.ndim != 2 or matrix.shape[0] != matrix.shape[1]:
        raise ValueError(
            f"{name} expects one square matrix [n, n] (vmap it for a batch); got {matrix.shape}"
        )
    if diagonal is not None and jnp.shape(diagonal) != matrix.shape[:1]:
        raise ValueError(
            f"{name}: diagonal must have shape {matrix.shape[:1]} (one entry per row of the "
            f"{matrix.shape} matrix); got {jnp.shape(diagonal)}"
        )


def pairwise_sum(values: jax.Array) -> jax.Array:
    """Sum over the last axis in a fixed order (halves added elementwise, zero-padded to even
    lengths), so the result is batch-invariant, unlike ``jnp.sum``."""
    while values.shape[-1] > 1:
        if values.shape[-1] % 2:
            values = jnp.concatenate([values, jnp.zeros_like(values[..., :1])], axis=-1)
        half = values.shape[-1] // 2
        values = values[..., :half] + values[..., half:]
    return values[..., 0]


def exact_product(a: jax.Array, b: jax.Array) -> jax.Array:
    """a·b of float32s with both first rounded to 12 significant bits, so that the product is exact:
    an FMA with a following sum then rounds exactly like the product and the sum apart."""
    return lax.reduce_precision(a, 8, 11) * lax.reduce_precision(b, 8, 11)
