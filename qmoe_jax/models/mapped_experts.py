"""Compressed expert layers whose stacks are views of memory-mapped files (larger-than-RAM
inference).

The stacks are ``CompressedExperts`` over read-only mappings of a mapped
checkpoint (docs/format.md §9), placed on the CPU without a copy, so the
fused kernels read the routed experts' pages straight from the mapping and
the OS page cache holds the experts in use. Before the kernels run, the
layer hands the routed experts to the host (a ``jax.pure_callback``) and
waits for it: the host reads and verifies the routed experts it has not
verified yet, checks that the files are unchanged, prefetches the routed
experts' pages and releases those of experts unused for longest (``touch``
of ``inference.mapped_params.ExpertResidency``). The kernels take what the host
returns, so they cannot run before it.

Few tokens (decoding; at most ``gather_tokens``) take the per-token path of
the MoE layer: the host returns each token's expert copied out of the
mapping (``gather``; one expert's codes, e.g. 2.4 MB at c-2048's shapes), and
one kernel call multiplies the N tokens by their N experts. With 2048
experts per layer this avoids the ``[E, slots, d_ff]`` buffers of the
dispatch path. It is a host copy rather than an XLA gather from the mapped
stack because XLA on CPU read the gathered stack before the callback that
checks the file had run (a truncated file then faulted).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from qmoe_jax.codec import CompressedExperts, Dictionary
from qmoe_jax.kernels import ops
from qmoe_jax.models.compressed_experts import CompressedMlpExperts
from qmoe_jax.models.layers import dropout
from qmoe_jax.models.mlp import hidden_units, kernel_names


class MappedMlpExperts(CompressedMlpExperts):
    """``CompressedMlpExperts`` that report each call's routed experts to ``residency`` first.

    Attributes:
      residency: an object with ``touch(layer: str, counts: int32[E]) -> counts`` (returns its
        input) and ``gather(layer: str, expert_index: int32[N]) -> {kernel: (codes [N, n],
        row_offsets [N, rows+1], minmax [N, rows, 2])}`` (the routed experts' arrays); each raises
        an exception naming the file and the expert when it cannot.
      gather_tokens: calls of at most this many tokens gather each token's expert (the per-token
        path).
    """

    residency: Any = None
    gather_tokens: int = 16

    def __call__(
        self,
        expert_inputs: jax.Array,
        counts: jax.Array | None = None,
        *,
        enable_dropout: bool = False,
        expert_index: jax.Array | None = None,
    ) -> jax.Array:
        layer = ".".join(self.path[:-1])
        if expert_index is not None:
            return self._per_token(
                layer, expert_inputs, expert_index.astype(jnp.int32), enable_dropout
            )
        if counts is None:
            counts = jnp.full((expert_inputs.shape[0],), expert_inputs.shape[1], jnp.int32)
        counts = jax.pure_callback(
            functools.partial(self.residency.touch, layer),
            jax.ShapeDtypeStruct(counts.shape, counts.dtype),
            counts,
            vmap_method="sequential",
        )
        return super().__call__(expert_inputs, counts, enable_dropout=enable_dropout)

    def _per_token(
        self, layer: str, tokens: jax.Array, expert_index: jax.Array, enable_dropout: bool
    ) -> jax.Array:
        """``tokens [N, d] → [N, d]`` through each token's own expert (``expert_index
        int32[N]``)."""
        cfg = self.config
        dictionary = self._dictionary()
        count = expert_index.shape[0]
        stacks = {name: self._kernel(name) for name in kernel_names(cfg)}
        shapes = {
            name: tuple(
                jax.ShapeDtypeStruct((count, *array.shape[1:]), array.dtype)
                for array in (stack.codes, stack.row_offsets, stack.minmax)
            )
            for name, stack in stacks.items()
        }
        gathered = jax.pure_callback(
            functools.partial(self.residency.gather, layer),
            shapes,
            expert_index,
            vmap_method="sequential",
        )

        def multiply(name: str, x: jax.Array) -> jax.Array:
            experts = CompressedExperts(*gathered[name], stacks[name].cols)
            return ops.matmul(experts, x[:, None, :], dictionary)[:, 0]

        x = tokens.astype(cfg.jnp_dtype)
        hidden = hidden_units(cfg, lambda name: multiply(name, x))
        hidden = dropout(hidden, cfg.dropout_rate, enable_dropout, self)
        return multiply("wo", hidden)


def mapped_experts_cls(
    dictionaries: Mapping[str, Dictionary], residency: Any, gather_tokens: int = 16
):
    """The ``experts_cls`` for ``SwitchTransformer`` over mapped expert stacks."""
    return functools.partial(
        MappedMlpExperts,
        dictionaries=dict(dictionaries),
        residency=residency,
        gather_tokens=gather_tokens,
    )
