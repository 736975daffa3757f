"""The compressed MoE layer inside flaxformer (interop/t5x_moe.py) against flaxformer's own MoeLayer
on the dequantized experts, and the gin files that swap it into flaxformer's Switch models."""

import dataclasses
import os
import re

import pytest
from helpers.t5x_env import skip_without_t5x, source_roots

skip_without_t5x()

import flax.linen as nn  # noqa: E402
import gin  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import traverse_util  # noqa: E402
from flaxformer.architectures.moe import moe_layers  # noqa: E402

from qmoe_jax.inference.compressed_params import load_compressed_model  # noqa: E402
from qmoe_jax.interop.gin_flags import CONFIGS_DIR  # noqa: E402
from qmoe_jax.interop.t5x_layout import COLLECTION, LayoutError, read_layout  # noqa: E402
from qmoe_jax.interop.t5x_moe import (  # noqa: E402
    CompressedMoeLayer,
    compressed_moe_layer,
    switch_moe_layer,
)

pytestmark = pytest.mark.t5x


class Block(nn.Module):
    mlp: nn.Module

    def __call__(self, x, enable_dropout):
        return self.mlp(x, enable_dropout=enable_dropout)


class Stack(nn.Module):
    layers_1: nn.Module

    def __call__(self, x, enable_dropout):
        return self.layers_1(x, enable_dropout)


class Root(nn.Module):
    """Puts a layer at ``encoder/layers_1/mlp``, where the tiny model's sparse layer is."""

    encoder: nn.Module

    def __call__(self, x, enable_dropout=False):
        return self.encoder(x, enable_dropout)


def at_sparse_layer(layer):
    return Root(Stack(Block(layer)))


def layer_variables(directory):
    """(flaxformer's variables with dequantized experts, the compressed layer's variables)."""
    dense_model = load_compressed_model(directory, experts="dense")
    compressed = load_compressed_model(directory, experts="compressed")
    name = ("encoder", "layers_1", "mlp")
    mlp = dense_model.params["encoder"]["layers_1"]["mlp"]
    dense_params = {"router": mlp["router"], "expert": mlp["expert"]}
    codes = {
        kernel: {"codes": w.codes, "row_offsets": w.row_offsets, "minmax": w.minmax}
        for kernel, w in compressed.params["encoder"]["layers_1"]["mlp"]["expert"].items()
    }

    def nest(tree):
        return traverse_util.unflatten_dict({name: tree})

    return (
        {"params": nest(dense_params)},
        {"params": nest({"router": mlp["router"]}), COLLECTION: nest(codes)},
        dense_model.config,
    )


@pytest.mark.parametrize("enable_dropout", [False, True], ids=["eval", "train capacity"])
def test_compressed_layer_equals_flaxformer_layer_on_the_dequantized_experts(
    compressed_tiny, enable_dropout
):
    _, directory, _ = compressed_tiny
    dense_vars, compressed_vars, config = layer_variables(directory)
    # A capacity small enough that tokens drop: the dispatch must be flaxformer's.
    config = dataclasses.replace(
        config, eval_capacity_factor=0.5, train_capacity_factor=0.75, min_expert_capacity=1
    )
    stock = switch_moe_layer(config)
    ours = compressed_moe_layer(stock, directory)
    assert isinstance(ours, CompressedMoeLayer) and isinstance(ours, moe_layers.MoeLayer)
    x = jax.random.normal(jax.random.PRNGKey(3), (8, 40, config.d_model), jnp.float32)
    rngs = {"dropout": jax.random.PRNGKey(0)}
    want, want_state = at_sparse_layer(stock).apply(
        dense_vars, x, enable_dropout, rngs=rngs, mutable=["intermediates"]
    )
    got, got_state = at_sparse_layer(ours).apply(
        compressed_vars, x, enable_dropout, rngs=rngs, mutable=["intermediates"]
    )
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    metrics = traverse_util.flatten_dict(want_state["intermediates"], sep="/")
    assert metrics["encoder/layers_1/mlp/fraction_tokens_left_behind"][0] > 0  # drops happened
    for path, value in traverse_util.flatten_dict(got_state["intermediates"], sep="/").items():
        np.testing.assert_allclose(value[0], metrics[path][0], rtol=1e-6, err_msg=path)

    # Gradients (fine-tuning): to the input and to the router, with the experts frozen.
    want_grads = gradients(stock, dense_vars, x, enable_dropout)
    got_grads = gradients(ours, compressed_vars, x, enable_dropout)
    for want_g, got_g in zip(want_grads, got_grads):
        np.testing.assert_allclose(got_g, want_g, rtol=1e-4, atol=1e-5)


