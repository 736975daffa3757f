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


def garbage_counts(rng, batch: tuple[int, ...]) -> np.ndarray:
    """int32[batch] token counts for the kernel fuzz programs: 0, small, past N and the int32
      extremes, or
    (1 in 8) a wrong shape [*batch, 2]."""
    shape = (*batch, 2) if rng.random() < 0.125 else batch
    values = np.array([-(2**31), -1, 0, 1, 3, 5, 6, 2**31 - 1], np.int32)
    return rng.choice(values, shape)


# Garbage code streams for the kernel fuzz programs (tests/helpers/kernel_fuzz.py, and
# the CUDA one in tests/kernels/test_ops_cuda.py): kinds 0..STREAM_CORRUPTIONS - 1.
STREAM_CORRUPTIONS = 4


def corrupt_stream(rng, kind: int, codes: np.ndarray, offsets, good_count: int):
    """Copies of (codes, row offsets) spoiled by garbage ``kind``: 0 random codes; 1 random offsets;
    2 sorted random offsets from 0 over random codes; 3 three of the ``good_count`` codes in use
    flipped. Other kinds: unspoiled copies, drawing nothing from ``rng``."""
    codes, offsets = np.asarray(codes).copy(), np.asarray(offsets).copy()
    n_codes, rows = len(codes), len(offsets) - 1
    if kind == 0:
        codes = rng.integers(0, 2**16, n_codes, dtype=np.uint16)
    elif kind == 1:
        offsets = rng.integers(-5, 2 * n_codes, rows + 1, dtype=np.int32)
    elif kind == 2:
        offsets = np.sort(rng.integers(0, n_codes + 1, rows + 1)).astype(np.int32)
        offsets[0] = 0
        codes = rng.integers(0, 2**16, n_codes, dtype=np.uint16)
    elif kind == 3:
        flips = rng.integers(0, good_count, 3)
        codes[flips] ^= rng.integers(1, 2**16, 3, dtype=np.uint16)
    return codes, offsets


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
