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

On the CPU every call is routed (``CompressedMlpExperts.routes_tokens``): the
callback gets the tokens' expert indexes with the routed experts' counts, and
the routed kernel takes the indexes it returns and reads the routed experts
straight from the mapping, with no dispatch buffer.

Where calls are not routed (``routed=False``), few tokens (decoding; at most
``per_token_limit``, 16) take the per-token path of the MoE layer: the host
returns each token's expert copied out of the mapping (``gather``; one
expert's codes, e.g. 2.4 MB at c-2048's shapes), and one kernel call
multiplies the N tokens by their N experts. It is a host copy rather than an
XLA gather from the mapped stack because XLA on CPU read the gathered stack
before the callback that checks the file had run (a truncated file then
faulted).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from qmoe_jax.codec import CompressedExperts, Dictionary
from qmoe_jax.models.compressed_experts import CompressedMlpExperts
from qmoe_jax.models.mlp import kernel_names


class MappedMlpExperts(CompressedMlpExperts):
    """``CompressedMlpExperts`` that report each call's routed experts to ``residency`` first.

    Attributes:
      residency: an object with ``touch(layer: str, counts: int32[E]) -> counts`` (returns its
        input) and ``gather(layer: str, expert_index: int32[N]) -> {kernel: (codes [N, n],
        row_offsets [N, rows+1], minmax [N, rows, 2])}`` (the routed experts' arrays); each raises
        an exception naming the file and the expert when it cannot.
      per_token_limit: calls of at most this many tokens gather each token's expert (the
        per-token path).
    """

    residency: Any = None
    per_token_limit: int | None = 16

    def __call__(
        self,
        expert_inputs: jax.Array,
        counts: jax.Array | None = None,
        *,
        enable_dropout: bool = False,
        expert_index: jax.Array | None = None,
    ) -> jax.Array:
        if expert_index is not None and self.routes_tokens:
            # The routed kernel reads the mapped stacks where they are: it takes the index back
            # from the callback, so that it cannot run before the host has checked the files.
            touched = expert_index.astype(jnp.int32)
            expert_counts = jnp.bincount(touched, length=self.config.num_experts).astype(jnp.int32)
            expert_index = jax.pure_callback(
                functools.partial(_touch_routed, self.residency, self._layer()),
                jax.ShapeDtypeStruct(touched.shape, jnp.int32),
                expert_counts,
                touched,
                vmap_method="sequential",
            )
        elif expert_index is None:
            if counts is None:
                counts = jnp.full((expert_inputs.shape[0],), expert_inputs.shape[1], jnp.int32)
            counts = jax.pure_callback(
                functools.partial(self.residency.touch, self._layer()),
                jax.ShapeDtypeStruct(counts.shape, counts.dtype),
                counts,
                vmap_method="sequential",
            )
        return super().__call__(
            expert_inputs, counts, enable_dropout=enable_dropout, expert_index=expert_index
        )

    def _routed_stacks(self, expert_index: jax.Array) -> dict[str, CompressedExperts]:
        """The routed experts, copied out of the mapping by the host (``residency.gather``)."""
        count = expert_index.shape[0]
        stacks = {name: self._kernel(name) for name in kernel_names(self.config)}
        shapes = {
            name: tuple(
                jax.ShapeDtypeStruct((count, *array.shape[1:]), array.dtype)
                for array in (stack.codes, stack.row_offsets, stack.minmax)
            )
            for name, stack in stacks.items()
        }
        gathered = jax.pure_callback(
            functools.partial(self.residency.gather, self._layer()),
            shapes,
            expert_index,
            vmap_method="sequential",
        )
        return {
            name: CompressedExperts(*gathered[name], stack.cols) for name, stack in stacks.items()
        }


def _touch_routed(residency: Any, layer: str, counts, expert_index):
    """``residency.touch`` for a routed call's experts (``counts`` int32[E]); returns the tokens'
    expert indexes for the kernel."""
    residency.touch(layer, counts)
    return expert_index


def mapped_experts_cls(
    dictionaries: Mapping[str, Dictionary], residency: Any, gather_tokens: int = 16
):
    """The ``experts_cls`` for ``SwitchTransformer`` over mapped expert stacks."""
    return functools.partial(
        MappedMlpExperts,
        dictionaries=dict(dictionaries),
        residency=residency,
        per_token_limit=gather_tokens,
    )
