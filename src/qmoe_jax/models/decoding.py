"""Incremental decoding with the T5X-style ``cache`` collection, and greedy generation.

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
def init_cache(model: SwitchTransformer, params: Params, encoded: jax.Array,
               encoder_input_tokens: jax.Array, max_decode_length: int) -> Cache:
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
    _, variables = model.apply({"params": params}, encoded, encoder_input_tokens, dummy,
                               decode=True, mutable=["cache"], method="decode")
    return variables["cache"]


@functools.partial(jax.jit, static_argnames=("model",))
def decode_step(model: SwitchTransformer, params: Params, cache: Cache, encoded: jax.Array,
                encoder_input_tokens: jax.Array, tokens: jax.Array) -> tuple[jax.Array, Cache]:
    """Feeds ``tokens int32[B, L_q]`` at the cache's current position.

    Returns:
      ``(logits float32[B, L_q, V], updated cache)``; logits at query i predict
      the token after ``tokens[:, i]``.
    """
    logits, variables = model.apply({"params": params, "cache": cache}, encoded,
                                    encoder_input_tokens, tokens, decode=True,
                                    mutable=["cache"], method="decode")
    return logits, variables["cache"]


@functools.partial(jax.jit, static_argnames=("model", "max_decode_length"))
def greedy_generate(model: SwitchTransformer, params: Params, encoder_input_tokens: jax.Array,
                    max_decode_length: int, eos_id: int = 1) -> jax.Array:
    """Greedy decoding: argmax token at each step, until EOS or L_max tokens.

    Args:
      encoder_input_tokens: ``int32[B, L_enc]``, padded with 0.
      max_decode_length: L_max, tokens generated per sequence.
      eos_id: end-of-sequence id (T5: 1); later positions are 0. Traced, so
        changing it does not recompile; -1 never stops.
    Returns:
      ``int32[B, L_max]`` generated tokens (the start token is not included).
    """
    batch = encoder_input_tokens.shape[0]
    encoded = model.apply({"params": params}, encoder_input_tokens, method="encode")
    cache = init_cache(model, params, encoded, encoder_input_tokens, max_decode_length)

    def step(t, state):
        cache, previous, done, out = state
        logits, cache = decode_step(model, params, cache, encoded, encoder_input_tokens, previous[:, None])
        token = jnp.argmax(logits[:, 0], axis=-1).astype(jnp.int32)
        token = jnp.where(done, 0, token)
        out = out.at[:, t].set(token)
        return cache, token, done | (token == eos_id), out

    state = (cache, jnp.zeros((batch,), jnp.int32), jnp.zeros((batch,), bool),
             jnp.zeros((batch, max_decode_length), jnp.int32))
    return jax.lax.fori_loop(0, max_decode_length, step, state)[3]
