"""Hessians of the layer-wise objective ‖W·Xᵀ − Q·Xᵀ‖² for GPTQ.

Lingo: X[n, cols] are the calibration inputs of one matrix (one expert's
tokens, after the layer norm); H = Σ_t x_t x_tᵀ = XᵀX, float32[cols, cols].
We use the plain sum (no 2/n factor as in GPTQ): GPTQ's damping is relative
to mean diag(H), so the scale of H changes nothing. Tokens are given as padded
arrays with a boolean mask; masked tokens (padding, premasked sentinel
positions, tokens over the cap) contribute nothing.

Token cap (QMoE §4): an expert's Hessian uses at most ``factor`` × the mean
number of tokens per expert of the layer (factor 4). The cap keeps the first
tokens in buffer order, which is deterministic and matches the order in which
the calibration pass gathers them; the rest still flow through the quantized
expert, they only skip the Hessian.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

TOKEN_CAP_FACTOR = 4.0


def accumulate_hessian(hessian: jax.Array, tokens: jax.Array, mask: jax.Array) -> jax.Array:
    """Add a batch of tokens to one Hessian.

    Args:
      hessian: float32[cols, cols], the running sum.
      tokens: float[n, cols] (any float dtype; computed in float32).
      mask: bool[n]; False rows contribute nothing.

    Returns:
      float32[cols, cols] = hessian + Σ_{t: mask_t} x_t x_tᵀ.
    """
    if (
        tokens.ndim != 2
        or mask.shape != tokens.shape[:1]
        or hessian.shape != (tokens.shape[1],) * 2
    ):
        raise ValueError(
            f"accumulate_hessian expects hessian [cols, cols], tokens [n, cols], mask [n]; got "
            f"{hessian.shape}, {tokens.shape}, {mask.shape}"
        )
    kept = jnp.where(mask[:, None], tokens.astype(jnp.float32), 0.0)
    return hessian + jnp.matmul(kept.T, kept, precision=lax.Precision.HIGHEST)


def hessian(tokens: jax.Array, mask: jax.Array) -> jax.Array:
    """H = Σ_{t: mask_t} x_t x_tᵀ of one matrix's inputs.

    Args:
      tokens: float[n, cols].
      mask: bool[n].

    Returns:
      float32[cols, cols]; all zeros when no token is kept.
    """
    cols = tokens.shape[-1]
    return accumulate_hessian(jnp.zeros((cols, cols), jnp.float32), tokens, mask)


def expert_hessians(tokens: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Hessians of a group of experts from their gathered, padded inputs.

    Args:
      tokens: float[E, n, cols], expert e's tokens in buffer order, padded to n.
      mask: bool[E, n], which tokens count (apply ``cap_tokens`` first to cap them).

    Returns:
      (hessians float32[E, cols, cols], tokens_per_expert int32[E] = tokens counted).
    """
    if tokens.ndim != 3 or mask.shape != tokens.shape[:2]:
        raise ValueError(
            f"expert_hessians expects tokens [E, n, cols] and mask [E, n]; got {tokens.shape}, "
            f"{mask.shape}"
        )
    return jax.vmap(hessian)(tokens, mask), mask.sum(axis=1, dtype=jnp.int32)


def token_cap(tokens_per_expert: jax.Array, factor: float = TOKEN_CAP_FACTOR) -> jax.Array:
    """Most tokens one expert may use for its Hessian: floor(factor × mean), at least 1.

    Args:
      tokens_per_expert: int[E] over ALL experts of the layer (not one group).
      factor: multiple of the mean (QMoE uses 4).

    Returns:
      int32 scalar.
    """
    tokens_per_expert = jnp.asarray(tokens_per_expert)
    if tokens_per_expert.ndim != 1 or tokens_per_expert.shape[0] == 0:
        raise ValueError(
            "token_cap expects counts of every expert of the layer, int[E]; got shape "
            f"{tokens_per_expert.shape}"
        )
    mean = tokens_per_expert.astype(jnp.float32).mean()
    return jnp.maximum(jnp.floor(factor * mean), 1).astype(jnp.int32)


def cap_tokens(mask: jax.Array, cap: jax.Array | int) -> jax.Array:
    """Keep the first ``cap`` admitted tokens of each expert, in buffer order.

    Args:
      mask: bool[..., n], which tokens an expert's Hessian would use.
      cap: int, from ``token_cap``.

    Returns:
      bool[..., n] with at most ``cap`` True per row (the earliest ones).
    """
    return mask & (jnp.cumsum(mask, axis=-1, dtype=jnp.int32) <= cap)
