"""benchmarks/activation_sparsity.py counts an MLP's zero hidden units per calling module, over the
rows that hold a token."""

import pathlib
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))

import activation_sparsity

from qmoe_jax.models import mlp
from qmoe_jax.models.configs import get_config
from qmoe_jax.models.layers import DenseMlp


class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        config = get_config("switch-mini-8")
        return DenseMlp(config, name="mlp")(x)


def test_counts_zero_hidden_units_of_live_rows_by_module():
    config = get_config("switch-mini-8")
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 3, config.d_model))
    x = x.at[1, 2].set(0.0)  # an empty capacity slot: its hidden units are zeros, not counted
    block = Block()
    params = block.init(jax.random.PRNGKey(1), x)
    counter = activation_sparsity.ZeroCounter()
    original = mlp.activation
    with counter.counting():
        jax.jit(block.apply)(params, x).block_until_ready()
    jax.effects_barrier()
    assert mlp.activation is original  # restored on the way out

    kernel = params["params"]["mlp"]["wi"]["kernel"]
    pre = np.asarray(jnp.einsum("btd,df->btf", x, kernel))
    live = np.abs(pre).sum(-1) > 0
    expected = [int((pre[live] <= 0).sum()), int(live.sum()) * config.d_ff]
    assert live.sum() == 5
    assert dict(counter.counts) == {"mlp": expected}
    assert 0 < expected[0] < expected[1]
