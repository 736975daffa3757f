"""Quantization grids: the per-row value sets that GPTQ and RTN round to.

Paper step: the ternary grid of QMoE §3 (and GPTQ's standard min-max grids as
baselines). Lingo: W[rows, cols] in y = W·x orientation (rows = output
features); every grid is per row, so its parameters are ``grid_params[rows, 2]``:

- ternary: levels {min_r, 0, max_r} with min_r = min(0, min_j W_rj) and
  max_r = max(0, max_j W_rj), both rounded to bfloat16 (the compressed format
  stores them so); ``grid_params`` is bfloat16[rows, 2] = (min_r, max_r).
  Codes: 0 = zero, 1 = min, 2 = max (the codec's convention).
- minmax (b bits): asymmetric levels scale_r·(q − zero_r), q = 0 … 2^b − 1, with
  scale_r = (xmax − xmin)/(2^b − 1), zero_r = round(−xmin/scale_r) on
  xmin = min(0, min_j W_rj), xmax = max(0, max_j W_rj); an all-zero row (or
  one so small that the scale would underflow) uses xmin, xmax = −1, +1, a
  grid holding 0 that decodes it to zeros. ``grid_params``
  is float32[rows, 2] = (scale_r, zero_r). Codes are q.

``dequantize_codes(codes, params)`` equals the dequantized values that
``quantize`` returned, bit for bit, so decoding reproduces GPTQ's output.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp

MINMAX_BITS = (2, 3, 4, 5, 6, 7, 8)


@dataclasses.dataclass(frozen=True)
class GridConfig:
    """Which per-row grid to quantize to.

    Attributes:
      kind: "ternary" ({min, 0, max}, the QMoE grid) or "minmax" (2^bits levels).
      bits: levels are 2^bits for "minmax"; ignored (must stay None) for "ternary".
    """

    kind: Literal["ternary", "minmax"] = "ternary"
    bits: int | None = None

    def __post_init__(self):
        if self.kind == "ternary":
            if self.bits is not None:
                raise ValueError(
                    f"GridConfig(kind='ternary') takes no bits (got bits={self.bits}); "
                    "use GridConfig(kind='minmax', bits=...) for a k-bit grid"
                )
        elif self.kind == "minmax":
            if self.bits not in MINMAX_BITS:
                raise ValueError(
                    f"GridConfig(kind='minmax') needs bits in {MINMAX_BITS}, got {self.bits!r}"
                )
        else:
            raise ValueError(f"unknown grid kind {self.kind!r}; use 'ternary' or 'minmax'")

    @property
    def levels(self) -> int:
        """Number of distinct codes (3 for ternary, 2^bits for minmax)."""
        return 3 if self.kind == "ternary" else 2**self.bits

    @property
    def params_dtype(self):
        """dtype of ``grid_params``: bfloat16 for ternary, float32 for minmax."""
        return jnp.bfloat16 if self.kind == "ternary" else jnp.float32


def grid_params(weights: jax.Array, grid: GridConfig) -> jax.Array:
    """Per-row grid parameters of W.

    Args:
      weights: float[rows, cols], y = W·x orientation.
      grid: which grid.

    Returns:
      ternary: bfloat16[rows, 2] = (min_r, max_r); minmax: float32[rows, 2] = (scale_r, zero_r).
    """
    weights = jnp.asarray(weights, jnp.float32)
    if weights.ndim != 2:
        raise ValueError(f"grid_params expects a matrix W[rows, cols], got shape {weights.shape}")
    low = jnp.minimum(weights.min(axis=1), 0.0)
    high = jnp.maximum(weights.max(axis=1), 0.0)
    if grid.kind == "ternary":
        return jnp.stack([low, high], axis=1).astype(jnp.bfloat16)
    degenerate = high - low < (grid.levels - 1) * jnp.finfo(jnp.float32).tiny
    low = jnp.where(degenerate, -1.0, low)
    high = jnp.where(degenerate, 1.0, high)
    scale = (high - low) / (grid.levels - 1)
    zero = jnp.round(-low / scale)
    return jnp.stack([scale, zero], axis=1)


def _per_row(column: jax.Array, like: jax.Array) -> jax.Array:
    """Broadcast a per-row vector [rows] against values [rows, ...]."""
    return column.astype(jnp.float32).reshape(column.shape + (1,) * (like.ndim - 1))


def dequantize_codes(codes: jax.Array, params: jax.Array, grid: GridConfig) -> jax.Array:
    """Values of codes on the grid.

    Args:
      codes: uint8[rows] or uint8[rows, k] (one column or a block of columns).
      params: grid_params[rows, 2] of the matrix.
      grid: the grid the params belong to.

    Returns:
      float32 of the codes' shape.
    """
    first, second = _per_row(params[:, 0], codes), _per_row(params[:, 1], codes)
    if grid.kind == "ternary":
        return jnp.where(codes == 1, first, jnp.where(codes == 2, second, 0.0))
    return first * (codes.astype(jnp.float32) - second)


def quantize(values: jax.Array, params: jax.Array, grid: GridConfig) -> tuple[jax.Array, jax.Array]:
    """Round values to the nearest level of each row's grid.

    Ternary ties (|x| exactly half of the level) and levels equal to 0 go to
    code 0, which keeps the code stream as sparse as possible.

    Args:
      values: float[rows] or float[rows, k] (one column or a block of columns).
      params: grid_params[rows, 2].
      grid: the grid.

    Returns:
      (dequantized float32 of values' shape, codes uint8 of values' shape).
    """
    values = values.astype(jnp.float32)
    first, second = _per_row(params[:, 0], values), _per_row(params[:, 1], values)
    if grid.kind == "ternary":
        to_max = (values > 0.5 * second) & (second > 0)
        to_min = (values < 0.5 * first) & (first < 0)
        codes = jnp.where(to_max, 2, jnp.where(to_min, 1, 0)).astype(jnp.uint8)
    else:
        codes = jnp.clip(jnp.round(values / first) + second, 0, grid.levels - 1).astype(jnp.uint8)
    return dequantize_codes(codes, params, grid), codes
