"""Tiny Switch checkpoints in the real T5X format, and calibration text, for tests."""

from __future__ import annotations

import dataclasses
import gzip
import json

import jax
import jax.numpy as jnp

from helpers.text import synthetic_sentences
from qmoe_jax.checkpoints import write_t5x_checkpoint
from qmoe_jax.models import SwitchTransformer, get_config

TINY = dataclasses.replace(
    get_config("switch-mini-8"),
    name="switch-tiny-test",
    vocab_size=192,
    d_model=32,
    num_heads=2,
    d_kv=16,
    d_ff=64,
    num_encoder_layers=2,
    num_decoder_layers=2,
    num_experts=4,
    num_encoder_sparse_layers=1,
    num_decoder_sparse_layers=1,
    dropout_rate=0.0,
    group_size=256,
    checkpoint_path=None,
)


def random_params(config, seed: int = 0) -> dict:
    tokens = jnp.ones((1, 8), jnp.int32)
    params = SwitchTransformer(config).init(jax.random.PRNGKey(seed), tokens, tokens, tokens)[
        "params"
    ]
    return jax.device_get(params)


def write_tiny_checkpoint(directory, config=TINY, seed: int = 0) -> str:
    """A random ``config`` model written as a legacy T5X checkpoint in bfloat16; returns its
    path."""
    return write_t5x_checkpoint(
        str(directory), random_params(config, seed), step=1, dtype="bfloat16"
    )


def write_calibration_text(path, sentences: int = 600, seed: int = 1) -> str:
    path.write_text("\n".join(synthetic_sentences(sentences, seed)))
    return str(path)


def write_c4_shard(path, texts) -> None:
    """One C4 shard in allenai/c4's layout: gzipped JSON lines with text, timestamp and url."""
    with gzip.open(path, "wt", encoding="utf-8") as f:
        for text in texts:
            f.write(
                json.dumps(
                    {
                        "text": text,
                        "timestamp": "2019-04-25T12:57:54Z",
                        "url": "https://example.org",
                    }
                )
                + "\n"
            )
