"""Reference (slow, obviously correct) encoder and decoder of format v1.

Lingo as in ``dictionary``: each row is padded to an even length with a zero
weight, read as pair symbols ``a + 3*b``, and cut greedily into the longest
dictionary entry that prefixes the rest of the row. The dictionary is
prefix-closed, so the greedy match always succeeds.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from qmoe_jax.codec.containers import CompressedExperts, CompressedMatrix
from qmoe_jax.codec.dictionary import MAX_PAIRS, Dictionary, entry_weights


@functools.lru_cache(maxsize=4)
def _entry_index(dictionary: Dictionary) -> dict[tuple[int, ...], int]:
    weights, pair_count = entry_weights(dictionary.entries)
    pairs = weights[:, 0::2].astype(np.int64) + 3 * weights[:, 1::2]
    return {tuple(p[:n]): i for i, (p, n) in enumerate(zip(pairs.tolist(), pair_count.tolist()))}


def encode_reference(
    codes: np.ndarray, minmax: np.ndarray, dictionary: Dictionary
) -> CompressedMatrix:
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


def decode_codes(
    matrix: CompressedMatrix | CompressedExperts, dictionary: Dictionary
) -> np.ndarray:
    """Decodes a compressed matrix, or a stack of E of them, back to ternary codes.

    Returns:
      uint8[rows, cols] (uint8[E, rows, cols] for a stack) with values in {0, 1, 2}.

    Raises:
      ValueError: if the offsets or code stream do not describe ``rows`` rows of
        ``cols`` weights each.
    """
    if isinstance(matrix, CompressedExperts):
        return np.stack([decode_codes(matrix[e], dictionary) for e in range(matrix.num_experts)])
    row_offsets = np.asarray(matrix.row_offsets).astype(np.int64)
    codes = np.asarray(matrix.codes)
    rows, cols = matrix.rows, matrix.cols
    if codes.dtype != np.uint16 or codes.ndim != 1:
        raise ValueError(f"codes must be uint16[n_codes], got {codes.dtype}{list(codes.shape)}")
    if row_offsets.shape != (rows + 1,):
        raise ValueError(f"row_offsets has shape {row_offsets.shape}, expected ({rows + 1},)")
    if row_offsets[0] != 0 or (np.diff(row_offsets) < 0).any() or row_offsets[-1] > codes.shape[0]:
        raise ValueError(
            "row_offsets must start at 0, never decrease, and end within the code stream"
        )
    weights, pair_count = entry_weights(dictionary.entries)
    used_codes = codes[: row_offsets[-1]].astype(np.int64)
    lengths = 2 * pair_count[used_codes]
    weights_before = np.concatenate([[0], np.cumsum(lengths)])
    row_lengths = weights_before[row_offsets[1:]] - weights_before[row_offsets[:-1]]
    padded_cols = cols + cols % 2
    if (row_lengths != padded_cols).any():
        bad = int(np.argmax(row_lengths != padded_cols))
        raise ValueError(
            f"row {bad} decodes to {int(row_lengths[bad])} weights, expected {padded_cols}"
        )
    entry_codes = weights[used_codes]
    flat = entry_codes[np.arange(28)[None, :] < lengths[:, None]]
    return flat.reshape(rows, padded_cols)[:, :cols].astype(np.uint8)


def decode_codes_jnp(
    matrix: CompressedMatrix | CompressedExperts, dictionary: Dictionary
) -> jax.Array:
    """``decode_codes`` in jnp, jit-able (the dictionary is static); for the ops' jnp twins.

    Each codeword's weights are scattered to their row and column; weights of a
    malformed stream that fall outside their row are dropped, not checked.

    Returns:
      uint8[rows, cols] (uint8[E, rows, cols] for a stack).
    """
    if isinstance(matrix, CompressedExperts):

        def decode_one(codes, row_offsets, minmax):
            one = CompressedMatrix(codes, row_offsets, minmax, matrix.cols)
            return decode_codes_jnp(one, dictionary)

        return jax.vmap(decode_one)(matrix.codes, matrix.row_offsets, matrix.minmax)
    weights, pair_count = entry_weights(dictionary.entries)
    codes = jnp.asarray(matrix.codes).astype(jnp.int32)
    row_offsets = jnp.asarray(matrix.row_offsets, jnp.int32)
    rows, padded_cols = matrix.rows, matrix.cols + matrix.cols % 2
    lengths = 2 * jnp.asarray(pair_count)[codes]
    starts = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(lengths, dtype=jnp.int32)])
    row_of = jnp.searchsorted(row_offsets, jnp.arange(codes.shape[0]), side="right") - 1
    first_code = row_offsets[jnp.clip(row_of, 0, rows)].clip(0, codes.shape[0])
    column = (starts[:-1] - starts[first_code])[:, None] + jnp.arange(2 * MAX_PAIRS)
    keep = (
        ((row_of >= 0) & (row_of < rows))[:, None]
        & (jnp.arange(2 * MAX_PAIRS) < lengths[:, None])
        & (column >= 0)
        & (column < padded_cols)
    )
    flat_index = jnp.where(keep, row_of[:, None] * padded_cols + column, rows * padded_cols)
    decoded = (
        jnp.zeros(rows * padded_cols, jnp.uint8)
        .at[flat_index]
        .set(jnp.asarray(weights)[codes], mode="drop")
    )
    return decoded.reshape(rows, padded_cols)[:, : matrix.cols]
