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
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

import flax.linen as nn
import jax

from qmoe_jax.codec import CompressedExperts, Dictionary
from qmoe_jax.kernels import ops
from qmoe_jax.models.configs import SwitchConfig
from qmoe_jax.models.layers import dropout
from qmoe_jax.models.lora import LORA, adapter_output
from qmoe_jax.models.mlp import hidden_units


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
    """

    config: SwitchConfig
    dictionaries: Mapping[str, Dictionary]
    mesh: jax.sharding.Mesh | None = None

    def _dictionary(self) -> Dictionary:
        layer = ".".join(self.path[:-1])
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

    @nn.compact
    def __call__(
        self,
        expert_inputs: jax.Array,
        counts: jax.Array | None = None,
        *,
        enable_dropout: bool = False,
    ) -> jax.Array:
        cfg = self.config
        dictionary = self._dictionary()
        matmul = ops.matmul if self.mesh is None else ops.expert_parallel(ops.matmul, self.mesh)
        adapters = self.get_variable("params", LORA) or {}

        def project(name: str, inputs: jax.Array) -> jax.Array:
            y = matmul(self._kernel(name), inputs, dictionary, counts)
            return y + adapter_output(adapters[name], inputs) if name in adapters else y

        x = expert_inputs.astype(cfg.jnp_dtype)
        hidden = hidden_units(cfg, lambda name: project(name, x))
        hidden = dropout(hidden, cfg.dropout_rate, enable_dropout, self)
        return project("wo", hidden)


def compressed_experts_cls(
    dictionaries: Mapping[str, Dictionary], mesh: jax.sharding.Mesh | None = None
):
    """The ``experts_cls`` for ``SwitchTransformer`` over compressed expert stacks (expert-parallel
    over ``mesh``'s ``expert`` axis when given)."""
    return functools.partial(CompressedMlpExperts, dictionaries=dict(dictionaries), mesh=mesh)