ROUTER = ("encoder", "layers_1", "mlp", "router", "router_weights", "w", "kernel")


def gradients(layer, variables, x, enable_dropout):
    flat = traverse_util.flatten_dict(variables["params"])

    def f(x, kernel):
        params = traverse_util.unflatten_dict({**flat, ROUTER: kernel})
        out = at_sparse_layer(layer).apply(
            {**variables, "params": params},
            x,
            enable_dropout,
            rngs={"dropout": jax.random.PRNGKey(0)},
        )
        return jnp.sum(jnp.sin(out))

    return jax.grad(f, argnums=(0, 1))(x, flat[ROUTER])


def with_minmax(variables, experts, value):
    """``variables`` with the min/max of ``experts`` (every kernel) set to ``value``."""
    flat = traverse_util.flatten_dict(variables[COLLECTION])
    for key, array in flat.items():
        if key[-1] == "minmax":
            flat[key] = jnp.asarray(array).at[jnp.asarray(experts)].set(value)
    return {**variables, COLLECTION: traverse_util.unflatten_dict(flat)}


def test_a_decoding_step_decodes_only_the_experts_its_tokens_chose(compressed_tiny):
    """A decoding step ([batch, 1, d]) fills a few of the E × capacity slots. The experts no
    token chose get NaN scales: computing every slot spreads the NaNs into every output (an
    empty slot's 0 × NaN reaches the combine), computing only the slots in use gives
    flaxformer's output on the intact experts."""
    _, directory, _ = compressed_tiny
    dense_vars, compressed_vars, config = layer_variables(directory)
    stock = switch_moe_layer(config)
    ours = compressed_moe_layer(stock, directory)
    every_slot = dataclasses.replace(ours, skip_empty_slots=False)
    x = jax.random.normal(jax.random.PRNGKey(5), (2, 1, config.d_model), jnp.float32)
    router = traverse_util.flatten_dict(compressed_vars["params"])[ROUTER]
    chosen = set(np.argmax(np.asarray(x.reshape(-1, config.d_model) @ router), axis=-1).tolist())
    idle = [e for e in range(config.num_experts) if e not in chosen]
    assert idle, "every expert was chosen; pick another input"

    want = at_sparse_layer(stock).apply(dense_vars, x)
    got = at_sparse_layer(ours).apply(compressed_vars, x)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    # One token takes the kernels' one-token loop, a full slot block their blocked one: the sums
    # round differently.
    np.testing.assert_allclose(
        at_sparse_layer(every_slot).apply(compressed_vars, x), got, rtol=1e-5, atol=1e-6
    )

    broken = with_minmax(compressed_vars, idle, jnp.nan)
    np.testing.assert_array_equal(at_sparse_layer(ours).apply(broken, x), got)
    assert np.isnan(at_sparse_layer(every_slot).apply(broken, x)).all()


