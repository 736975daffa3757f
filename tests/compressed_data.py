"""Random compressed matrices for the kernel tests, with their dense twins."""

from __future__ import annotations

import functools

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from qmoe_jax.codec import CompressedExperts, CompressedMatrix, build_dictionary, encode

# Kernel results against the dense product: float32 sums, or bfloat16 inputs and outputs.
TOLERANCE = {jnp.float32: dict(rtol=1e-5, atol=1e-5), jnp.bfloat16: dict(rtol=2e-2, atol=2e-2)}

# The one place that picks the encoder for test data. Tests compare against
# the dense W built from the ternary codes, so they check the encoding too.


def ternary(rng: np.random.Generator, rows: int, cols: int, p0: float = 0.885) -> np.ndarray:
    """uint8[rows, cols] i.i.d. in {0, 1, 2} with P(0) = p0."""
    return rng.choice(3, size=(rows, cols), p=[p0, (1 - p0) / 2, (1 - p0) / 2]).astype(np.uint8)


def minmax(rng: np.random.Generator, rows: int) -> np.ndarray:
    """bfloat16[rows, 2] with min <= 0 <= max."""
    return np.stack([-rng.random(rows), rng.random(rows)], axis=1).astype(ml_dtypes.bfloat16)


def dense(codes: np.ndarray, row_minmax: np.ndarray) -> np.ndarray:
    """float32 W from ternary codes and per-row (min, max)."""
    values = row_minmax.astype(np.float32)
    return np.where(codes == 2, values[:, 1:], np.where(codes == 1, values[:, :1], 0.0)).astype(
        np.float32
    )


def matrix(rng, dictionary, rows: int, cols: int, p0: float = 0.885):
    """A random CompressedMatrix and its dense float32 W."""
    codes, row_minmax = ternary(rng, rows, cols, p0), minmax(rng, rows)
    return encode(codes, row_minmax, dictionary, num_threads=1), dense(codes, row_minmax)


def experts(rng, dictionary, count: int, rows: int, cols: int):
    """A random CompressedExperts stack and its dense float32 W[E, rows, cols]."""
    pairs = [matrix(rng, dictionary, rows, cols) for _ in range(count)]
    return CompressedExperts.stack([m for m, _ in pairs]), np.stack([w for _, w in pairs])


def with_arrays(w: CompressedMatrix, **arrays) -> CompressedMatrix:
    """A copy of w with some of codes / row_offsets / minmax replaced."""
    fields = dict(codes=w.codes, row_offsets=w.row_offsets, minmax=w.minmax) | arrays
    return CompressedMatrix(fields["codes"], fields["row_offsets"], fields["minmax"], w.cols)


@functools.cache
def cached_matrix(rows: int, cols: int, seed: int = 0):
    """``matrix`` with the static dictionary, made once per (rows, cols, seed)."""
    return matrix(np.random.default_rng(seed), build_dictionary(0.885), rows, cols)


@functools.cache
def cached_experts(count: int, rows: int, cols: int, seed: int = 0):
    """``experts`` with the static dictionary, made once per arguments."""
    return experts(np.random.default_rng(seed), build_dictionary(0.885), count, rows, cols)


def tokens(shape, dtype, seed: int = 1):
    """Standard normal tokens of ``shape`` in ``dtype``."""
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)
