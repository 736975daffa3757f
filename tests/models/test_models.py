"""Fast tests of qmoe_jax.models: configs, param tree, MoE routing/capacity, decoding, dtypes."""

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util
from helpers.tiny_model import (
    TINY,
    TINY_TREE,
    flat_shapes,
    init,
    random_params,
    run,
    shift_right,
    tokens,
)

from qmoe_jax.models import (
    MlpExperts,
    MoeLayer,
    SwitchConfig,
    SwitchTransformer,
    config_names,
    decode_step,
    dispatch,
    expert_capacity,
    expert_counts,
    get_config,
    init_cache,
    num_groups,
    param_shapes,
    route_top1,
    router_metrics,
)
from qmoe_jax.models.layers import relative_position_bucket

# ---------------------------------------------------------------- configs


def test_named_configs_follow_design():
    assert set(config_names()) == {
        "switch-base-8",
        "switch-base-16",
        "switch-base-32",
        "switch-base-64",
        "switch-base-128",
        "switch-base-256",
        "switch-large-128",
        "switch-xxl-128",
        "switch-c-2048",
        "switch-mini-8",
    }
    base = get_config("switch-base-128")
    assert (base.d_model, base.num_heads, base.d_kv, base.d_ff, base.num_experts) == (
        768,
        12,
        64,
        3072,
        128,
    )
    assert base.sparse_layers(decoder=False) == (1, 3, 5, 7, 9, 11)
    assert not base.logits_dense and base.mlp_activations == ("relu",)
    assert (
        base.checkpoint_path
        == "gs://t5-data/pretrained_models/t5x/moe/switch_classic/base/e128/checkpoint_550000"
    )
    assert get_config("switch-base-8").checkpoint_step == 500100
    xxl = get_config("switch-xxl-128")
    assert xxl.gated_mlp and xxl.logits_dense and xxl.eval_capacity_factor == 4.0
    c2048 = get_config("switch-c-2048")
    assert c2048.sparse_layers(decoder=True) == tuple(range(15))
    assert (c2048.eval_capacity_factor, c2048.min_expert_capacity, c2048.num_heads) == (2.0, 2, 30)
    mini = get_config("switch-mini-8")
    assert mini.vocab_size == 4224 and mini.vocab_size % 128 == 0
    # Every MLP of the bundled model is sparse (see the config comment for why).
    assert mini.sparse_layers(decoder=False) == (0, 1, 2, 3) and mini.sparse_layers(
        decoder=True
    ) == (0, 1, 2, 3)


