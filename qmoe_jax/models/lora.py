"""Low-rank adapters on expert stacks (QLoRA for sub-1-bit MoE): ``y_e = W_e x + B_e A_e x``.

Lingo: per sparse layer and expert kernel (``wi``, ``wi_0``/``wi_1``, ``wo``) an
adapter ``{"a": [E, r, in], "b": [E, out, r]}``, batched over the E experts; r is
the rank. B starts at zero, so a fresh adapter leaves the model unchanged. The
adapters of a layer live under its expert module as ``expert/lora/<kernel>/{a, b}``;
a layer without them computes ``W_e x`` only.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

LORA = "lora"


def init_adapter(
    rng: jax.Array, num_experts: int, rows: int, cols: int, rank: int
) -> dict[str, jax.Array]:
    """A fresh float32 adapter of W[E, rows=out, cols=in]: A ~ N(0, 1/in), B = 0.

    Raises ValueError when ``rank`` is not in 1 … min(rows, cols).
    """
    if not 1 <= rank <= min(rows, cols):
        raise ValueError(
            f"LoRA rank {rank} must be between 1 and min(out, in) = {min(rows, cols)} for an "
            "expert "
            f"matrix of {rows}x{cols}; choose a smaller --expert_lora_rank"
        )
    a = jax.random.normal(rng, (num_experts, rank, cols), jnp.float32) / jnp.sqrt(cols)
    return {"a": a, "b": jnp.zeros((num_experts, rows, rank), jnp.float32)}


def adapter_output(adapter: dict, x: jax.Array) -> jax.Array:
    """``B_e A_e x`` for ``x [E, T, in]`` → ``[E, T, out]`` in the dtype of x (a zero row stays
    zero)."""
    a, b = adapter["a"].astype(x.dtype), adapter["b"].astype(x.dtype)
    return jnp.einsum("etr,eor->eto", jnp.einsum("eti,eri->etr", x, a), b)


def merged_kernel(kernel: jax.Array, adapter: dict) -> jax.Array:
    """A T5X-oriented expert kernel ``K[E, in, out]`` with the adapter folded in: ``K + (B A)ᵀ``
    (float32)."""
    delta = jnp.einsum(
        "eor,eri->eio", adapter["b"].astype(jnp.float32), adapter["a"].astype(jnp.float32)
    )
    return kernel.astype(jnp.float32) + delta
