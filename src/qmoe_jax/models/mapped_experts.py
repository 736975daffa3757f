"""Compressed expert layers whose stacks are views of memory-mapped files (larger-than-RAM inference).

The stacks are ``CompressedExperts`` over read-only mappings of a mapped
checkpoint (docs/format.md §9), placed on the CPU without a copy, so the
fused kernels read the routed experts' pages straight from the mapping and
the OS page cache holds the experts in use. Before the kernels run, the
layer hands the routing's ``counts int32[E]`` to the host (a
``jax.pure_callback``) and waits for it: the host reads and verifies the
routed experts it has not verified yet, checks that the files are unchanged,
prefetches the routed experts' pages and releases those of experts unused for
longest (``touch`` of ``inference.mapped.ExpertResidency``). The kernels take
the counts the host returns, so they cannot run before it.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import jax

from qmoe_jax.codec import Dictionary
from qmoe_jax.models.compressed_experts import CompressedMlpExperts


class MappedMlpExperts(CompressedMlpExperts):
    """``CompressedMlpExperts`` that report each call's routed experts to ``residency`` first.

    Attributes:
      residency: an object with ``touch(layer: str, counts: np.ndarray) -> np.ndarray`` (counts returned as
        given, or an exception naming the file and the expert).
    """

    residency: Any = None

    def __call__(self, expert_inputs: jax.Array, counts: jax.Array | None = None, *,
                 enable_dropout: bool = False) -> jax.Array:
        if counts is None:
            counts = jax.numpy.full((expert_inputs.shape[0],), expert_inputs.shape[1], jax.numpy.int32)
        layer = ".".join(self.path[:-1])
        counts = jax.pure_callback(functools.partial(self.residency.touch, layer),
                                   jax.ShapeDtypeStruct(counts.shape, counts.dtype), counts,
                                   vmap_method="sequential")
        return super().__call__(expert_inputs, counts, enable_dropout=enable_dropout)


def mapped_experts_cls(dictionaries: Mapping[str, Dictionary], residency: Any):
    """The ``experts_cls`` for ``SwitchTransformer`` over mapped expert stacks."""
    return functools.partial(MappedMlpExperts, dictionaries=dict(dictionaries), residency=residency)