@pytest.mark.parametrize("routed", [True, False], ids=["routed", "gathered"])
@pytest.mark.parametrize("batch", [1, 3])
def test_a_decoding_step_takes_each_tokens_own_expert_with_flaxformers_numbers(
    compressed_tiny, batch, routed, monkeypatch
):
    """A decoding step's tokens, padded by flaxformer to one per group, each multiply their own
    expert (the routed kernel on the CPU; where it is missing, each token's expert codes
    gathered): flaxformer's outputs and sown metrics, and no ``[G, E, C, H]`` dispatch array in
    the program, which the dispatch path (``per_token_limit=0``) builds."""
    if not routed:  # as on a platform without the routed kernel
        monkeypatch.setattr(CompressedMoeLayer, "_routed", staticmethod(lambda: False))
    _, directory, _ = compressed_tiny
    dense_vars, compressed_vars, config = layer_variables(directory)
    stock = switch_moe_layer(config)
    ours = compressed_moe_layer(stock, directory)
    dispatched = dataclasses.replace(ours, per_token_limit=0)
    x = jax.random.normal(jax.random.PRNGKey(7), (batch, 1, config.d_model), jnp.float32)
    x = x.at[-1].set(0.0) if batch > 1 else x  # an all-zero token too: it routes, and gives 0

    def run(layer, variables):
        return at_sparse_layer(layer).apply(variables, x, mutable=["intermediates"])

    want, want_state = run(stock, dense_vars)
    for layer in (ours, dispatched):
        got, got_state = run(layer, compressed_vars)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        metrics = traverse_util.flatten_dict(want_state["intermediates"], sep="/")
        for path, value in traverse_util.flatten_dict(got_state["intermediates"], sep="/").items():
            np.testing.assert_allclose(value[0], metrics[path][0], rtol=1e-6, err_msg=path)

    experts, capacity = config.num_experts, config.min_expert_capacity
    dispatch_shape = f"tensor<{experts}x{experts}x{capacity}x{config.d_model}xf32>"

    def program(layer):
        apply = jax.jit(lambda v, x: at_sparse_layer(layer).apply(v, x))
        return apply.lower(compressed_vars, x).as_text()

    assert dispatch_shape in program(dispatched)  # the premise
    assert dispatch_shape not in program(ours)
    assert ("custom_call @qmoe_matmul_routed" in program(ours)) == routed


def test_a_scoring_call_routes_its_tokens_with_flaxformers_numbers(compressed_tiny):
    """On the CPU a scoring call (groups >= E, tokens dropped at capacity) takes the per-token
    path too, through the routed kernel: flaxformer's outputs, metrics and gradients, and no
    ``[G, E, C, H]`` dispatch array, which the dispatch path builds."""
    _, directory, _ = compressed_tiny
    dense_vars, compressed_vars, config = layer_variables(directory)
    config = dataclasses.replace(config, eval_capacity_factor=1.0, min_expert_capacity=1)
    stock = switch_moe_layer(config)
    ours = compressed_moe_layer(stock, directory)
    dispatched = dataclasses.replace(ours, per_token_limit=0)
    x = jax.random.normal(jax.random.PRNGKey(11), (4, 32, config.d_model), jnp.float32)
    x = x.at[2, 20:].set(0.0)  # padding

    want, want_state = at_sparse_layer(stock).apply(dense_vars, x, mutable=["intermediates"])
    got, got_state = at_sparse_layer(ours).apply(compressed_vars, x, mutable=["intermediates"])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    metrics = traverse_util.flatten_dict(want_state["intermediates"], sep="/")
    assert metrics["encoder/layers_1/mlp/fraction_tokens_left_behind"][0] > 0  # drops happened
    for path, value in traverse_util.flatten_dict(got_state["intermediates"], sep="/").items():
        np.testing.assert_allclose(value[0], metrics[path][0], rtol=1e-6, err_msg=path)
    for want_g, got_g in zip(
        gradients(stock, dense_vars, x, False), gradients(ours, compressed_vars, x, False)
    ):
        np.testing.assert_allclose(got_g, want_g, rtol=1e-4, atol=1e-5)

    dispatch = re.compile(rf"tensor<\d+x{config.num_experts}x\d+x{config.d_model}xf32>")

    def program(layer):
        apply = jax.jit(lambda v, x: at_sparse_layer(layer).apply(v, x))
        return apply.lower(compressed_vars, x).as_text()

    assert dispatch.search(program(dispatched))  # the premise
    routed = program(ours)
    assert not dispatch.search(routed)
    assert routed.count("custom_call @qmoe_matmul_routed") == 2  # wi, wo


