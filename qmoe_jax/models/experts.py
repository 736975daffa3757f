"""Expert layers of a sparse MLP: the pluggable part of the MoE layer.

Interface (what ``MoeLayer`` relies on, and what a compressed-experts layer
implements to drop in):

* construction: ``experts_cls(config=config, name="expert")``, with ``config``
  a ``SwitchConfig`` (E = ``num_experts``, d = ``d_model``, f = ``d_ff``,
  gating from ``mlp_activations``, dtypes);
* call: ``experts(expert_inputs, counts=counts, enable_dropout=bool) ->
  expert_outputs`` with ``expert_inputs`` of shape ``[E, T, d]`` in the
  activation dtype, where row ``e`` holds the tokens dispatched to expert e in
  its first ``counts[e]`` slots (``counts`` int32[E]; T = groups × capacity;
  unused slots are zero rows) and ``expert_outputs`` of shape ``[E, T, d]``; an
  expert may skip the unused slots (and experts with count 0), but if it
  computes them it must map a zero row to a zero row (no biases);
* optionally, per-token execution: a layer with an attribute ``gather_tokens``
  > 0 is called as ``experts(tokens [N, d], expert_index=int32[N])`` -> ``[N, d]``
  when a call routes at most that many tokens;
* optionally, routed execution: a layer whose attribute ``routes_tokens`` is True
  is called that way for every call, with index E for a token dropped at capacity
  (its output row is scaled by 0, so it must be finite);
* parameters (or other variables) live under the module, so they appear in
  the tree as ``.../mlp/expert/...``. The dense layer has T5X's
  ``wi/kernel [E, d, f]`` and ``wo/kernel [E, f, d]`` (``wi_0``/``wi_1`` when
  gated), i.e. ``y_e = x_e @ W``; a compressed layer stores the transposed
  matrices ``W_e[rows=out, cols=in]`` as ``CompressedExperts`` stacks and
  computes the same ``[E, C, cols] → [E, C, rows]`` products.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from qmoe_jax.models.configs import SwitchConfig
from qmoe_jax.models.layers import dropout, token_expert_dropout
from qmoe_jax.models.mlp import hidden_units


def expert_kernel_init(scale: float):
    """T5X expert initializer: variance scaling (fan_in, normal) per expert of ``[E, in, out]``."""
    return nn.initializers.variance_scaling(
        scale, "fan_in", "normal", in_axis=-2, out_axis=-1, batch_axis=(0,)
    )


class ExpertKernel(nn.Module):
    """A stack of E expert matrices ``kernel [E, in, out]``: ``[E, T, in] → [E, T, out]``, or per
    token ``[N, in] → [N, out]`` through the kernels of ``expert_index int32[N]``."""

    features: int
    config: SwitchConfig

    @nn.compact
    def __call__(self, x: jax.Array, expert_index: jax.Array | None = None) -> jax.Array:
        cfg = self.config
        kernel = self.param(
            "kernel",
            expert_kernel_init(cfg.init_scale),
            (cfg.num_experts, x.shape[-1], self.features),
            cfg.jnp_param_dtype,
        )
        if expert_index is not None:
            return jnp.einsum(
                "nd,ndf->nf", x.astype(cfg.jnp_dtype), kernel[expert_index].astype(cfg.jnp_dtype)
            )
        return jnp.einsum("etd,edf->etf", x.astype(cfg.jnp_dtype), kernel.astype(cfg.jnp_dtype))


class MlpExperts(nn.Module):
    """E dense T5 MLPs, one per expert: ``[E, T, d] → [E, T, d]`` (T5X's all-expert einsum).

    Attributes:
      gather_tokens: a call routing at most this many tokens multiplies each
        token by its own expert's kernels, gathered (``W[expert_index]``),
        instead of every expert by every slot: at decoding sizes that reads the
        routed experts' weights only. 0 always uses T5X's layout.
    """

    config: SwitchConfig
    gather_tokens: int = 16

    @nn.compact
    def __call__(
        self,
        expert_inputs: jax.Array,
        counts: jax.Array | None = None,
        *,
        enable_dropout: bool = False,
        expert_index: jax.Array | None = None,
    ) -> jax.Array:
        cfg = self.config
        hidden = hidden_units(
            cfg, lambda name: ExpertKernel(cfg.d_ff, cfg, name=name)(expert_inputs, expert_index)
        )
        if expert_index is None:
            hidden = dropout(hidden, cfg.dropout_rate, enable_dropout, self)
        else:  # the [E, T, f] layout's mask, taken per token: both paths drop alike
            hidden = token_expert_dropout(
                hidden, cfg.dropout_rate, enable_dropout, self, cfg.num_experts, expert_index
            )
        return ExpertKernel(cfg.d_model, cfg, name="wo")(hidden, expert_index)