def test_get_config_unknown_name_lists_known():
    with pytest.raises(KeyError, match=r"switch-base-8.*switch-c-2048"):
        get_config("switch-base-7")


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(num_encoder_sparse_layers=3), "divide num_encoder_layers"),
        (dict(mlp_activations=("relu", "gelu", "linear")), "one entry"),
        (dict(mlp_activations=("swish",)), "unknown activation"),
        (dict(dtype="float8"), "dtype"),
        (dict(d_model=0), "d_model must be positive"),
    ],
)
def test_invalid_config_errors(change, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(TINY, **change)


def test_config_dict_round_trip():
    config = get_config("switch-xxl-128")
    assert SwitchConfig.from_dict(config.to_dict()) == config
    with pytest.raises(ValueError, match="unknown SwitchConfig fields"):
        SwitchConfig.from_dict({**config.to_dict(), "num_layers": 3})


# ---------------------------------------------------------------- param tree


def test_param_tree_is_t5x():
    tree = param_shapes(TINY)
    assert {k: v.shape for k, v in traverse_util.flatten_dict(tree, sep="/").items()} == TINY_TREE
    assert {v.dtype for v in jax.tree.leaves(tree)} == {jnp.dtype(jnp.float32)}


@pytest.mark.parametrize(
    "name, count",
    [
        ("switch-c-2048", 1_571_327_875_360),  # the Switch paper's 1571B
        ("switch-mini-8", 9_726_976),
    ],
)
def test_parameter_counts(name, count):
    assert (
        sum(int(np.prod(p.shape)) for p in jax.tree.leaves(param_shapes(get_config(name)))) == count
    )


@pytest.mark.slow
def test_initializers_follow_t5x():
    config = dataclasses.replace(
        TINY,
        d_model=64,
        num_heads=4,
        d_kv=16,
        d_ff=96,
        init_scale=1.0,
        num_encoder_layers=1,
        num_decoder_layers=1,
    )
    model = SwitchTransformer(config)
    encoder_tokens = tokens(0, (1, 4))
    params = traverse_util.flatten_dict(
        jax.jit(model.init)(jax.random.PRNGKey(0), encoder_tokens, encoder_tokens, encoder_tokens)[
            "params"
        ],
        sep="/",
    )
    std = {k: float(np.std(v)) for k, v in params.items()}
    np.testing.assert_allclose(std["token_embedder/embedding"], 1.0, rtol=0.1)
    np.testing.assert_allclose(
        std["encoder/layers_0/mlp/router/router_weights/w/kernel"], 0.02, rtol=0.15
    )
    # Variance scaling over fan_in; T5X folds 1/sqrt(d_kv) into the query kernel.
    np.testing.assert_allclose(std["encoder/layers_0/attention/key/kernel"], 64**-0.5, rtol=0.1)
    np.testing.assert_allclose(
        std["encoder/layers_0/attention/query/kernel"], (64 * 16) ** -0.5, rtol=0.1
    )
    np.testing.assert_allclose(std["encoder/layers_0/mlp/expert/wo/kernel"], 96**-0.5, rtol=0.1)
    assert (params["decoder/decoder_norm/scale"] == 1).all()


def test_gated_untied_tree_and_forward():
    config = dataclasses.replace(TINY, mlp_activations=("gelu", "linear"), logits_dense=True)
    model, params, encoder_tokens, targets = init(config)
    shapes = flat_shapes(params)
    expected = {k: v for k, v in TINY_TREE.items() if "/wi/" not in k}
    for stack in ("encoder", "decoder"):
        for gate in ("wi_0", "wi_1"):
            expected[f"{stack}/layers_0/mlp/{gate}/kernel"] = (16, 24)
            expected[f"{stack}/layers_1/mlp/expert/{gate}/kernel"] = (4, 16, 24)
    expected["decoder/logits_dense/kernel"] = (16, 64)
    assert shapes == expected
    logits = run(model, params, encoder_tokens, shift_right(targets), targets)
    assert logits.shape == (2, 6, 64) and bool(jnp.isfinite(logits).all())


def test_relative_position_buckets_t5():
    # Bidirectional, 32 buckets: exact for |r| < 8, logarithmic up to 128, then clamped.
    relative = np.array([0, -1, -7, -8, -12, -127, -500, 1, 7, 500])
    assert relative_position_bucket(relative, True, 32, 128).tolist() == [
        0,
        1,
        7,
        8,
        9,
        15,
        15,
        17,
        23,
        31,
    ]
    # Causal: future positions share bucket 0.
    assert relative_position_bucket(np.array([3, 0, -1, -20]), False, 32, 128).tolist() == [
        0,
        0,
        1,
        17,
    ]


# ---------------------------------------------------------------- MoE


def test_num_groups_follows_t5x():
    assert num_groups(4096, 4096, 8, True) == 8
    assert num_groups(32768, 8192, 128, True) == 128
    assert num_groups(1 << 20, 4096, 8, True) == 256
    assert num_groups(3, 4096, 8, True) == 1  # no multiple of E divides N: plain rule
    assert num_groups(4096, 1000, 8, False) == 8
    assert num_groups(96, 4096, 8, False) == 1


def test_expert_capacity_rounding():
    assert expert_capacity(512, 8, 1.25, 4) == 80
    assert expert_capacity(20, 8, 1.0, 1) == 2  # round(2.5) = 2, as Python/T5X
    assert expert_capacity(4, 128, 2.0, 4) == 4


def moe_config(**change):
    values = dict(
        d_model=8,
        d_ff=12,
        group_size=16,
        groups_multiple_of_experts=False,
        eval_capacity_factor=1.0,
        train_capacity_factor=2.0,
        min_expert_capacity=1,
    )
    return dataclasses.replace(TINY, **{**values, **change})


def one_expert_params(config, expert):
    """Router that sends every positive input to ``expert``; random expert MLPs."""
    layer = MoeLayer(config)
    params = random_params(layer, jnp.ones((1, 16, config.d_model)), seed=3)
    kernel = np.zeros((config.d_model, config.num_experts), np.float32)
    kernel[:, expert] = 1.0
    params["router"]["router_weights"]["w"]["kernel"] = jnp.asarray(kernel)
    return layer, params


def expert_mlp(params, expert, x):
    wi = params["expert"]["wi"]["kernel"][expert]
    wo = params["expert"]["wo"]["kernel"][expert]
    return jax.nn.relu(x @ wi) @ wo


@pytest.mark.parametrize("enable_dropout, capacity", [(False, 4), (True, 8)], ids=["eval", "train"])
def test_capacity_drops_overflow_tokens(enable_dropout, capacity):
    config = moe_config()
    layer, params = one_expert_params(config, expert=2)
    x = jnp.asarray(
        np.random.default_rng(0).uniform(0.1, 1.0, (1, 16, config.d_model)), jnp.float32
    )
    out, state = run(
        layer,
        params,
        x,
        enable_dropout=enable_dropout,
        rngs={"dropout": jax.random.PRNGKey(0)},
        mutable=("intermediates",),
    )
    out = np.asarray(out[0])
    logits = np.asarray(x[0]).sum(-1, keepdims=True)
    gate = np.exp(logits) / (np.exp(logits) + config.num_experts - 1)
    expected = np.asarray(expert_mlp(params, 2, x[0])) * gate
    np.testing.assert_allclose(out[:capacity], expected[:capacity], rtol=1e-5, atol=1e-6)
    assert (out[capacity:] == 0).all() and (np.abs(out[:capacity]).sum(-1) > 0).all()
    metrics = router_metrics(state["intermediates"])
    np.testing.assert_allclose(metrics["fraction_tokens_left_behind"], 1 - capacity / 16, rtol=1e-6)
    # Switch eq. 4: all tokens on expert 2, so loss = E² · (1/E) · mean(P_2) = E · mean(gate).
    np.testing.assert_allclose(
        metrics["auxiliary_loss"], config.num_experts * gate.mean(), rtol=1e-5
    )


def reference_moe(params, x, config, groups, capacity):
    """Per-token loop: earlier tokens of a group fill an expert's slots first."""
    tokens = np.asarray(x).reshape(groups, -1, x.shape[-1])
    logits = tokens @ np.asarray(params["router"]["router_weights"]["w"]["kernel"])
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    out = np.zeros_like(tokens)
    for g in range(groups):
        used = np.zeros(config.num_experts, int)
        for t in range(tokens.shape[1]):
            e = int(np.argmax(probs[g, t]))
            if used[e] < capacity:
                out[g, t] = np.asarray(expert_mlp(params, e, tokens[g, t])) * probs[g, t, e]
            used[e] += 1
    return out.reshape(x.shape)


def test_moe_matches_per_token_reference_with_groups_and_drops():
    config = moe_config(group_size=12, eval_capacity_factor=0.75)
    layer = MoeLayer(config)
    x = jax.random.normal(jax.random.PRNGKey(5), (3, 16, config.d_model))
    params = random_params(layer, x, seed=6)
    params["router"]["router_weights"]["w"]["kernel"] *= 50.0  # decisive, uneven routing
    groups = num_groups(48, 12, config.num_experts, False)
    capacity = expert_capacity(48 // groups, config.num_experts, 0.75, 1)
    assert (groups, capacity) == (4, 2)
    out, state = run(layer, params, x, mutable=("intermediates",))
    np.testing.assert_allclose(
        out, reference_moe(params, x, config, groups, capacity), rtol=1e-5, atol=1e-6
    )
    assert router_metrics(state["intermediates"])["fraction_tokens_left_behind"] > 0


@pytest.mark.parametrize("batch, length", [(1, 1), (3, 16)])
def test_gathered_dense_experts_match_the_all_expert_layout(batch, length):
    """Per-token kernels W[expert_index] against T5X's every-expert-every-slot einsum, drops
    included."""
    config = moe_config(group_size=12, eval_capacity_factor=0.75, min_expert_capacity=1)
    x = jax.random.normal(jax.random.PRNGKey(5), (batch, length, config.d_model))
    params = random_params(MoeLayer(config), x, seed=6)
    params["router"]["router_weights"]["w"]["kernel"] *= 50.0
    einsum = run(MoeLayer(config, functools.partial(MlpExperts, gather_tokens=0)), params, x)
    gathered = run(
        MoeLayer(config, functools.partial(MlpExperts, gather_tokens=batch * length)), params, x
    )
    np.testing.assert_allclose(gathered, einsum, rtol=1e-5, atol=1e-6)
    assert (np.abs(np.asarray(einsum)).sum(-1) == 0).any() == (
        batch > 1
    )  # the larger call drops tokens


def test_gathered_dense_experts_drop_the_all_expert_layouts_hidden_units():
    """Training with dropout: the per-token path takes the [E, T, f] layout's mask (one row per
    expert, shared by its tokens), so both give the same outputs."""
    config = moe_config(dropout_rate=0.5, train_capacity_factor=4.0)
    x = jax.random.normal(jax.random.PRNGKey(5), (2, 6, config.d_model))
    params = random_params(MoeLayer(config), x, seed=6)

    def train(gather_tokens: int, rate: float = 0.5):
        layer = MoeLayer(
            dataclasses.replace(config, dropout_rate=rate),
            functools.partial(MlpExperts, gather_tokens=gather_tokens),
        )
        rngs = {"dropout": jax.random.PRNGKey(3)}
        return layer.apply({"params": params}, x, enable_dropout=True, rngs=rngs)

    np.testing.assert_allclose(train(12), train(0), rtol=1e-5, atol=1e-6)
    assert not np.allclose(train(0), train(0, rate=0.0))  # the premise: dropout changed them


@pytest.mark.slow
def test_dispatch_fills_each_expert_from_its_first_row():
    config = moe_config()
    logits = jax.random.normal(jax.random.PRNGKey(0), (3, 10, config.num_experts)) * 5
    routing = route_top1(logits, capacity=2)
    tokens = jnp.ones((3, 10, 4))
    buffer = np.asarray(dispatch(tokens, routing, config.num_experts, 2))
    counts = np.asarray(expert_counts(routing, config.num_experts))
    assert counts.sum() == int(routing.kept.sum()) and buffer.shape == (config.num_experts, 6, 4)
    for expert, count in enumerate(counts):
        assert (buffer[expert, :count] == 1).all() and (buffer[expert, count:] == 0).all()


def test_router_metrics_needs_sparse_layers():
    with pytest.raises(ValueError, match="no sown router metric"):
        router_metrics({})


class ScaledExperts(nn.Module):
    """A stand-in expert layer with its own parameters, to test pluggability."""

    config: SwitchConfig

    @nn.compact
    def __call__(self, expert_inputs, counts=None, *, enable_dropout=False):
        scale = self.param("scale", nn.initializers.ones, (self.config.num_experts, 1, 1))
        return expert_inputs * scale


def test_experts_layer_is_pluggable():
    model, params, encoder_tokens, targets = init(TINY, experts_cls=ScaledExperts)
    shapes = flat_shapes(params)
    assert shapes["encoder/layers_1/mlp/expert/scale"] == (4, 1, 1)
    assert not any("/expert/wi" in k for k in shapes)
    logits = run(model, params, encoder_tokens, shift_right(targets), targets)
    assert logits.shape == (2, 6, 64)


# ---------------------------------------------------------------- model behaviour


@pytest.mark.slow
def test_padding_does_not_leak_into_valid_positions():
    model, params, encoder_tokens, targets = init(TINY)
    logits = run(model, params, encoder_tokens, shift_right(targets), targets)
    padded_encoder = jnp.concatenate([encoder_tokens, jnp.zeros((2, 4), jnp.int32)], axis=1)
    padded_targets = jnp.concatenate([targets, jnp.zeros((2, 3), jnp.int32)], axis=1)
    padded = run(model, params, padded_encoder, shift_right(padded_targets), padded_targets)
    # Groups grow with the padding, but capacity (min 4 per group) never binds here.
    np.testing.assert_allclose(padded[:, :6], logits, rtol=1e-5, atol=1e-5)
    assert (padded[:, 7:] == 0).all()  # flaxformer's logit mask zeroes padded positions


@pytest.mark.slow
def test_dropout_is_seeded_and_off_at_eval():
    config = dataclasses.replace(TINY, dropout_rate=0.3)
    model, params, encoder_tokens, targets = init(config)
    inputs = (encoder_tokens, shift_right(targets), targets)
    deterministic = run(model, params, *inputs)
    np.testing.assert_array_equal(deterministic, run(SwitchTransformer(TINY), params, *inputs))

    def train(key):
        return run(model, params, *inputs, enable_dropout=True, rngs={"dropout": key})

    a, b, c = (
        train(jax.random.PRNGKey(1)),
        train(jax.random.PRNGKey(1)),
        train(jax.random.PRNGKey(2)),
    )
    np.testing.assert_array_equal(a, b)
    assert np.abs(a - c).max() > 1e-3 and np.abs(a - deterministic).max() > 1e-3


@pytest.mark.slow
def test_gradients_reach_every_parameter():
    model, params, encoder_tokens, targets = init(TINY)

    def loss(p):
        logits = model.apply({"params": p}, encoder_tokens, shift_right(targets), targets)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], -1))

    grads = jax.jit(jax.grad(loss))(params)
    for path, grad in traverse_util.flatten_dict(grads, sep="/").items():
        assert bool(jnp.isfinite(grad).all()), path
        assert float(jnp.abs(grad).max()) > 0, path


