"""Switch (top-1) mixture-of-experts layer: routing, grouping, capacity, dispatch, combine.

Lingo: N tokens of a call are split into G groups of S tokens (row-major over
[B, L], as T5X reshapes); each group gives each of the E experts C slots
(capacity). A token's *position* in its expert is the number of earlier tokens
of its group that chose the same expert; a token whose position is >= C is
dropped: its MoE output is zero and the residual passes it through. The
dispatch buffer is ``[E, G*C, d]``; expert e's kept tokens fill its first
``counts[e]`` rows in (group, position) order, so the rows in use are a prefix
and the expert layer may skip the rest (``counts``), or a whole expert that
received nothing. The buffer is filled by a scatter and read back by a gather,
so the cost is O(N·d + N·E), not the O(N·E·C·d) of one-hot dispatch einsums.
Each token's output depends on its own row only, so this layout gives the same
numbers as T5X's ``g*C + position``.

For few tokens (decoding), an expert layer that offers it (``gather_tokens``,
e.g. the dense ``MlpExperts``) instead multiplies each token by its own expert's
gathered kernels, with no buffer at all; dropped tokens are still zeroed. An expert
layer that routes (``routes_tokens``, the compressed experts on the CPU) takes every
call that way: the N tokens as they are, each with its expert's index (E for a
dropped token), so no call holds a buffer of E · G · C rows, which with many experts
is far larger than the N tokens (docs/inference.md).

Router (T5X ``TokensChooseMaskedRouter`` without batch-prioritized routing):
``probs = softmax(x · W_r)`` in float32, expert = argmax, gate = the raw top-1
probability. Auxiliary losses (Switch paper eq. 4–6, and the ST-MoE router
z-loss) are sown into the ``intermediates`` collection with the T5X metric
names; ``router_metrics`` averages them over layers like T5X.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import traverse_util

from qmoe_jax.models.configs import SwitchConfig
from qmoe_jax.models.experts import MlpExperts
from qmoe_jax.models.layers import DenseKernel

ROUTER_METRICS = (
    "auxiliary_loss",
    "router_z_loss",
    "fraction_tokens_left_behind",
    "router_confidence",
    "expert_usage",
)


def num_groups(
    num_tokens: int, group_size: int, num_experts: int, multiple_of_experts: bool
) -> int:
    """Number of routing groups G for N tokens (T5X ``moe_layers._num_groups``).

    T5X takes the smallest G >= max(N // group_size, E) with N % G == 0 and
    G % E == 0 (its single-host rule with one replica per expert). When
    ``multiple_of_experts`` is False, or no such G exists (e.g. N < E while
    decoding, where T5X itself raises), G is the smallest divisor of N that is
    >= ceil(N / group_size).
    """
    if num_tokens <= 0:
        raise ValueError(f"cannot route {num_tokens} tokens")
    if multiple_of_experts:
        groups = max(num_tokens // group_size, num_experts)
        while groups < num_tokens and not (num_tokens % groups == 0 and groups % num_experts == 0):
            groups += 1
        if num_tokens % groups == 0 and groups % num_experts == 0:
            return groups
    groups = -(-num_tokens // group_size)
    while num_tokens % groups:
        groups += 1
    return groups


def expert_capacity(
    tokens_per_group: int, num_experts: int, capacity_factor: float, min_capacity: int
) -> int:
    """Slots per expert and group: ``max(round(CF * S / E), min_capacity)`` (Python rounding, as
    T5X)."""
    return max(round(capacity_factor * tokens_per_group / num_experts), min_capacity)


class Routing(NamedTuple):
    """Top-1 routing of ``[G, S]`` tokens.

    Attributes:
      expert_index: int32[G, S], chosen expert.
      position: int32[G, S], slot in that expert's buffer for the group.
      gate: float32[G, S], top-1 router probability.
      kept: bool[G, S], position < capacity.
      auxiliary_loss: scalar load-balancing loss (Switch eq. 4), E² · mean(f·P).
      router_z_loss: scalar mean of logsumexp(logits)².
    """

    expert_index: jax.Array
    position: jax.Array
    gate: jax.Array
    kept: jax.Array
    auxiliary_loss: jax.Array
    router_z_loss: jax.Array


def route_top1(router_logits: jax.Array, capacity: int) -> Routing:
    """Routes tokens of ``router_logits [G, S, E]`` (float32) to their top-1 expert.

    Earlier tokens of a group take precedence for an expert's ``capacity`` slots.
    """
    num_experts = router_logits.shape[-1]
    probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
    expert_index = jnp.argmax(probs, axis=-1).astype(jnp.int32)
    gate = jnp.max(probs, axis=-1)
    chosen = jax.nn.one_hot(expert_index, num_experts, dtype=jnp.int32)
    position = jnp.sum(jnp.cumsum(chosen, axis=1) * chosen, axis=-1) - 1
    tokens_fraction = jnp.mean(chosen.astype(jnp.float32), axis=1)
    probs_fraction = jnp.mean(probs, axis=1)
    auxiliary_loss = jnp.mean(tokens_fraction * probs_fraction) * num_experts**2
    router_z_loss = jnp.mean(
        jnp.square(jax.nn.logsumexp(router_logits.astype(jnp.float32), axis=-1))
    )
    return Routing(
        expert_index,
        position.astype(jnp.int32),
        gate,
        position < capacity,
        auxiliary_loss,
        router_z_loss,
    )


def _kept_per_group(routing: Routing, num_experts: int) -> jax.Array:
    """int32[G, E]: kept tokens of each expert in each group."""
    chosen = jax.nn.one_hot(routing.expert_index, num_experts, dtype=jnp.int32)
    return jnp.sum(chosen * routing.kept[..., None], axis=1)


def expert_counts(routing: Routing, num_experts: int) -> jax.Array:
    """int32[E]: rows of each expert's buffer in use (its kept tokens over all groups)."""
    return jnp.sum(_kept_per_group(routing, num_experts), axis=0)


def _buffer_rows(routing: Routing, num_experts: int, capacity: int) -> jax.Array:
    """Row of each token in the flattened ``[E * G * C]`` buffer; dropped tokens get E*G*C.

    Expert e's kept tokens take rows ``e*G*C + 0 .. counts[e]-1`` in (group, position) order.
    """
    groups = routing.expert_index.shape[0]
    kept_before = jnp.cumsum(_kept_per_group(routing, num_experts), axis=0) - _kept_per_group(
        routing, num_experts
    )
    earlier = jnp.take_along_axis(kept_before, routing.expert_index, axis=1)
    rows = routing.expert_index * (groups * capacity) + earlier + routing.position
    return jnp.where(routing.kept, rows, num_experts * groups * capacity).reshape(-1)


def dispatch(tokens: jax.Array, routing: Routing, num_experts: int, capacity: int) -> jax.Array:
    """Scatters ``tokens [G, S, d]`` into the expert buffer ``[E, G*C, d]`` (empty slots are 0)."""
    groups, _, width = tokens.shape
    rows = _buffer_rows(routing, num_experts, capacity)
    buffer = jnp.zeros((num_experts * groups * capacity, width), tokens.dtype)
    buffer = buffer.at[rows].set(tokens.reshape(-1, width), mode="drop")
    return buffer.reshape(num_experts, groups * capacity, width)


def combine(expert_outputs: jax.Array, routing: Routing, capacity: int) -> jax.Array:
    """Gathers ``expert_outputs [E, G*C, d]`` back to ``[G, S, d]``, scaled by the gate.

    Dropped tokens get zero.
    """
    num_experts, _, width = expert_outputs.shape
    groups, tokens_per_group = routing.expert_index.shape
    rows = _buffer_rows(routing, num_experts, capacity)
    gathered = expert_outputs.reshape(-1, width).at[rows].get(mode="fill", fill_value=0)
    scale = jnp.where(routing.kept, routing.gate, 0.0).reshape(-1, 1).astype(expert_outputs.dtype)
    return (gathered * scale).reshape(groups, tokens_per_group, width)


class RouterWeights(nn.Module):
    """``w/kernel [d, E]``; nested as in flaxformer (``router/router_weights/w``)."""

    config: SwitchConfig

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        cfg = self.config
        return DenseKernel(
            cfg.num_experts, cfg, nn.initializers.normal(2e-2), dtype=cfg.jnp_router_dtype, name="w"
        )(tokens)


class Router(nn.Module):
    """Router logits ``[G, S, d] → [G, S, E]`` in the router dtype."""

    config: SwitchConfig

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        tokens = tokens.astype(self.config.jnp_router_dtype)
        return RouterWeights(self.config, name="router_weights")(tokens)


class MoeLayer(nn.Module):
    """Sparse MLP ``[B, L, d] → [B, L, d]``: route, dispatch, ``experts_cls``, combine.

    Attributes:
      config: the model config (E, capacity factors, group size, dtypes).
      experts_cls: the expert layer (see ``qmoe_jax.models.experts`` for the
        interface), instantiated with ``name="expert"``.
    """

    config: SwitchConfig
    experts_cls: Any = MlpExperts

    @nn.compact
    def __call__(self, x: jax.Array, *, enable_dropout: bool = False) -> jax.Array:
        cfg = self.config
        batch, length, width = x.shape
        tokens = batch * length
        groups = num_groups(tokens, cfg.group_size, cfg.num_experts, cfg.groups_multiple_of_experts)
        per_group = tokens // groups
        factor = cfg.train_capacity_factor if enable_dropout else cfg.eval_capacity_factor
        capacity = expert_capacity(per_group, cfg.num_experts, factor, cfg.min_expert_capacity)
        # No group holds more than S tokens for one expert, so slots beyond S
        # are always empty; skipping them changes nothing but the cost.
        slots = min(capacity, per_group)

        grouped = x.reshape(groups, per_group, width)
        routing = route_top1(Router(cfg, name="router")(grouped), slots)
        experts = self.experts_cls(config=cfg, name="expert")
        routed = getattr(experts, "routes_tokens", False)
        if routed or tokens <= getattr(experts, "gather_tokens", 0):
            expert_index = routing.expert_index.reshape(tokens)
            if routed:  # a dropped token names no expert, and costs nothing
                expert_index = jnp.where(
                    routing.kept.reshape(tokens), expert_index, cfg.num_experts
                )
            outputs = experts(
                grouped.reshape(tokens, width).astype(cfg.jnp_dtype),
                expert_index=expert_index,
                enable_dropout=enable_dropout,
            )
            scale = jnp.where(routing.kept, routing.gate, 0.0).reshape(tokens, 1)
            combined = outputs.astype(cfg.jnp_dtype) * scale.astype(cfg.jnp_dtype)
        else:
            expert_inputs = dispatch(grouped.astype(cfg.jnp_dtype), routing, cfg.num_experts, slots)
            expert_outputs = experts(
                expert_inputs,
                counts=expert_counts(routing, cfg.num_experts),
                enable_dropout=enable_dropout,
            )
            combined = combine(expert_outputs.astype(cfg.jnp_dtype), routing, slots)

        kept = jnp.sum(routing.kept)
        metrics = {
            "auxiliary_loss": routing.auxiliary_loss,
            "router_z_loss": routing.router_z_loss,
            "fraction_tokens_left_behind": 1.0 - kept / tokens,
            "router_confidence": jnp.sum(jnp.where(routing.kept, routing.gate, 0.0))
            / jnp.maximum(kept, 1),
            "expert_usage": kept / (cfg.num_experts * capacity * groups),
        }
        for metric, value in metrics.items():
            self.sow("intermediates", metric, jnp.asarray(value, jnp.float32))
        return combined.reshape(batch, length, width)


def router_metrics(intermediates: Mapping[str, Any]) -> dict[str, jax.Array]:
    """Means over MoE layers of the sown router metrics (T5X ``_extract_diversity_metrics``).

    Args:
      intermediates: the ``intermediates`` collection returned by ``apply(...,
        mutable=["intermediates"])``.
    Returns:
      ``{metric: float32 scalar}`` for ``ROUTER_METRICS``; the training loss adds
      ``aux_loss_factor * auxiliary_loss + router_z_loss_factor * router_z_loss``.
    Raises:
      ValueError: no MoE layer sowed metrics (wrong collection, or a dense model).
    """
    flat = traverse_util.flatten_dict(dict(intermediates))
    out = {}
    for metric in ROUTER_METRICS:
        values = [
            jnp.asarray(v, jnp.float32)
            for path, sown in flat.items()
            if path[-1] == metric
            for v in sown
        ]
        if not values:
            raise ValueError(
                f"no sown router metric {metric!r}: pass the 'intermediates' "
                f"collection of an apply(..., mutable=['intermediates']) call "
                f"of a model with sparse layers"
            )
        out[metric] = jnp.mean(jnp.stack(values))
    return out
