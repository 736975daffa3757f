"""The model's layers cut where QMoE's calibration pass needs them.

Lingo: a layer's *attend* half is everything before its MLP (self-attention,
cross-attention for the decoder, residuals) and returns the residual stream
plus the MLP input (``pre_mlp_layer_norm`` output); the *MLP* half is either a
dense MLP or a sparse one (router → experts). These jitted functions call the
model's own Flax modules with the layer's parameter subtree, so calibration
computes exactly what the model computes.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

import jax
import jax.numpy as jnp

from qmoe_jax.models import SwitchConfig
from qmoe_jax.models.layers import (
    DenseMlp,
    RelativePositionBias,
    RmsNorm,
    attention_mask,
    causal_mask,
)
from qmoe_jax.models.mlp import hidden_units
from qmoe_jax.models.moe import Router, expert_capacity, num_groups, route_top1
from qmoe_jax.models.switch import DecoderLayer, EncoderLayer, decoder_logit_mask


@functools.partial(jax.jit, static_argnums=(0,))
def encoder_attend(config: SwitchConfig, layer_params, relpos_params, x, tokens):
    """Encoder layer before its MLP: (residual [B, L, d], MLP input [B, L, d])."""
    valid = tokens > 0
    length = tokens.shape[1]
    bias = RelativePositionBias(config, bidirectional=True).apply(
        {"params": relpos_params}, length, length
    )
    logit_mask = valid[..., None].astype(config.jnp_dtype)
    return EncoderLayer(config, sparse=False).apply(
        {"params": layer_params}, x, attention_mask(valid, valid), bias, logit_mask, method="attend"
    )


@functools.partial(jax.jit, static_argnums=(0,))
def decoder_attend(
    config: SwitchConfig,
    layer_params,
    relpos_params,
    x,
    encoded,
    encoder_tokens,
    decoder_inputs,
    decoder_targets,
):
    """Decoder layer before its MLP (teacher forcing): (residual, MLP input), each [B, L, d]."""
    length = decoder_inputs.shape[1]
    target_valid = decoder_targets > 0
    self_mask = causal_mask(length) & attention_mask(target_valid, target_valid)
    cross_mask = attention_mask(target_valid, encoder_tokens > 0)
    logit_mask = decoder_logit_mask(decoder_inputs)[..., None].astype(config.jnp_dtype)
    bias = RelativePositionBias(config, bidirectional=False).apply(
        {"params": relpos_params}, length, length
    )
    return DecoderLayer(config, sparse=False).apply(
        {"params": layer_params},
        x,
        encoded,
        self_mask,
        cross_mask,
        bias,
        logit_mask,
        method="attend",
    )


@functools.partial(jax.jit, static_argnums=(0,))
def dense_mlp(config: SwitchConfig, mlp_params, h):
    return DenseMlp(config).apply({"params": mlp_params}, h)


@functools.partial(jax.jit, static_argnums=(0,))
def final_norm(config: SwitchConfig, norm_params, x, logit_mask):
    return RmsNorm(config).apply({"params": norm_params}, x) * logit_mask


@functools.partial(jax.jit, static_argnums=(0,))
def route(config: SwitchConfig, router_params, h):
    """Top-1 routing of a padded batch ``h [B, L, d]`` exactly as ``MoeLayer`` does at eval.

    Returns (expert int32[B, L], gate float32[B, L], kept bool[B, L]).
    """
    batch, length, width = h.shape
    tokens = batch * length
    groups = num_groups(
        tokens, config.group_size, config.num_experts, config.groups_multiple_of_experts
    )
    per_group = tokens // groups
    capacity = expert_capacity(
        per_group, config.num_experts, config.eval_capacity_factor, config.min_expert_capacity
    )
    grouped = h.reshape(groups, per_group, width)
    routing = route_top1(
        Router(config).apply({"params": router_params}, grouped), min(capacity, per_group)
    )
    shape = (batch, length)
    return (
        routing.expert_index.reshape(shape),
        routing.gate.reshape(shape),
        routing.kept.reshape(shape),
    )


def expert_hidden(
    config: SwitchConfig, input_kernels: Mapping[str, jax.Array], x: jax.Array
) -> jax.Array:
    """The expert MLP's hidden activations ``[n, f]`` for inputs ``x [n, d]`` (one expert).

    ``input_kernels`` maps each of ``input_kernel_names(config)`` to its T5X kernel ``[d, f]``.
    """
    return hidden_units(config, lambda name: jnp.dot(x, input_kernels[name].astype(x.dtype)))


@functools.partial(jax.jit, static_argnums=(0,))
def expert_outputs(config: SwitchConfig, input_kernels, output_kernel, x, gate):
    """One expert's gated output ``gate · wo(act(x wi))`` for ``x [n, d]``, ``gate [n]``."""
    hidden = expert_hidden(config, input_kernels, x)
    return jnp.dot(hidden, output_kernel.astype(x.dtype)) * gate[:, None].astype(x.dtype)
