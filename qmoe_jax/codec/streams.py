"""Checking a code stream without decoding it, and counting its zero weights (docs/format.md §5,
§6).

Lingo: a codeword's entry has n pairs (2n weights) and counts c0, c1, c2 of the
codes 0 (zero), 1 (row min) and 2 (row max). A row is well formed when its
codewords hold exactly ``ceil(cols/2)`` pairs. A weight is zero when its code
is 0, or when its code is 1 and ``min_r == 0`` (or 2 and ``max_r == 0``): a
row without negative weights has min 0 in the QMoE authors' packer, and its
zeros carry code 1. Per-codeword tables make both a gather plus a cumulative
sum, far cheaper than decoding.
"""

from __future__ import annotations

import functools

import numpy as np

from qmoe_jax.codec.dictionary import Dictionary, entry_weights


@functools.lru_cache(maxsize=8)
def _tables(dictionary: Dictionary) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(pairs, c0, c1, c2) per entry, uint8[65536] each; c0 counts only the entry's 2n weights."""
    weights, pair_count = entry_weights(dictionary.entries)
    used = np.arange(weights.shape[1])[None, :] < 2 * pair_count[:, None]
    counts = [((weights == code) & used).sum(axis=1).astype(np.uint8) for code in range(3)]
    return (pair_count.astype(np.uint8), *counts)


def _per_row(values: np.ndarray, row_offsets: np.ndarray) -> np.ndarray:
    sums = np.zeros(values.shape[0] + 1, np.int64 if values.shape[0] * 28 >= 2**31 else np.int32)
    np.cumsum(values, out=sums[1:])
    return sums[row_offsets[1:]].astype(np.int64) - sums[row_offsets[:-1]]


def count_zeros(
    codes: np.ndarray,
    row_offsets: np.ndarray,
    minmax: np.ndarray,
    cols: int,
    dictionary: Dictionary,
) -> int:
    """Zero weights of one compressed matrix, after checking that every row is well formed.

    Args:
      codes: uint16[n] (codewords past ``row_offsets[-1]`` are padding).
      row_offsets: int32[rows + 1]; minmax: bfloat16[rows, 2]; cols: columns.

    Raises:
      ValueError: the offsets do not start at 0, decrease or end past the
        stream, or a row does not hold ``ceil(cols/2)`` pairs (names the row).
    """
    offsets = np.asarray(row_offsets).astype(np.int64)
    if offsets[0] != 0 or (np.diff(offsets) < 0).any() or offsets[-1] > codes.shape[0]:
        raise ValueError(
            f"row offsets must start at 0, never decrease and end within the {codes.shape[0]} "
            f"codewords, got first {offsets[0]}, last {offsets[-1]}"
        )
    pairs, zeros, mins, maxs = _tables(dictionary)
    used = np.asarray(codes)[: offsets[-1]]
    per_row = _per_row(
        np.take(pairs, used), offsets
    )  # np.take: indexing by uint16 is several times slower
    expected = (cols + 1) // 2
    if (per_row != expected).any():
        bad = int(np.argmax(per_row != expected))
        raise ValueError(
            f"row {bad} decodes to {2 * int(per_row[bad])} weights, expected {2 * expected}"
        )
    count = int(np.take(zeros, used).sum(dtype=np.int64)) - (cols % 2) * (
        len(offsets) - 1
    )  # odd rows' pad weight
    levels = np.asarray(minmax).astype(np.float32)
    for column, table in ((0, mins), (1, maxs)):
        rows = levels[:, column] == 0
        if rows.any():
            count += int(_per_row(np.take(table, used), offsets)[rows].sum())
    return count
