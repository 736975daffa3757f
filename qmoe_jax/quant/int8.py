"""Symmetric 8-bit weight quantization with one scale per output channel.

Lingo: W[rows, cols] in y = W·x orientation, a row per output channel. Row r
is stored as int8 codes q[r, :] in [-127, 127] and a float32 scale s[r] =
max_j |W[r, j]| / 127, so that W[r, j] ≈ s[r] · q[r, j] (round to nearest,
ties to even). A row of zeros gets scale 0 and codes 0. -128 is never used,
so the grid is symmetric and negating W negates q.

Pure jnp (numpy arrays work too): ``qmoe_jax.kernels.dense`` multiplies the
stored form without converting it to float32 in memory.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

INT8_LEVELS = 127


def quantize_int8(weights: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(codes int8[rows, cols], scales float32[rows]) of ``weights [rows, cols]`` (any float
    dtype), one scale per row."""
    weights = jnp.asarray(weights, jnp.float32)
    if weights.ndim != 2:
        raise ValueError(f"quantize_int8 expects a matrix [rows, cols], got shape {weights.shape}")
    scales = jnp.max(jnp.abs(weights), axis=1) / INT8_LEVELS
    safe = jnp.where(scales > 0, scales, 1.0)
    codes = jnp.clip(jnp.round(weights / safe[:, None]), -INT8_LEVELS, INT8_LEVELS)
    return codes.astype(jnp.int8), scales


def dequantize_int8(codes: jax.Array, scales: jax.Array) -> jax.Array:
    """float32[rows, cols] = scales[:, None] · codes, the weights ``quantize_int8`` stands for."""
    return jnp.asarray(codes).astype(jnp.float32) * jnp.asarray(scales, jnp.float32)[..., None]
