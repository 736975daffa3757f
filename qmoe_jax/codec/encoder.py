"""Dictionary encoder of format v1: the entropy-coding step of QMoE (docs/format.md §5).

Lingo: a row of ternary codes (0 = zero, 1 = row min, 2 = row max) is read as
pair symbols ``a + 3*b`` (odd rows get one zero pad) and cut greedily into the
longest dictionary entry that prefixes the rest of the row; each cut is one
uint16 codeword. Rows are independent. The work runs in C++
(``xla_ffi/encoder.cc``, multithreaded over rows) and matches
``reference.encode_reference`` codeword for codeword.

The returned containers hold host numpy arrays; move them with
``jax.device_put`` when a device needs them.
"""

from __future__ import annotations

import functools
import numbers

import ml_dtypes
import numpy as np

import qmoe_jax_ext
from qmoe_jax.codec.containers import CompressedExperts, CompressedMatrix
from qmoe_jax.codec.dictionary import Dictionary


@functools.lru_cache(maxsize=8)
def _encoder_table(dictionary: Dictionary) -> qmoe_jax_ext.EncoderTable:
    """The dictionary's trie for the C++ encoder, built once per dictionary and cached."""
    return qmoe_jax_ext.EncoderTable(dictionary.entries)


def _checked_codes(codes, expected: str) -> np.ndarray:
    codes = np.asarray(codes)
    if codes.dtype != np.uint8:
        raise TypeError(
            "codes must be uint8 ternary codes (0 = zero, 1 = min, 2 = max), got dtype "
            f"{codes.dtype}; "
            "convert with .astype(np.uint8) once the values are known to be in {0, 1, 2}"
        )
    if codes.ndim != len(expected.split(",")):
        raise ValueError(f"codes must have shape [{expected}], got shape {codes.shape}")
    return np.ascontiguousarray(codes)


def _checked_minmax(minmax, expected_shape: tuple[int, ...]) -> np.ndarray:
    minmax = np.asarray(minmax)
    if minmax.dtype != ml_dtypes.bfloat16:
        raise TypeError(
            f"minmax must be bfloat16 (the format stores the row grid in bf16), got dtype "
            f"{minmax.dtype}; round the grid to bf16 before quantizing so codes and grid agree"
        )
    if minmax.shape != expected_shape:
        raise ValueError(
            f"minmax must have shape {expected_shape} (per row: min, max), got {minmax.shape}"
        )
    return np.array(minmax, copy=True)


def _checked_threads(num_threads: int | None) -> int:
    if num_threads is None:
        return 0
    if not isinstance(num_threads, numbers.Integral) or num_threads < 1:
        raise ValueError(
            f"num_threads must be a positive int or None (all cores), got {num_threads!r}"
        )
    return int(num_threads)


def encode(
    codes: np.ndarray, minmax: np.ndarray, dictionary: Dictionary, *, num_threads: int | None = None
) -> CompressedMatrix:
    """Encodes one matrix of ternary codes.

    Args:
      codes: uint8[rows, cols] with values in {0, 1, 2}.
      minmax: bfloat16[rows, 2], per row (min, max) of the ternary grid.
      dictionary: the dictionary to encode with.
      num_threads: threads to use; None uses every core (small inputs use one).

    Returns:
      A CompressedMatrix whose ``codes`` are uint16[n_codes] (no padding) and
      ``row_offsets`` int32[rows + 1].

    Raises:
      TypeError: wrong dtypes.
      ValueError: wrong shapes, or a code outside {0, 1, 2} (the message names
        its row and column).
    """
    codes = _checked_codes(codes, "rows, cols")
    minmax = _checked_minmax(minmax, (codes.shape[0], 2))
    stream, row_offsets = _encoder_table(dictionary).encode(codes, _checked_threads(num_threads))
    return CompressedMatrix(stream, row_offsets, minmax, codes.shape[1])


def encode_experts(
    codes: np.ndarray, minmax: np.ndarray, dictionary: Dictionary, *, num_threads: int | None = None
) -> CompressedExperts:
    """Encodes a stack of E expert matrices of one layer in one call.

    Args:
      codes: uint8[E, rows, cols] with values in {0, 1, 2}.
      minmax: bfloat16[E, rows, 2].
      dictionary: the dictionary to encode with.
      num_threads: threads to use; None uses every core.

    Returns:
      A CompressedExperts with ``codes`` uint16[E, longest] (each expert's
      stream zero padded to the longest, at least 1) and ``row_offsets``
      int32[E, rows + 1] per expert; equal to ``CompressedExperts.stack`` of the
      experts encoded one by one.

    Raises:
      TypeError: wrong dtypes.
      ValueError: wrong shapes, or a code outside {0, 1, 2} (the message names
        its expert, row and column).
    """
    codes = _checked_codes(codes, "E, rows, cols")
    if codes.shape[0] == 0:
        raise ValueError(
            f"encode_experts needs at least one expert, got codes of shape {codes.shape}"
        )
    minmax = _checked_minmax(minmax, (codes.shape[0], codes.shape[1], 2))
    streams, row_offsets = _encoder_table(dictionary).encode(codes, _checked_threads(num_threads))
    if streams.shape[1] == 0:
        streams = np.zeros((codes.shape[0], 1), np.uint16)
    return CompressedExperts(streams, row_offsets, minmax, codes.shape[2])


def count_codewords(
    codes: np.ndarray, dictionary: Dictionary, *, num_threads: int | None = None
) -> int:
    """Codewords that encoding ``codes`` with ``dictionary`` takes (what a dictionary is judged by).

    Args:
      codes: uint8[rows, cols] or uint8[E, rows, cols] with values in {0, 1, 2}.
    """
    codes = np.asarray(codes)
    codes = _checked_codes(codes, "E, rows, cols" if codes.ndim == 3 else "rows, cols")
    _, row_offsets = _encoder_table(dictionary).encode(codes, _checked_threads(num_threads))
    return int(row_offsets[..., -1].astype(np.int64).sum())
