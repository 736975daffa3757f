"""The compressed expert layer's three paths through the MoE layer: the tokens routed as they are
(the routed kernel, the default on the CPU), tokens dispatched into the ``[E, slots, d]`` buffer,
and each token multiplied by its own expert gathered out of the stacks (the per-token path)."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import compressed_data
from helpers.tiny_model import TINY

from qmoe_jax.models import MoeLayer
from qmoe_jax.models.compressed_experts import (
    CompressedMlpExperts,
    compressed_experts_cls,
    default_per_token_limit,
)
from qmoe_jax.models.lora import LORA

# The tiny model's config with 16 experts, a gated MLP, and capacity for every token (only the
# MoE layer runs here).
CONFIG = dataclasses.replace(
    TINY,
    name="compressed-experts",
    d_model=24,
    d_ff=40,
    num_experts=16,
    group_size=16,
    groups_multiple_of_experts=False,
    eval_capacity_factor=16.0,
    mlp_activations=("gelu", "linear"),
)


@pytest.fixture(scope="module")
def layer_params(dictionary):
    """Router, gated expert stacks (``wi_0``, ``wi_1``, ``wo``) and LoRA adapters of one layer."""
    rng = np.random.default_rng(3)
    e, d, f = CONFIG.num_experts, CONFIG.d_model, CONFIG.d_ff
    expert = {
        name: compressed_data.experts(rng, dictionary, e, rows, cols)[0]
        for name, rows, cols in (("wi_0", f, d), ("wi_1", f, d), ("wo", d, f))
    }
    adapters = {
        name: {
            "a": rng.normal(0, 0.3, (e, 2, cols)).astype(np.float32),
            "b": rng.normal(0, 0.3, (e, rows, 2)).astype(np.float32),
        }
        for name, rows, cols in (("wi_1", f, d), ("wo", d, f))
    }
    router = {"w": {"kernel": rng.normal(0, 1.0, (d, e)).astype(np.float32)}}
    return {"router": {"router_weights": router}, "expert": expert}, adapters


def apply(params, x, dictionary, **fields):
    layer = MoeLayer(
        CONFIG, functools.partial(CompressedMlpExperts, dictionaries={"": dictionary}, **fields)
    )
    return jax.jit(lambda p, x: layer.apply({"params": p}, x))(params, x)


@pytest.mark.parametrize("with_adapters", [False, True])
@pytest.mark.parametrize("batch", [1, 3])
def test_per_token_path_matches_dispatch(layer_params, dictionary, with_adapters, batch):
    params, adapters = layer_params
    if with_adapters:
        params = {**params, "expert": {**params["expert"], LORA: adapters}}
    x = jax.random.normal(jax.random.PRNGKey(batch), (batch, 1, CONFIG.d_model))
    dispatched = apply(params, x, dictionary, per_token_limit=0, routed=False)
    per_token = apply(params, x, dictionary, per_token_limit=batch, routed=False)
    routed = apply(params, x, dictionary)
    np.testing.assert_allclose(per_token, dispatched, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(routed, dispatched, rtol=1e-6, atol=1e-6)
    assert np.abs(np.asarray(per_token)).min(axis=-1).max() > 0  # every token reached an expert

    def loss(x, **fields):
        return jnp.sum(jnp.sin(apply(params, x, dictionary, **fields)))

    expected = jax.grad(loss)(x, per_token_limit=0, routed=False)
    gathered = jax.grad(loss)(x, per_token_limit=batch, routed=False)
    np.testing.assert_allclose(gathered, expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(jax.grad(loss)(x), expected, rtol=1e-5, atol=1e-6)


def test_per_token_path_reads_each_tokens_own_expert(layer_params, dictionary):
    """Two tokens routed to different experts: swapping the experts' codes changes both."""
    params, _ = layer_params
    x = jax.random.normal(jax.random.PRNGKey(7), (2, 1, CONFIG.d_model))
    logits = np.asarray(x[:, 0]) @ params["router"]["router_weights"]["w"]["kernel"]
    chosen = logits.argmax(-1)
    assert chosen[0] != chosen[1]
    before = apply(params, x, dictionary, per_token_limit=2, routed=False)
    swapped = {}
    for name, stack in params["expert"].items():
        order = np.arange(CONFIG.num_experts)
        order[chosen[0]], order[chosen[1]] = chosen[1], chosen[0]
        swapped[name] = type(stack)(
            stack.codes[order], stack.row_offsets[order], stack.minmax[order], stack.cols
        )
    after = apply({**params, "expert": swapped}, x, dictionary, per_token_limit=2, routed=False)
    expected = apply({**params, "expert": swapped}, x, dictionary, per_token_limit=0, routed=False)
    np.testing.assert_allclose(after, expected, rtol=1e-6, atol=1e-6)
    assert not np.allclose(after[0], before[0]) and not np.allclose(after[1], before[1])
    routed = apply({**params, "expert": swapped}, x, dictionary)
    np.testing.assert_allclose(routed, expected, rtol=1e-6, atol=1e-6)


def test_default_limit_follows_the_experts():
    assert [default_per_token_limit(e) for e in (1, 8, 16, 64, 128, 256, 2048)] == [
        0,
        0,
        1,
        4,
        8,
        16,
        16,
    ]
    layer = compressed_experts_cls({})(config=CONFIG)
    assert layer.gather_tokens == default_per_token_limit(CONFIG.num_experts) == 1
    assert compressed_experts_cls({})(config=CONFIG, per_token_limit=5).gather_tokens == 5


