"""The tiny Switch model of the model tests: config, parameter tree, random parameters, jitted
apply."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from qmoe_jax.models import MlpExperts, SwitchConfig, SwitchTransformer

# Eval capacity factor E gives each expert a whole group: no token ever drops
# at eval, so routing is independent of how tokens are grouped (padding,
# incremental decoding). The MoE tests below cover dropping.
TINY = SwitchConfig(
    name="tiny",
    vocab_size=64,
    d_model=16,
    num_heads=2,
    d_kv=4,
    d_ff=24,
    num_encoder_layers=2,
    num_decoder_layers=2,
    num_experts=4,
    num_encoder_sparse_layers=1,
    num_decoder_sparse_layers=1,
    eval_capacity_factor=4.0,
)

# docs/t5x.md §2 for TINY (V=64, d=16, h·k=2·4, f=24, E=4, layer 1 sparse).
TINY_TREE = {
    "token_embedder/embedding": (64, 16),
    "encoder/relpos_bias/rel_embedding": (2, 32),
    "encoder/encoder_norm/scale": (16,),
    "decoder/relpos_bias/rel_embedding": (2, 32),
    "decoder/decoder_norm/scale": (16,),
    "encoder/layers_0/mlp/wi/kernel": (16, 24),
    "encoder/layers_0/mlp/wo/kernel": (24, 16),
    "encoder/layers_1/mlp/router/router_weights/w/kernel": (16, 4),
    "encoder/layers_1/mlp/expert/wi/kernel": (4, 16, 24),
    "encoder/layers_1/mlp/expert/wo/kernel": (4, 24, 16),
    "decoder/layers_0/mlp/wi/kernel": (16, 24),
    "decoder/layers_0/mlp/wo/kernel": (24, 16),
    "decoder/layers_1/mlp/router/router_weights/w/kernel": (16, 4),
    "decoder/layers_1/mlp/expert/wi/kernel": (4, 16, 24),
    "decoder/layers_1/mlp/expert/wo/kernel": (4, 24, 16),
}
for _i in range(2):
    TINY_TREE[f"encoder/layers_{_i}/pre_attention_layer_norm/scale"] = (16,)
    TINY_TREE[f"encoder/layers_{_i}/pre_mlp_layer_norm/scale"] = (16,)
    for _attention in ("attention",):
        for _proj in ("query", "key", "value"):
            TINY_TREE[f"encoder/layers_{_i}/{_attention}/{_proj}/kernel"] = (16, 8)
        TINY_TREE[f"encoder/layers_{_i}/{_attention}/out/kernel"] = (8, 16)
    for _norm in (
        "pre_self_attention_layer_norm",
        "pre_cross_attention_layer_norm",
        "pre_mlp_layer_norm",
    ):
        TINY_TREE[f"decoder/layers_{_i}/{_norm}/scale"] = (16,)
    for _attention in ("self_attention", "encoder_decoder_attention"):
        for _proj in ("query", "key", "value"):
            TINY_TREE[f"decoder/layers_{_i}/{_attention}/{_proj}/kernel"] = (16, 8)
        TINY_TREE[f"decoder/layers_{_i}/{_attention}/out/kernel"] = (8, 16)


def tokens(seed, shape, vocab=64, low=2):
    return jnp.asarray(np.random.default_rng(seed).integers(low, vocab, shape), jnp.int32)


def shift_right(targets):
    return jnp.pad(targets[:, :-1], ((0, 0), (1, 0)))


def random_params(model, *inputs, seed=0):
    """Random parameters of the model's tree, without compiling ``init``.

    Kernels ~ N(0, 1/fan_in), other leaves ~ N(1, 0.1) (norm scales) or N(0, 1).
    """
    shapes = jax.eval_shape(model.init, jax.random.PRNGKey(0), *inputs)["params"]
    rng = np.random.default_rng(seed)

    def draw(path, leaf):
        name = jax.tree_util.keystr(path)
        if "kernel" in name:
            std = leaf.shape[-2] ** -0.5
        elif "scale" in name:
            return jnp.asarray(1 + 0.1 * rng.standard_normal(leaf.shape), leaf.dtype)
        else:
            std = 1.0
        return jnp.asarray(std * rng.standard_normal(leaf.shape), leaf.dtype)

    return jax.tree_util.tree_map_with_path(draw, shapes)


def init(config, batch=2, enc_len=8, dec_len=6, experts_cls=MlpExperts):
    """Model, random params and inputs."""
    model = SwitchTransformer(config, experts_cls)
    targets = tokens(1, (batch, dec_len), config.vocab_size)
    encoder_tokens = tokens(0, (batch, enc_len), config.vocab_size)
    return (
        model,
        random_params(model, encoder_tokens, shift_right(targets), targets),
        encoder_tokens,
        targets,
    )


_jitted_apply = jax.jit(
    nn.Module.apply, static_argnums=0, static_argnames=("enable_dropout", "method", "mutable")
)


def run(module, params, *args, **kwargs):
    """``module.apply`` jitted; compilations are shared by equal modules across tests."""
    return _jitted_apply(module, {"params": params}, *args, **kwargs)


def flat_shapes(params):
    return {k: v.shape for k, v in traverse_util.flatten_dict(params, sep="/").items()}
