"""Where the compressed T5X layer's expert products run: on the experts' own devices under
``jax.shard_map`` when T5X's mesh shards the logical ``expert`` (and ``expert_replicas``) axes
over more than one device, otherwise as one local ``ops.matmul`` call
(``interop/t5x_moe.py`` uses both)."""

from __future__ import annotations

import math

import jax
from absl import logging
from flax.linen import partitioning as flax_partitioning

from qmoe_jax.codec import CompressedExperts
from qmoe_jax.kernels import ops


def context_mesh() -> jax.sharding.Mesh | None:
    """The mesh T5X partitions with (its partitioned functions run under ``with mesh:``)."""
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty:
        return mesh
    from jax._src import mesh as mesh_lib

    physical = mesh_lib.thread_resources.env.physical_mesh
    return None if physical.empty else physical


def expert_matmul(layer: str):
    """``(matmul, blocks)`` for the sparse layer ``layer`` (its dotted path, for the log):
    ``matmul(w, x, dictionary, counts)`` is ``ops.matmul``,
    expert-local under ``jax.shard_map`` when the experts are sharded, with ``counts``
    ``int32[E, blocks]`` counting the rows in use of each expert's ``blocks`` blocks of rows
    (one per device along the ``expert_replicas`` axis) or None."""
    mesh = context_mesh()
    if mesh is None:
        return local_matmul, 1
    spec = flax_partitioning.logical_to_mesh_axes(("expert", "expert_replicas", "unmodeled"))
    experts_axis, replicas_axis = (spec[0], spec[1]) if spec is not None else (None, None)

    def size(axis) -> int:
        names = () if axis is None else (axis,) if isinstance(axis, str) else tuple(axis)
        return math.prod(mesh.shape[n] for n in names)

    if size(experts_axis) * size(replicas_axis) == 1:
        return local_matmul, 1
    logging.info(
        "qmoe_jax: compressed experts of %s run expert-locally over mesh axes %s (%d devices) "
        "and %s (%d devices)",
        layer,
        experts_axis,
        size(experts_axis),
        replicas_axis,
        size(replicas_axis),
    )
    weights_spec = jax.sharding.PartitionSpec(experts_axis)
    tokens_spec = jax.sharding.PartitionSpec(experts_axis, replicas_axis)

    def sharded(w: CompressedExperts, x: jax.Array, dictionary, counts) -> jax.Array:
        # check_vma=False: FFI results carry no varying-axes type (as ops.expert_parallel).
        arrays = (w, x) if counts is None else (w, x, counts)
        specs = (weights_spec, tokens_spec, tokens_spec)[: len(arrays)]
        return jax.shard_map(
            lambda w, x, *counts: local_matmul(w, x, dictionary, *counts),
            mesh=mesh,
            in_specs=specs,
            out_specs=tokens_spec,
            check_vma=False,
        )(*arrays)

    return sharded, size(replicas_axis)


def local_matmul(w: CompressedExperts, x: jax.Array, dictionary, counts=None) -> jax.Array:
    """``ops.matmul`` with ``counts int32[E, 1]`` (one block of rows per expert) or None."""
    return ops.matmul(w, x, dictionary, None if counts is None else counts.reshape(-1))