@pytest.mark.slow
def test_bfloat16_run_close_to_float32():
    model, params, encoder_tokens, targets = init(TINY)
    inputs = (encoder_tokens, shift_right(targets), targets)
    reference = run(model, params, *inputs)
    config = dataclasses.replace(TINY, param_dtype="bfloat16", dtype="bfloat16")
    bf16_params = jax.tree.map(lambda p: p.astype(jnp.bfloat16), params)
    logits = jax.jit(SwitchTransformer(config).apply)({"params": bf16_params}, *inputs)
    assert logits.dtype == jnp.float32
    spread = float(jnp.abs(reference).max())
    assert float(jnp.abs(logits - reference).max()) < 0.05 * spread
    created = jax.eval_shape(SwitchTransformer(config).init, jax.random.PRNGKey(0), *inputs)[
        "params"
    ]
    assert {p.dtype for p in jax.tree.leaves(created)} == {jnp.dtype(jnp.bfloat16)}


# ---------------------------------------------------------------- decoding


@pytest.mark.slow
def test_incremental_decoding_matches_teacher_forcing():
    model, params, encoder_tokens, targets = init(TINY)
    encoder_tokens = encoder_tokens.at[1, 5:].set(0)  # encoder padding is masked in both paths
    decoder_inputs = shift_right(targets)
    full = run(model, params, encoder_tokens, decoder_inputs, targets)
    encoded = run(model, params, encoder_tokens, method="encode")
    cache = init_cache(model, params, encoded, encoder_tokens, max_decode_length=6)
    # A 3-token prefill, then one token per step, continuing the same cache.
    logits, cache = decode_step(
        model, params, cache, encoded, encoder_tokens, decoder_inputs[:, :3]
    )
    steps = [logits]
    for t in range(3, 6):
        # Cross-attention keys/values come from the cache, not from `encoded`.
        logits, cache = decode_step(
            model,
            params,
            cache,
            jnp.zeros_like(encoded),
            encoder_tokens,
            decoder_inputs[:, t : t + 1],
        )
        steps.append(logits)
    np.testing.assert_allclose(jnp.concatenate(steps, axis=1), full, rtol=1e-5, atol=1e-5)
    assert int(cache["decoder"]["cache_index"]) == 6
    past_end, _ = decode_step(model, params, cache, encoded, encoder_tokens, decoder_inputs[:, :1])
    assert bool(jnp.isnan(past_end).all())
