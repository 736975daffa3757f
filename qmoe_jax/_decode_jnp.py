"""Pure-jnp decoding of format v1, the twin of the fused kernels.

Lingo as in ``qmoe_jax.ops``: a row's codewords expand, left to right, into
2*pair_count weights each; the mask form of the dictionary gives each
codeword's plus (row max) and minus (row min) bits.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

WEIGHTS_PER_CODE = 28
PAIR_COUNT_SHIFT = 28


def dense_from_codes(masks, codes, row_offsets, minmax, cols: int):
    """Decodes one compressed matrix with jnp.

    Args:
      masks: uint32[65536, 2], ``Dictionary.masks``.
      codes: uint16[n_codes].
      row_offsets: int32[rows + 1].
      minmax: bfloat16[rows, 2].
      cols: columns of W.

    Returns:
      bfloat16[rows, cols]. A row whose codes do not decode to exactly
      2*ceil(cols/2) weights comes back as NaN (failures are data here; the
      kernels raise instead).
    """
    rows = minmax.shape[0]
    padded_cols = cols + cols % 2
    if rows == 0 or cols == 0:
        return jnp.zeros((rows, cols), jnp.bfloat16)
    row_offsets = row_offsets.astype(jnp.int32)
    entry = jnp.asarray(masks)[codes.astype(jnp.int32)]
    index = jnp.arange(codes.shape[0])
    in_use = index < row_offsets[-1]
    length = jnp.where(in_use, 2 * (entry[:, 0] >> PAIR_COUNT_SHIFT), 0).astype(jnp.int32)
    before = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(length)])
    row = jnp.clip(jnp.searchsorted(row_offsets, index, side="right") - 1, 0, rows - 1)
    start = before[index] - before[row_offsets[row]]
    bit = jnp.arange(WEIGHTS_PER_CODE, dtype=jnp.uint32)
    plus = ((entry[:, 0, None] >> bit) & 1).astype(bool)
    minus = ((entry[:, 1, None] >> bit) & 1).astype(bool)
    row_min = minmax[:, 0].astype(jnp.float32)[row, None]
    row_max = minmax[:, 1].astype(jnp.float32)[row, None]
    value = jnp.where(plus, row_max, jnp.where(minus, row_min, 0.0))
    column = start[:, None] + bit.astype(jnp.int32)
    keep = in_use[:, None] & (bit[None, :] < length[:, None]) & (column < padded_cols)
    flat = jnp.where(keep, row[:, None] * padded_cols + column, rows * padded_cols)
    dense = jnp.zeros(rows * padded_cols, jnp.float32).at[flat.ravel()].set(
        value.ravel(), mode="drop"
    )
    dense = dense.reshape(rows, padded_cols)[:, :cols]
    decoded = before[row_offsets[1:]] - before[row_offsets[:-1]]
    dense = jnp.where((decoded == padded_cols)[:, None], dense, jnp.nan)
    return dense.astype(jnp.bfloat16)


@functools.partial(jax.jit, static_argnames="cols")
def dense_batch(masks, codes, row_offsets, minmax, cols: int):
    """``dense_from_codes`` over leading batch dims B...: W as bfloat16[B..., rows, cols]."""
    batch = minmax.shape[:-2]
    if not batch:
        return dense_from_codes(masks, codes, row_offsets, minmax, cols)
    size = int(np.prod(batch))
    decode = jax.vmap(lambda c, o, m: dense_from_codes(masks, c, o, m, cols))
    dense = decode(
        codes.reshape(size, codes.shape[-1]),
        row_offsets.reshape(size, row_offsets.shape[-1]),
        minmax.reshape(size, *minmax.shape[-2:]),
    )
    return dense.reshape(*batch, *dense.shape[1:])
