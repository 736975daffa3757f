"""Incremental decoding with the T5X-style ``cache`` collection (strategies:
``qmoe_jax.inference.strategies``).

Lingo: L_max = decode length (cache slots); the decoder starts from token 0
(PAD = decoder start), feeds one token per step and reads the next-token logits;
after EOS a sequence emits padding (0).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from qmoe_jax.models.switch import SwitchTransformer

Params = Any
Cache = Any


@functools.partial(jax.jit, static_argnames=("model", "max_decode_length"))
def init_cache(
    model: SwitchTransformer,
    params: Params,
    encoded: jax.Array,
    encoder_input_tokens: jax.Array,
    max_decode_length: int,
) -> Cache:
    """Creates an empty decoder cache for ``B = encoded.shape[0]`` sequences of L_max tokens.

    Args:
      encoded: encoder outputs ``[B, L_enc, d]`` (``model.apply(..., method="encode")``).
      encoder_input_tokens: ``int32[B, L_enc]``.
      max_decode_length: L_max, the number of decoder positions the cache holds.
    Returns:
      the ``cache`` collection for ``decode_step``.
    """
    if max_decode_length < 1:
        raise ValueError(f"max_decode_length must be >= 1, got {max_decode_length}")
    batch = encoded.shape[0]
    dummy = jnp.zeros((batch, max_decode_length), jnp.int32)
    _, variables = model.apply(
        {"params": params},
        encoded,
        encoder_input_tokens,
        dummy,
        decode=True,
        mutable=["cache"],
        method="decode",
    )
    return variables["cache"]


@functools.partial(jax.jit, static_argnames=("model",))
def decode_step(
    model: SwitchTransformer,
    params: Params,
    cache: Cache,
    encoded: jax.Array,
    encoder_input_tokens: jax.Array,
    tokens: jax.Array,
) -> tuple[jax.Array, Cache]:
    """Feeds ``tokens int32[B, L_q]`` at the cache's current position.

    Returns:
      ``(logits float32[B, L_q, V], updated cache)``; logits at query i predict
      the token after ``tokens[:, i]``.
    """
    logits, variables = model.apply(
        {"params": params, "cache": cache},
        encoded,
        encoder_input_tokens,
        tokens,
        decode=True,
        mutable=["cache"],
        method="decode",
    )
    return logits, variables["cache"]
