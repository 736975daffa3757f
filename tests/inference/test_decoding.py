import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.tiny_model import TINY, init, run, shift_right

from qmoe_jax.inference.strategies import (
    DecodingConfig,
    _sample,
    filter_logits,
    first_argmax,
    generate,
)

GREEDY = DecodingConfig(method="greedy", max_decode_length=6, eos_id=-1)


def sequence_log_probs(model, params, encoder_tokens, generated):
    """Teacher-forced log p of each row of ``generated`` (positions up to and including the first
    EOS=-1: all)."""
    logits = run(model, params, encoder_tokens, shift_right(generated), generated)
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return jnp.take_along_axis(log_probs, generated[..., None], axis=-1)[..., 0].sum(-1)


@pytest.mark.slow
def test_greedy_is_argmax_and_stops_at_eos():
    model, params, encoder_tokens, _ = init(TINY)
    decoded = generate(model, params, encoder_tokens, GREEDY)
    generated = decoded.tokens
    assert generated.shape == (2, 6) and generated.dtype == jnp.int32
    assert (generated > 0).all()  # so teacher forcing below sees no padding
    logits = run(model, params, encoder_tokens, shift_right(generated), generated)
    np.testing.assert_array_equal(jnp.argmax(logits, -1), generated)
    np.testing.assert_allclose(
        decoded.scores,
        sequence_log_probs(model, params, encoder_tokens, generated),
        rtol=1e-5,
        atol=1e-5,
    )

    eos = int(generated[0, 2])
    stopped = generate(
        model, params, encoder_tokens, dataclasses.replace(GREEDY, eos_id=eos)
    ).tokens
    first_eos = int(np.argmax(np.asarray(generated[0]) == eos))
    np.testing.assert_array_equal(stopped[0, : first_eos + 1], generated[0, : first_eos + 1])
    assert (stopped[0, first_eos + 1 :] == 0).all()


@pytest.mark.parametrize("eos_id", [-1, pytest.param(5, marks=pytest.mark.slow)])
def test_beam_search_of_one_beam_is_greedy(eos_id):
    model, params, encoder_tokens, _ = init(TINY)
    greedy = generate(model, params, encoder_tokens, dataclasses.replace(GREEDY, eos_id=eos_id))
    beam = generate(
        model,
        params,
        encoder_tokens,
        DecodingConfig(method="beam", beam_size=1, max_decode_length=6, eos_id=eos_id),
    )
    np.testing.assert_array_equal(beam.tokens, greedy.tokens)


