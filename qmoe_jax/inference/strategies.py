"""Decoding strategies over the incremental decoder: greedy, sampling, beam search.

Lingo: B prompts, k beams, L = ``max_decode_length`` generated tokens (the
decoder start token 0 is not among them); after EOS a sequence emits padding
(0). Each strategy is one jitted program per (model, shapes, config): a
``lax.while_loop`` that feeds one token per step through the KV cache
(``models.incremental``) and stops early once every sequence has ended.

Beam search scores a hypothesis as ``log p / ((5 + length) / 6) ** alpha``,
T5X's brevity penalty with its default alpha = 0.6 (length counts generated
tokens, EOS included). Unlike T5X's separate pools of k alive and k finished
hypotheses, finished hypotheses stay in the beam with their score frozen, so
that beam size 1 is exactly greedy decoding.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from qmoe_jax.models.incremental import decode_step, init_cache
from qmoe_jax.models.switch import SwitchTransformer

METHODS = ("greedy", "sample", "beam")


@dataclasses.dataclass(frozen=True)
class DecodingConfig:
    """How tokens are chosen.

    Attributes:
      method: "greedy", "sample" or "beam".
      max_decode_length: L, tokens generated per sequence at most.
      temperature, top_k, top_p: sampling only; top_k 0 and top_p 1.0 are off.
      beam_size, alpha: beam search only (alpha: brevity-penalty exponent).
      eos_id: end of sequence (T5: 1).
    """

    method: str = "greedy"
    max_decode_length: int = 32
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    beam_size: int = 4
    alpha: float = 0.6
    eos_id: int = 1

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(
                f"unknown decoding method {self.method!r}; choose one of {', '.join(METHODS)}"
            )
        if self.max_decode_length < 1:
            raise ValueError(f"max_decode_length must be at least 1, got {self.max_decode_length}")
        if not 0 < self.temperature < math.inf:
            raise ValueError(f"temperature must be positive and finite, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be 0 (off) or positive, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.beam_size < 1:
            raise ValueError(f"beam_size must be at least 1, got {self.beam_size}")
        if not math.isfinite(self.alpha):
            raise ValueError(f"alpha must be a finite number, got {self.alpha}")


@dataclasses.dataclass(frozen=True)
class Decoded:
    """tokens int32[B, L] (0 after EOS); scores float32[B]: the sequences' log-probabilities
    (beam search: divided by the brevity penalty)."""

    tokens: jax.Array
    scores: jax.Array


def generate(
    model: SwitchTransformer,
    params,
    encoder_input_tokens: jax.Array,
    config: DecodingConfig,
    rng: jax.Array | None = None,
) -> Decoded:
    """Decodes ``encoder_input_tokens int32[B, L_enc]`` (padded with 0) with ``config``.

    ``rng`` (a PRNG key) is needed for sampling and ignored otherwise.
    """
    if config.method == "beam":
        tokens, scores = _beam_search(model, params, encoder_input_tokens, config)
    else:
        if config.method == "sample" and rng is None:
            raise ValueError("sampling needs a PRNG key (rng)")
        rng = jax.random.PRNGKey(0) if rng is None else rng
        tokens, scores = _sample(model, params, encoder_input_tokens, config, rng)
    return Decoded(tokens, scores)


def filter_logits(logits: jax.Array, temperature: float, top_k: int, top_p: float) -> jax.Array:
    """Logits ``[..., V]`` scaled by 1/temperature, with tokens outside the top k and outside the
    smallest set whose probability reaches top_p set to -inf (always keeping the most likely)."""
    logits = logits.astype(jnp.float32) / temperature
    if top_k:
        kth = jax.lax.top_k(logits, min(top_k, logits.shape[-1]))[0][..., -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if top_p < 1.0:
        ordered = jnp.sort(logits, axis=-1)[..., ::-1]
        before = jnp.cumsum(jax.nn.softmax(ordered, axis=-1), axis=-1) - jax.nn.softmax(
            ordered, axis=-1
        )
        kept = jnp.where(before < top_p, ordered, jnp.inf).min(axis=-1, keepdims=True)
        logits = jnp.where(logits < kept, -jnp.inf, logits)
    return logits


def first_argmax(x: jax.Array) -> jax.Array:
    """``jnp.argmax(x, axis=-1)`` (int32) of ``x [B, V]``: the first maximum, or the first NaN
    where a row has one. Two plain reductions, a max and then a min over the indices that hold
    it: XLA:CPU runs jnp.argmax's reduction of (value, index) pairs serially, and over 32128
    logits it was the costliest XLA operation of a decoding step (docs/measurements.md,
    decode_profile.py)."""
    top = jnp.max(x, axis=-1, keepdims=True)
    index = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    hits = (x == top) | jnp.isnan(x)
    return jnp.min(jnp.where(hits, index, x.shape[-1]), axis=-1)


@functools.partial(jax.jit, static_argnames=("model", "config"))
def _sample(model, params, encoder_input_tokens, config: DecodingConfig, rng):
    batch = encoder_input_tokens.shape[0]
    length = config.max_decode_length
    encoded = model.apply({"params": params}, encoder_input_tokens, method="encode")
    cache = init_cache(model, params, encoded, encoder_input_tokens, length)

    def running(state):
        t, _, _, done, _, _ = state
        return (t < length) & ~done.all()

    def step(state):
        t, cache, previous, done, out, scores = state
        logits, cache = decode_step(
            model, params, cache, encoded, encoder_input_tokens, previous[:, None]
        )
        log_probs = jax.nn.log_softmax(logits[:, 0].astype(jnp.float32), axis=-1)
        if config.method == "greedy":
            token = first_argmax(log_probs)
        else:
            filtered = filter_logits(logits[:, 0], config.temperature, config.top_k, config.top_p)
            token = jax.random.categorical(jax.random.fold_in(rng, t), filtered, axis=-1)
        token = jnp.where(done, 0, token.astype(jnp.int32))
        chosen = jnp.take_along_axis(log_probs, token[:, None], axis=-1)[:, 0]
        scores = scores + jnp.where(done, 0.0, chosen)
        return t + 1, cache, token, done | (token == config.eos_id), out.at[:, t].set(token), scores

    state = (
        jnp.int32(0),
        cache,
        jnp.zeros((batch,), jnp.int32),
        jnp.zeros((batch,), bool),
        jnp.zeros((batch, length), jnp.int32),
        jnp.zeros((batch,), jnp.float32),
    )
    _, _, _, _, out, scores = jax.lax.while_loop(running, step, state)
    return out, scores


def brevity_penalty(alpha: float, length: jax.Array) -> jax.Array:
    """T5X's length normalization ``((5 + length) / 6) ** alpha``."""
    return ((5.0 + length.astype(jnp.float32)) / 6.0) ** alpha