def test_skipping_empty_slots_keeps_outputs_and_gradients(compressed_tiny):
    """Scoring shapes, where tokens drop and slots are mostly full: the same numbers either way, up
    to the rounding of the kernels' sums over other blocks of tokens."""
    _, directory, _ = compressed_tiny
    _, compressed_vars, config = layer_variables(directory)
    config = dataclasses.replace(config, eval_capacity_factor=1.5, min_expert_capacity=1)
    ours = compressed_moe_layer(switch_moe_layer(config), directory)
    every_slot = dataclasses.replace(ours, skip_empty_slots=False)
    x = jax.random.normal(jax.random.PRNGKey(6), (4, 24, config.d_model), jnp.float32)
    x = x.at[1, 5:].set(0.0)  # padding: zero rows are skipped wherever they land
    for a, b in zip(
        gradients(ours, compressed_vars, x, False), gradients(every_slot, compressed_vars, x, False)
    ):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(
        at_sparse_layer(ours).apply(compressed_vars, x),
        at_sparse_layer(every_slot).apply(compressed_vars, x),
        rtol=1e-5,
        atol=1e-6,
    )


class EverySlotWithModuleDropout(CompressedMoeLayer):
    """The reference for dropout: relu experts over every slot, with ``nn.Dropout`` applied to the
    hidden activations themselves (as flaxformer's MlpBlock does)."""

    def _compressed_experts(self, x, enable_dropout):
        from qmoe_jax.interop.t5x_moe import CompressedKernelVariables
        from qmoe_jax.kernels import ops

        layer = self._layer_layout(x.shape[-1])
        dictionary = read_layout(self.checkpoint).dictionary(layer.dictionary)
        w = {k: CompressedKernelVariables(s, layer.num_experts, name=k)() for k, s in layer.kernels}
        hidden = nn.relu(ops.matmul(w["wi"], x, dictionary))
        hidden = nn.Dropout(self.expert.intermediate_dropout_rate, broadcast_dims=(-2,))(
            hidden, deterministic=not enable_dropout
        )
        out = ops.matmul(w["wo"], hidden, dictionary)
        return nn.Dropout(self.expert.final_dropout_rate, broadcast_dims=(-2,))(
            out, deterministic=not enable_dropout
        )


def test_dropout_masks_are_the_hidden_activations_own(compressed_tiny):
    """The intermediate dropout mask, drawn on ones outside the bucketed MLP, drops and scales
    what nn.Dropout on the hidden activations would, with the same random bits."""
    _, directory, _ = compressed_tiny
    _, compressed_vars, config = layer_variables(directory)
    stock = switch_moe_layer(config)
    stock = dataclasses.replace(
        stock,
        expert=dataclasses.replace(
            stock.expert, intermediate_dropout_rate=0.5, final_dropout_rate=0.1
        ),
    )
    ours = compressed_moe_layer(stock, directory)
    fields = {f.name: getattr(ours, f.name) for f in dataclasses.fields(ours) if f.init}
    fields = {k: v for k, v in fields.items() if k not in ("parent", "name")}
    reference = EverySlotWithModuleDropout(**fields)
    x = jax.random.normal(jax.random.PRNGKey(7), (4, 12, config.d_model), jnp.float32)
    rngs = {"dropout": jax.random.PRNGKey(1)}
    got = at_sparse_layer(ours).apply(compressed_vars, x, True, rngs=rngs)
    want = at_sparse_layer(reference).apply(compressed_vars, x, True, rngs=rngs)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    undropped = at_sparse_layer(ours).apply(compressed_vars, x, False)
    assert np.abs(np.asarray(got) - np.asarray(undropped)).max() > 1e-3  # dropout acted


