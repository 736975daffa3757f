"""A float32 model's decoding step runs its dense products through the CPU kernels
(``kernels.dense.kernel_matmul`` and ``rows_matmul``), and computes what XLA's dot does."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.tiny_model import TINY, init, run, shift_right

from qmoe_jax.kernels import bindings, dense
from qmoe_jax.models import decode_step, init_cache

GATED_UNTIED = dataclasses.replace(TINY, mlp_activations=("gelu", "linear"), logits_dense=True)


@pytest.fixture
def small_matrices_take_the_kernels(monkeypatch):
    """The tiny model's matrices take the float32 kernels (they are far below
    FLOAT32_KERNEL_MIN_WEIGHTS); the caches go, so that no program traced without the kernels is
    reused."""
    monkeypatch.setattr(dense, "FLOAT32_KERNEL_MIN_WEIGHTS", 0)
    jax.clear_caches()
    yield
    jax.clear_caches()


def _opened(config, batch, length=6):
    """A tiny model, its inputs, the encoder's outputs and an empty cache of ``length``."""
    model, params, encoder_tokens, targets = init(config, batch=batch, dec_len=length)
    encoded = run(model, params, encoder_tokens, method="encode")
    cache = init_cache(model, params, encoded, encoder_tokens, max_decode_length=length)
    return model, params, encoder_tokens, targets, encoded, cache


def _step_program(model, params, encoder_tokens, targets, encoded, cache) -> str:
    """The compiled HLO of one decoding step on the first decoder inputs."""
    step_tokens = shift_right(targets)[:, :1]
    lowered = decode_step.lower(model, params, cache, encoded, encoder_tokens, step_tokens)
    return lowered.compile().as_text()


@pytest.mark.parametrize("config", [TINY, GATED_UNTIED], ids=["tied", "gated-untied"])
@pytest.mark.usefixtures("small_matrices_take_the_kernels")
def test_decoding_step_runs_the_float32_kernels(config):
    # Teacher forcing runs 3 x length tokens per product: more than the kernels take.
    length = dense.float32_kernel_tokens() // 3 + 1
    opened = _opened(config, batch=3, length=length)
    model, params, encoder_tokens, targets, encoded, cache = opened
    hlo = _step_program(*opened)
    # Every dense kernel [in, out] of the step, and the tied logits on the embedding's rows.
    assert bindings.DENSE_MATMUL_TRANSPOSED in hlo
    assert (bindings.DENSE_MATMUL + '"' in hlo) != config.logits_dense
    # Decoding token by token (3 tokens per step: the kernels) gives the logits of teacher
    # forcing (XLA's dot).
    decoder_inputs = shift_right(targets)
    full = run(model, params, encoder_tokens, decoder_inputs, targets)
    steps = []
    for t in range(decoder_inputs.shape[1]):
        logits, cache = decode_step(
            model, params, cache, encoded, encoder_tokens, decoder_inputs[:, t : t + 1]
        )
        steps.append(logits)
    np.testing.assert_allclose(
        np.asarray(jnp.concatenate(steps, axis=1)), np.asarray(full), rtol=1e-5, atol=1e-5
    )


@pytest.mark.usefixtures("small_matrices_take_the_kernels")
def test_more_tokens_than_the_kernels_take_use_xla_dot():
    hlo = _step_program(*_opened(TINY, batch=dense.float32_kernel_tokens() + 1))
    assert "qmoe_dense" not in hlo


def test_a_small_models_matrices_keep_xla_dot():
    jax.clear_caches()
    assert "qmoe_dense" not in _step_program(*_opened(TINY, batch=1))
