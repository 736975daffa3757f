"""Reference (slow, obviously correct) encoder and decoder of format v1.

Lingo as in ``dictionary``: each row is padded to an even length with a zero
weight, read as pair symbols ``a + 3*b``, and cut greedily into the longest
dictionary entry that prefixes the rest of the row. The dictionary is
prefix-closed, so the greedy match always succeeds.
"""

from __future__ import annotations

import numpy as np

from qmoe_jax.codec.containers import CompressedMatrix
from qmoe_jax.codec.dictionary import MAX_PAIRS, Dictionary, entry_weights


def _entry_index(dictionary: Dictionary) -> dict[tuple[int, ...], int]:
    weights, pair_count = entry_weights(dictionary.entries)
    pairs = weights[:, 0::2].astype(np.int64) + 3 * weights[:, 1::2]
    return {tuple(p[:n]): i for i, (p, n) in enumerate(zip(pairs.tolist(), pair_count.tolist()))}


def encode_reference(codes: np.ndarray, minmax: np.ndarray, dictionary: Dictionary) -> CompressedMatrix:
    """Greedy longest-prefix encoding in pure Python; for tests only.

    Args:
      codes: uint8[rows, cols] with values in {0, 1, 2}.
      minmax: bfloat16[rows, 2].
    """
    codes = np.asarray(codes)
    rows, cols = codes.shape
    index = _entry_index(dictionary)
    padded = np.zeros((rows, cols + cols % 2), np.int64)
    padded[:, :cols] = codes
    symbols = padded[:, 0::2] + 3 * padded[:, 1::2]
    stream: list[int] = []
    row_offsets = [0]
    for row in symbols.tolist():
        position = 0
        while position < len(row):
            length = 1
            while (
                length < MAX_PAIRS
                and position + length < len(row)
                and tuple(row[position : position + length + 1]) in index
            ):
                length += 1
            stream.append(index[tuple(row[position : position + length])])
            position += length
        row_offsets.append(len(stream))
    return CompressedMatrix(
        np.asarray(stream, np.uint16), np.asarray(row_offsets, np.int32), np.asarray(minmax), cols
    )


def decode_codes(matrix: CompressedMatrix, dictionary: Dictionary) -> np.ndarray:
    """Decodes a compressed matrix back to its ternary codes.

    Returns:
      uint8[rows, cols] with values in {0, 1, 2}.

    Raises:
      ValueError: if the offsets or code stream do not describe ``rows`` rows of
        ``cols`` weights each.
    """
    row_offsets = np.asarray(matrix.row_offsets).astype(np.int64)
    codes = np.asarray(matrix.codes)
    rows, cols = matrix.rows, matrix.cols
    if row_offsets.shape != (rows + 1,):
        raise ValueError(f"row_offsets has shape {row_offsets.shape}, expected ({rows + 1},)")
    if row_offsets[0] != 0 or (np.diff(row_offsets) < 0).any() or row_offsets[-1] > codes.shape[0]:
        raise ValueError("row_offsets must start at 0, never decrease, and end within the code stream")
    weights, pair_count = entry_weights(dictionary.entries)
    used_codes = codes[: row_offsets[-1]].astype(np.int64)
    lengths = 2 * pair_count[used_codes]
    row_lengths = np.add.reduceat(lengths, row_offsets[:-1]) if used_codes.size else np.zeros(rows)
    row_lengths = np.where(np.diff(row_offsets) == 0, 0, row_lengths)
    padded_cols = cols + cols % 2
    if (row_lengths != padded_cols).any():
        bad = int(np.argmax(row_lengths != padded_cols))
        raise ValueError(f"row {bad} decodes to {int(row_lengths[bad])} weights, expected {padded_cols}")
    entry_codes = weights[used_codes]
    flat = entry_codes[np.arange(28)[None, :] < lengths[:, None]]
    return flat.reshape(rows, padded_cols)[:, :cols].astype(np.uint8)