def test_compressed_layer_declares_codes_in_their_own_collection_with_expert_axes(compressed_tiny):
    _, directory, _ = compressed_tiny
    layout = read_layout(directory)
    config = load_compressed_model(directory).config
    module = at_sparse_layer(compressed_moe_layer(switch_moe_layer(config), directory))
    shapes = jax.eval_shape(
        module.init, jax.random.PRNGKey(0), jnp.ones((2, 8, config.d_model), jnp.float32)
    )
    assert not any("expert" in "/".join(k) for k in traverse_util.flatten_dict(shapes["params"]))
    codes = traverse_util.flatten_dict(shapes[COLLECTION], sep="/")
    layer = layout.layer("encoder.layers_1.mlp")
    for kernel, kernel_layout in layer.kernels:
        for array, shape in kernel_layout.shapes(layer.num_experts).items():
            assert codes[f"encoder/layers_1/mlp/{kernel}/{array}"].shape == shape
    axes = traverse_util.flatten_dict(shapes[COLLECTION + "_axes"], sep="/")
    assert axes["encoder/layers_1/mlp/wi/codes_axes"].names == ("expert", "unmodeled")
    assert axes["encoder/layers_1/mlp/wo/minmax_axes"].names == ("expert", "unmodeled", None)


def test_compressed_layer_names_what_disagrees_with_the_checkpoint(compressed_tiny):
    _, directory, _ = compressed_tiny
    config = load_compressed_model(directory).config
    x = jnp.ones((2, 8, config.d_model), jnp.float32)
    for changes, activations, message in [
        ({"num_experts": 8}, ("relu",), "NUM_EXPERTS is 8, the checkpoint has 4"),
        ({"d_ff": 96}, ("relu",), "wi is [96, 32] in the model"),
        ({}, ("gelu", "linear"), "need kernels ['wi_0', 'wi_1', 'wo']"),
    ]:
        stock = switch_moe_layer(dataclasses.replace(config, **changes), activations)
        module = at_sparse_layer(compressed_moe_layer(stock, directory))
        with pytest.raises(LayoutError, match=message.replace("[", r"\[").replace("]", r"\]")):
            module.init(jax.random.PRNGKey(0), x)
    module = at_sparse_layer(compressed_moe_layer(switch_moe_layer(config), directory))
    variables = module.init(jax.random.PRNGKey(0), x)
    with pytest.raises(LayoutError, match="'qmoe_experts' collection, which must be passed"):
        module.apply({"params": variables["params"]}, x)
    with pytest.raises(LayoutError, match="holds no compressed experts"):
        read_layout(os.path.dirname(directory))


def parse_switch_gin(model_gin: str, checkpoint: str) -> None:
    flaxformer_root, t5x_root = source_roots()
    gin.clear_config()
    for path in (flaxformer_root, t5x_root, CONFIGS_DIR):
        gin.add_config_file_search_path(path)
    gin.parse_config_files_and_bindings(
        [model_gin, "t5x/compressed_eval.gin"],
        [f"CHECKPOINT_PATH = '{checkpoint}'", "NUM_MODEL_PARTITIONS = 1"],
    )


@pytest.mark.parametrize("model", ["base", "large", "xxl", "c"])
def test_gin_swaps_the_compressed_layer_into_flaxformers_switch_models(model, tmp_path):
    from t5x.contrib.moe import models

    from qmoe_jax.interop.t5x_model import CompressedMoeModel

    parse_switch_gin(f"flaxformer/t5x/configs/moe/models/switch_{model}.gin", str(tmp_path))
    try:
        built = gin.query_parameter("%MODEL").scoped_configurable_fn()
        assert isinstance(built, CompressedMoeModel) and isinstance(
            built, models.MoeEncoderDecoderModel
        )
        layer = gin.query_parameter(
            "moe_architecture.SparseEncoderLayer.mlp"
        ).scoped_configurable_fn()
        assert isinstance(layer, CompressedMoeLayer)
        # flaxformer's bindings carry over: switch_{base,...}.gin's capacity and experts.
        expected = {"base": (128, 2), "large": (128, 2), "xxl": (128, 4), "c": (2048, 2)}[model]
        assert (layer.num_experts, layer.eval_capacity_factor) == expected
        assert layer.checkpoint == str(tmp_path)
        assert not layer.router.batch_prioritized_routing
        decoder_layer = gin.query_parameter(
            "moe_architecture.SparseDecoderLayer.mlp"
        ).scoped_configurable_fn()
        assert isinstance(decoder_layer, CompressedMoeLayer)
        gated = model == "xxl"
        assert len(layer.expert.activations) == (2 if gated else 1)
    finally:
        gin.clear_config()