@functools.partial(jax.jit, static_argnames=("model", "config"))
def _beam_search(model, params, encoder_input_tokens, config: DecodingConfig):
    batch, k, length = encoder_input_tokens.shape[0], config.beam_size, config.max_decode_length
    flat = batch * k
    encoded = model.apply({"params": params}, encoder_input_tokens, method="encode")
    encoded, encoder_input_tokens = (
        jnp.repeat(x, k, axis=0) for x in (encoded, encoder_input_tokens)
    )
    cache = init_cache(model, params, encoded, encoder_input_tokens, length)

    def reorder(tree, flat_index):
        return jax.tree.map(lambda x: x[flat_index] if x.ndim and x.shape[0] == flat else x, tree)

    def running(state):
        t, _, _, finished, _, _, _ = state
        return (t < length) & ~finished.all()

    def step(state):
        t, cache, log_probs, finished, lengths, out, previous = state
        logits, cache = decode_step(
            model, params, cache, encoded, encoder_input_tokens, previous.reshape(flat, 1)
        )
        token_log_probs = jax.nn.log_softmax(logits[:, 0].astype(jnp.float32), axis=-1).reshape(
            batch, k, -1
        )
        vocab = token_log_probs.shape[-1]
        # A finished hypothesis has one continuation, padding, at no cost.
        stay = jnp.where(jnp.arange(vocab) == 0, 0.0, -jnp.inf)
        candidates = log_probs[..., None] + jnp.where(finished[..., None], stay, token_log_probs)
        candidate_lengths = lengths + (~finished).astype(jnp.int32)
        ranked = candidates / brevity_penalty(config.alpha, candidate_lengths)[..., None]
        _, best = jax.lax.top_k(ranked.reshape(batch, k * vocab), k)
        beam, token = best // vocab, (best % vocab).astype(jnp.int32)
        flat_index = (jnp.arange(batch)[:, None] * k + beam).reshape(flat)
        log_probs = jnp.take_along_axis(candidates.reshape(batch, k * vocab), best, axis=-1)
        lengths = jnp.take_along_axis(candidate_lengths, beam, axis=-1)
        finished = jnp.take_along_axis(finished, beam, axis=-1) | (token == config.eos_id)
        out = jnp.take_along_axis(out, beam[..., None], axis=1).at[:, :, t].set(token)
        return t + 1, reorder(cache, flat_index), log_probs, finished, lengths, out, token

    first_beam_only = jnp.where(jnp.arange(k) == 0, 0.0, -jnp.inf)
    state = (
        jnp.int32(0),
        cache,
        jnp.broadcast_to(first_beam_only, (batch, k)),
        jnp.zeros((batch, k), bool),
        jnp.zeros((batch, k), jnp.int32),
        jnp.zeros((batch, k, length), jnp.int32),
        jnp.zeros((batch, k), jnp.int32),
    )
    _, _, log_probs, _, lengths, out, _ = jax.lax.while_loop(running, step, state)
    scores = log_probs / brevity_penalty(config.alpha, lengths)
    best = jnp.argmax(scores, axis=-1)
    return (
        jnp.take_along_axis(out, best[:, None, None], axis=1)[:, 0],
        jnp.take_along_axis(scores, best[:, None], axis=1)[:, 0],
    )
