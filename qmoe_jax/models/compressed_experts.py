"""Expert layers on the fused decode-and-multiply kernels (QMoE inference).

The drop-in ``experts_cls`` for ``MoeLayer`` when a checkpoint's experts are
ternary ``CompressedExperts`` stacks: ``expert/wi`` (or ``wi_0``/``wi_1``) and
``expert/wo`` hold W[E, out, in] in format v1, and each product
``[E, C, in] → [E, C, out]`` is one ``ops.matmul`` call per layer, decoding every
codeword once for all tokens of its expert. With the routing's ``counts`` the
kernels compute only the slots in use and never decode an expert that
received no token, so a decoding step costs the routed experts, not all E. The weights are
frozen: gradients flow to the inputs only (``ops``' custom VJP), which is what fine-tuning the
dense layers of a compressed model needs.

Optional expert LoRA (``models/lora.py``): when the tree holds adapters at
``expert/lora/<kernel>/{a, b}``, each product becomes ``W_e x + B_e A_e x``; the
frozen part stays one fused call per kernel and layer, the adapters one batched
einsum pair over the experts. Without adapters nothing changes.

On the CPU every call is routed (``routes_tokens``): the MoE layer passes its tokens as they are,
each with its expert's index, and each kernel is one ``ops.matmul_routed`` call on the stacks, which
decodes each named expert once for all its tokens; no dispatch buffer exists, however many experts
the layer has (docs/inference.md). Elsewhere, or with ``routed=False``:

Few tokens (decoding; ``default_per_token_limit``) take the MoE layer's per-token path: each token's
expert is gathered out of the stacks (one expert's codes, row offsets and min/max per token and
kernel; 0.25 MB at switch-base's shapes) and one kernel call multiplies the N tokens by their N
experts. The dispatch path's ``[E, slots, d]`` and ``[E, slots, d_ff]`` buffers, which a step
writes and reads whole even when one expert is routed, grow with E (about 4 MB of them per layer
for 128 experts at switch-base's shapes); the gathered experts do not. Expert parallelism keeps the
dispatch path.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp

from qmoe_jax.codec import CompressedExperts, Dictionary
from qmoe_jax.kernels import ops
from qmoe_jax.models.configs import SwitchConfig
from qmoe_jax.models.layers import dropout, token_expert_dropout
from qmoe_jax.models.lora import LORA, adapter_output
from qmoe_jax.models.mlp import hidden_units, kernel_names


def default_per_token_limit(num_experts: int) -> int:
    """Tokens up to which the per-token path is the default: ``min(16, E // 16)``, so none below
    16 experts.

    The dispatch path's buffers grow with E, and the per-token path pays a fixed cost (the
    gathers) per call: at batch-1 decoding it pays off with many experts and not with few
    (docs/measurements.md, inference.py, has the measurement behind the limit). A dispatched
    call also decodes each routed expert once for all its tokens, where the per-token
    path decodes one expert per token: with N tokens routed evenly over E experts about
    (N - 1)/(2E) of its decoding repeats, under 1/32 at N ≤ E/16.
    """
    return min(16, num_experts // 16)


class CompressedMlpExperts(nn.Module):
    """E compressed T5 MLPs: ``[E, T, d] → [E, T, d]`` through the fused kernels.

    Attributes:
      config: the model config.
      dictionaries: dictionary of each sparse layer, keyed by the layer's dotted
        path without ``expert`` (e.g. ``"encoder.layers_1.mlp"``), as
        ``CompressedModel.dictionaries`` gives them.
      mesh: expert parallelism: the stacks are sharded over this mesh's
        ``expert`` axis, and each device multiplies the tokens dispatched to its
        own experts (``ops.expert_parallel``); None runs every expert here.
      per_token_limit: where calls are not routed: calls of at most this many tokens multiply
        each token by its own expert, gathered out of the stacks (the per-token path); 0 always
        dispatches. None (default): ``default_per_token_limit(E)``, and 0 with a mesh.
      routed: every call multiplies the tokens where they are by the experts they name, with
        the routed kernel (``ops.matmul_routed``), and no dispatch buffer exists. None (default):
        where the routed kernel runs (the CPU) and without a mesh. A platform without the
        kernel runs its gathered form (one expert's codes per token), so there False, the
        dispatch above ``per_token_limit`` tokens, is the better choice for long calls.
    """

    config: SwitchConfig
    dictionaries: Mapping[str, Dictionary]
    mesh: jax.sharding.Mesh | None = None
    per_token_limit: int | None = None
    routed: bool | None = None

    @property
    def routes_tokens(self) -> bool:
        """Whether every call takes the tokens as they are, each with its expert's index
        (``MoeLayer`` reads it): ``routed``, or by default wherever the routed kernel runs (the
        CPU) and the experts are not sharded."""
        if self.routed is not None:
            return self.routed
        return self.mesh is None and ops.has_routed_kernels(jax.default_backend())

    @property
    def gather_tokens(self) -> int:
        """The most tokens of a call that take the per-token path (``MoeLayer`` reads it)."""
        if self.per_token_limit is not None:
            return self.per_token_limit
        return 0 if self.mesh is not None else default_per_token_limit(self.config.num_experts)

    def _layer(self) -> str:
        """This sparse layer's dotted path without ``expert`` (e.g. ``"encoder.layers_1.mlp"``)."""
        return ".".join(self.path[:-1])

    def _dictionary(self) -> Dictionary:
        layer = self._layer()
        if layer not in self.dictionaries:
            raise KeyError(
                f"no dictionary for sparse layer {layer!r}; known: {sorted(self.dictionaries)}"
            )
        return self.dictionaries[layer]

    def _kernel(self, name: str) -> CompressedExperts:
        # Read, not self.param: flax would call an initializer to check shapes,
        # and compressed experts come only from a compressed checkpoint.
        kernel = self.get_variable("params", name)
        if kernel is None:
            raise ValueError(
                f"{'/'.join(self.path)}/{name} is missing: compressed experts are loaded, not "
                "initialized; "
                "use qmoe_jax.inference.open_model(<compressed directory>)"
            )
        if not isinstance(kernel, CompressedExperts):
            raise TypeError(
                f"{'/'.join(self.path)}/{name} is a {type(kernel).__name__}, expected "
                "CompressedExperts"
            )
        return kernel

    def _routed_stacks(self, expert_index: jax.Array) -> dict[str, CompressedExperts]:
        """{kernel: the stack of each token's expert, ``[N]`` matrices} for ``expert_index
        int32[N]``."""
        return {name: self._kernel(name).take(expert_index) for name in kernel_names(self.config)}

    def _mlp(
        self,
        stacks: Mapping[str, CompressedExperts],
        adapters: Mapping[str, dict],
        x: jax.Array,
        enable_dropout: bool,
        matmul=ops.matmul,
        counts: jax.Array | None = None,
        expert_index: jax.Array | None = None,
    ) -> jax.Array:
        """The expert MLPs ``x [S, T, d] → [S, T, d]`` over ``stacks`` of S matrices per kernel
        (with their LoRA ``adapters``), each kernel one ``matmul`` call for all of them. With
        ``expert_index int[S]`` (one token per row) dropout takes the expert layout's mask, so
        that every path drops the same hidden units."""
        cfg = self.config
        dictionary = self._dictionary()

        def project(name: str, inputs: jax.Array) -> jax.Array:
            y = matmul(stacks[name], inputs, dictionary, counts)
            return y + adapter_output(adapters[name], inputs) if name in adapters else y

        x = x.astype(cfg.jnp_dtype)
        hidden = hidden_units(cfg, lambda name: project(name, x))
        if expert_index is None:
            hidden = dropout(hidden, cfg.dropout_rate, enable_dropout, self)
        else:
            hidden = token_expert_dropout(
                hidden, cfg.dropout_rate, enable_dropout, self, cfg.num_experts, expert_index
            )
        return project("wo", hidden)

    @nn.compact
    def __call__(
        self,
        expert_inputs: jax.Array,
        counts: jax.Array | None = None,
        *,
        enable_dropout: bool = False,
        expert_index: jax.Array | None = None,
    ) -> jax.Array:
        adapters = self.get_variable("params", LORA) or {}
        if expert_index is None:
            stacks = {name: self._kernel(name) for name in kernel_names(self.config)}
            matmul = ops.matmul if self.mesh is None else ops.expert_parallel(ops.matmul, self.mesh)
            return self._mlp(stacks, adapters, expert_inputs, enable_dropout, matmul, counts)
        # Tokens [N, d] through each token's own expert (expert_index int32[N]).
        if self.mesh is not None:
            raise ValueError(
                "the per-token and routed paths take experts on one device, and this layer's "
                "experts are sharded over a mesh: leave per_token_limit and routed at None (or 0 "
                "and False) with a mesh"
            )
        expert_index = expert_index.astype(jnp.int32)
        # An index out of range (a dropped token) reads adapter E - 1; its output is scaled by 0.
        routed_adapters = {
            name: {
                part: jnp.take(array, expert_index, axis=0, mode="clip")
                for part, array in adapter.items()
            }
            for name, adapter in adapters.items()
        }
        if self.routes_tokens:
            # The routed kernel on the stacks themselves: [N, d] stays [N, d], each expert named
            # decoded once for all its tokens.
            stacks = {name: self._kernel(name) for name in kernel_names(self.config)}

            def routed(w, x, dictionary, counts=None):
                return ops.matmul_routed(w, x[:, 0], expert_index, dictionary)[:, None]

            return self._mlp(
                stacks,
                routed_adapters,
                expert_inputs[:, None, :],
                enable_dropout,
                routed,
                expert_index=expert_index,
            )[:, 0]
        # The per-token path: each token's expert gathered out of the stacks, N stacks of one
        # token each.
        stacks = self._routed_stacks(expert_index)
        return self._mlp(
            stacks,
            routed_adapters,
            expert_inputs[:, None, :],
            enable_dropout,
            expert_index=expert_index,
        )[:, 0]


def compressed_experts_cls(
    dictionaries: Mapping[str, Dictionary], mesh: jax.sharding.Mesh | None = None
):
    """The ``experts_cls`` for ``SwitchTransformer`` over compressed expert stacks (expert-parallel
    over ``mesh``'s ``expert`` axis when given)."""
    return functools.partial(CompressedMlpExperts, dictionaries=dict(dictionaries), mesh=mesh)