def test_expert_mesh_keeps_dispatching(layer_params, dictionary):
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("expert",))
    assert compressed_experts_cls({"": dictionary}, mesh)(config=CONFIG).gather_tokens == 0
    params, _ = layer_params
    x = jnp.ones((1, 1, CONFIG.d_model))
    with pytest.raises(ValueError, match="sharded over a mesh"):
        apply(params, x, dictionary, mesh=mesh, per_token_limit=1)


# T5X's grouping (G >= E groups once N is a multiple of E) with little capacity: 64 tokens in
# 16 groups of 4, 2 slots per expert and group, so tokens are dropped, several tokens share an
# expert, and the dispatch buffer has E * G * 2 = 512 rows for the 64 tokens.
T5X_GROUPS = dataclasses.replace(
    CONFIG, groups_multiple_of_experts=True, eval_capacity_factor=1.0, min_expert_capacity=2
)


def apply_with(config, params, x, dictionary, **fields):
    layer = MoeLayer(
        config, functools.partial(CompressedMlpExperts, dictionaries={"": dictionary}, **fields)
    )
    return jax.jit(lambda p, x: layer.apply({"params": p}, x, mutable=["intermediates"]))(params, x)


def test_routed_path_matches_dispatch_with_drops(layer_params, dictionary):
    params, adapters = layer_params
    params = {**params, "expert": {**params["expert"], LORA: adapters}}
    # Tokens near each other route alike, so that some experts overflow their 2 slots.
    x = jax.random.normal(jax.random.PRNGKey(0), (4, 1, CONFIG.d_model))
    x = x + 0.3 * jax.random.normal(jax.random.PRNGKey(1), (4, 16, CONFIG.d_model))
    dispatched, dispatched_metrics = apply_with(
        T5X_GROUPS, params, x, dictionary, per_token_limit=0, routed=False
    )
    routed, routed_metrics = apply_with(T5X_GROUPS, params, x, dictionary)
    np.testing.assert_allclose(routed, dispatched, rtol=1e-6, atol=1e-6)
    flat = jax.tree.leaves(routed_metrics)
    np.testing.assert_allclose(flat, jax.tree.leaves(dispatched_metrics), rtol=1e-6)
    dropped = np.abs(np.asarray(routed)).max(axis=-1) == 0
    assert 0 < dropped.sum() < dropped.size  # some tokens dropped, most kept

    def loss(x, **fields):
        return jnp.sum(jnp.sin(apply_with(T5X_GROUPS, params, x, dictionary, **fields)[0]))

    expected = jax.grad(loss)(x, per_token_limit=0, routed=False)
    # The two paths sum in different orders: float32 rounding is relative to the largest terms (the
    # gradient reaches about 12 here), not to each element (an element of 0.01 differed by 1.2e-6
    # with XLA:CPU's AVX-512 code on an Intel).
    scale = float(np.abs(expected).max())
    np.testing.assert_allclose(jax.grad(loss)(x), expected, rtol=1e-5, atol=1e-6 * scale)


def test_routed_program_has_no_dispatch_buffer(layer_params, dictionary):
    """The dispatch path's [E * G * slots, d] buffer (512 rows here) is in its program and not in
    the routed one, which holds the 64 tokens' rows."""
    params, _ = layer_params
    x = jnp.ones((4, 16, CONFIG.d_model))

    def program(**fields):
        layer = MoeLayer(
            T5X_GROUPS,
            functools.partial(CompressedMlpExperts, dictionaries={"": dictionary}, **fields),
        )
        return jax.jit(lambda p, x: layer.apply({"params": p}, x)).lower(params, x).as_text()

    buffer = f"512x{CONFIG.d_model}xf32"
    assert buffer in program(per_token_limit=0, routed=False)
    routed = program()
    assert buffer not in routed
    assert routed.count("custom_call @qmoe_matmul_routed") == 3  # wi_0, wi_1, wo


def test_routed_by_default_on_the_cpu_only_without_a_mesh():
    layer = compressed_experts_cls({})(config=CONFIG)
    assert layer.routes_tokens == (jax.default_backend() == "cpu")
    assert not compressed_experts_cls({})(config=CONFIG, routed=False).routes_tokens
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("expert",))
    assert not compressed_experts_cls({}, mesh)(config=CONFIG).routes_tokens


@pytest.mark.parametrize("fields", [dict(), dict(routed=False, per_token_limit=64)])
def test_every_path_drops_the_same_hidden_units(layer_params, dictionary, fields):
    """Training with dropout: the routed and per-token paths take the dispatch layout's mask (one
    row per expert, shared by its tokens), so the three paths give the same outputs."""
    params, _ = layer_params
    config = dataclasses.replace(T5X_GROUPS, dropout_rate=0.5)
    x = jax.random.normal(jax.random.PRNGKey(4), (4, 16, CONFIG.d_model))

    def apply_training(**fields):
        layer = MoeLayer(
            config, functools.partial(CompressedMlpExperts, dictionaries={"": dictionary}, **fields)
        )
        return layer.apply(
            {"params": params}, x, enable_dropout=True, rngs={"dropout": jax.random.PRNGKey(9)}
        )

    dispatched = apply_training(routed=False, per_token_limit=0)
    np.testing.assert_allclose(apply_training(**fields), dispatched, rtol=1e-6, atol=1e-6)
    without = MoeLayer(
        dataclasses.replace(config, dropout_rate=0.0),
        functools.partial(CompressedMlpExperts, dictionaries={"": dictionary}),
    ).apply({"params": params}, x, enable_dropout=True)
    assert not np.allclose(dispatched, without)  # the premise: dropout changed the outputs