@pytest.mark.slow
def test_beam_search_as_wide_as_the_vocabulary_finds_the_best_pair():
    """With k = V beams and two tokens, every first token survives, so the result is the exact
    argmax of log p over all V² sequences (alpha = 0: plain log-probability)."""
    model, params, encoder_tokens, _ = init(TINY)
    vocab = TINY.vocab_size
    beam = generate(
        model,
        params,
        encoder_tokens,
        DecodingConfig(method="beam", beam_size=vocab, max_decode_length=2, alpha=0.0, eos_id=-1),
    )
    pairs = jnp.stack(
        jnp.meshgrid(jnp.arange(vocab), jnp.arange(vocab), indexing="ij"), -1
    ).reshape(-1, 2)
    for row in range(encoder_tokens.shape[0]):
        # Token 0 is padding: a pair holding it is not a 2-token sequence in teacher forcing.
        candidates = pairs[(pairs > 0).all(-1)].astype(jnp.int32)
        scores = sequence_log_probs(
            model, params, jnp.repeat(encoder_tokens[row : row + 1], len(candidates), 0), candidates
        )
        best = int(jnp.argmax(scores))
        np.testing.assert_array_equal(beam.tokens[row], candidates[best])
        np.testing.assert_allclose(beam.scores[row], scores[best], rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_sampling_is_reproducible_with_a_seed_and_varies_without():
    model, params, encoder_tokens, _ = init(TINY)
    config = DecodingConfig(method="sample", max_decode_length=6, temperature=2.0, eos_id=-1)
    first = generate(model, params, encoder_tokens, config, jax.random.PRNGKey(7)).tokens
    again = generate(model, params, encoder_tokens, config, jax.random.PRNGKey(7)).tokens
    other = generate(model, params, encoder_tokens, config, jax.random.PRNGKey(8)).tokens
    np.testing.assert_array_equal(first, again)
    assert not np.array_equal(first, other)
    with pytest.raises(ValueError, match="needs a PRNG key"):
        generate(model, params, encoder_tokens, config)


@pytest.mark.slow
def test_sampling_with_top_k_1_is_greedy():
    model, params, encoder_tokens, _ = init(TINY)
    greedy = generate(model, params, encoder_tokens, GREEDY).tokens
    sampled = generate(
        model,
        params,
        encoder_tokens,
        DecodingConfig(method="sample", max_decode_length=6, top_k=1, eos_id=-1),
        jax.random.PRNGKey(0),
    ).tokens
    np.testing.assert_array_equal(sampled, greedy)


def test_first_argmax_is_jnp_argmax_with_ties_nans_and_infinities():
    rng = np.random.default_rng(0)
    rows = rng.standard_normal((6, 32128)).astype(np.float32)
    rows[1, [7, 900, 31000]] = 9.0  # ties: the first one wins
    rows[2, [50, 60]] = np.nan  # a NaN wins, the first one
    rows[3] = -np.inf
    rows[4, 123] = np.inf
    rows[5] = np.round(rows[5])  # many ties among small integers
    for x in (rows, rows[:1], rows[:, :5]):
        expected = np.asarray(jnp.argmax(jnp.asarray(x), axis=-1))
        got = jax.jit(first_argmax)(jnp.asarray(x))
        assert got.dtype == jnp.int32
        np.testing.assert_array_equal(got, expected)
    assert first_argmax(jnp.asarray(rows))[:3].tolist() == [
        int(np.argmax(rows[0])),
        7,
        50,
    ]


def test_filter_logits_keeps_the_top_k_and_the_nucleus():
    logits = jnp.log(jnp.asarray([[0.5, 0.2, 0.15, 0.1, 0.05]]))

    def kept(f):
        return np.isfinite(np.asarray(f))[0].tolist()

    assert kept(filter_logits(logits, 1.0, 2, 1.0)) == [True, True, False, False, False]
    assert kept(filter_logits(logits, 1.0, 0, 0.7)) == [True, True, False, False, False]
    assert kept(filter_logits(logits, 1.0, 0, 0.71)) == [True, True, True, False, False]
    assert kept(filter_logits(logits, 1.0, 0, 0.01)) == [True, False, False, False, False]
    np.testing.assert_allclose(filter_logits(logits, 2.0, 0, 1.0), logits / 2.0, rtol=1e-6)


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("method", "nucleus", "unknown decoding method"),
        ("max_decode_length", 0, "max_decode_length"),
        ("temperature", 0.0, "temperature"),
        ("top_p", 0.0, "top_p"),
        ("beam_size", 0, "beam_size"),
    ],
)
def test_decoding_config_rejects_bad_settings(field, value, message):
    with pytest.raises(ValueError, match=message):
        DecodingConfig(**{field: value})


def _while_bodies(hlo: str) -> list[str]:
    """The text of every while loop's body computation in optimized HLO text."""
    bodies = []
    for body in re.findall(r"while\(.*?, body=%?([\w.\-]+)", hlo):
        start = hlo.index(f"{body} (")
        bodies.append(hlo[start : hlo.index("\n}\n", start)])
    return bodies


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_decoding_loop_updates_the_attention_caches_in_place(dtype):
    """No copy of a self-attention cache in the compiled greedy loop: each step reads the old
    cache, then writes its keys and values into it where it is (the update depends on the
    products that read it). Copying each cache twice per step cost 48 copies per token on a
    switch-base-shaped model (docs/measurements.md, decode_profile.py)."""
    config = dataclasses.replace(TINY, dtype=dtype)
    model, params, encoder_tokens, _ = init(config, batch=1)
    length = 9
    hlo = (
        _sample.lower(model, params, encoder_tokens, DecodingConfig(max_decode_length=length), None)
        .compile()
        .as_text()
    )
    (body,) = _while_bodies(hlo)
    # Self-attention caches: key [1, h, k, L], value [1, h, L, k] with L = the decode length.
    h, k = config.num_heads, config.d_kv
    cache_shapes = {f"[1,{h},{k},{length}]", f"[1,{h},{length},{k}]"}
    assert body.count("dynamic-update-slice") >= 2 * config.num_decoder_layers
    copies = [line.strip() for line in body.splitlines() if " copy(" in line]
    cached = [line for line in copies if any(shape in line.split("=")[1] for shape in cache_shapes)]
    assert not cached, cached
