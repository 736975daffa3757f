"""Tiny Switch checkpoints in the real T5X format, and calibration text, for tests."""

from __future__ import annotations

import dataclasses
import gzip
import json

import jax
import numpy as np

from helpers.text import synthetic_sentences
from qmoe_jax.checkpoints import write_t5x_checkpoint
from qmoe_jax.models import get_config, param_shapes

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
    """Random parameters of ``config``'s tree with the spreads of the model's initializers
    (models/: variance scaling over fan_in, truncated normal in the dense MLPs and logits, T5X's
    1/sqrt(d_kv) folded into the queries, routers N(0, 0.02²), embeddings N(0, 1), relative position
    tables uniform over fan_avg, norm scales 1), drawn in numpy: compiling ``init`` for the whole
    model costs seconds."""
    rng = np.random.default_rng(seed)

    def truncated(shape):  # N(0, 1) cut at ±2, rescaled to unit variance as in flax
        z = rng.standard_normal(shape)
        while (outside := np.abs(z) > 2).any():
            z[outside] = rng.standard_normal(int(outside.sum()))
        return z / 0.87962566103423978

    def draw(path, leaf):
        name = "/".join(str(key.key) for key in path)
        fan_in, fan_out = (leaf.shape[-2], leaf.shape[-1]) if leaf.ndim >= 2 else (1, 1)
        if name.endswith("/scale"):
            value = np.ones(leaf.shape)
        elif name.endswith("rel_embedding"):
            limit = np.sqrt(3 * config.init_scale / ((fan_in + fan_out) / 2))
            value = rng.uniform(-limit, limit, leaf.shape)
        elif name.endswith("embedding"):
            value = rng.standard_normal(leaf.shape)
        elif "/router/" in name:
            value = 0.02 * rng.standard_normal(leaf.shape)
        else:  # kernels
            std = np.sqrt(config.init_scale / fan_in)
            if "/query/" in name:
                std /= np.sqrt(config.d_kv)
            dense_mlp = ("/mlp/wi" in name or "/mlp/wo" in name) and "/expert/" not in name
            if dense_mlp or "logits_dense" in name:
                value = std * truncated(leaf.shape)
            else:
                value = std * rng.standard_normal(leaf.shape)
        return np.asarray(value, leaf.dtype)

    return jax.tree_util.tree_map_with_path(draw, param_shapes(config))


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
