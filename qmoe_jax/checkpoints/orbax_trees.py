"""How qmoe_jax's own writers save Orbax PyTrees: the compressed checkpoint's parts
(``format_v1``) and the fine-tuning run's training checkpoints (``training.run_directory``).

Both write what ``PyTreeCheckpointHandler`` writes (an OCDBT database of zarr v2 arrays, read back
by any Orbax or tensorstore reader) with two changes that only lower the writer's peak memory:

- **No defensive copy of host arrays.** Orbax deep-copies a NumPy leaf, and copies a
  ``jax.Array`` to the host, before it writes, so that a caller may change the arrays while an
  asynchronous save runs. These saves are synchronous, so the arrays are written where they are:
  ``host_views`` turns a process's CPU arrays that sit in one buffer into NumPy views of that
  memory, and the handler writes NumPy leaves without copying them. The views are dropped when
  the save returns, so a later jitted step may still donate the arrays.
- **Bounded data files.** ``DATA_FILE_BYTES`` is the target size of the OCDBT data files, and so
  the largest zarr chunk of an array (Orbax splits an array of more bytes). While it writes,
  tensorstore holds an encoded copy of each chunk in flight and of the unfinished data file; with
  Orbax's default (unbounded files, one chunk per array) that is a second copy of everything
  saved.
- **One chunk per expert** in trees of expert stacks (``save_args(tree, expert_stacks=True)``).
  Orbax splits an array into chunks that divide its shape, largest dimension first, so a stack of
  code streams ``uint16[E, n]`` whose length n has no divisor near the target is cut into chunks
  one or two codewords wide: hundreds of thousands of tiny chunks, each its own OCDBT entry, which
  tensorstore holds in memory while it writes (as much again as the layer) and which every read
  of one expert must visit. Cutting the leading (expert) axis first gives chunks of whole experts
  whatever n is.

What a save still holds beyond the arrays is tensorstore's work in flight, a few hundred MB
however large the tree. ``benchmarks/import_qmoe.py`` and ``benchmarks/finetune.py --goals cost``
measure the peak memory of the commands; docs/format.md §8.1.
"""

from __future__ import annotations

import jax
import numpy as np
import orbax.checkpoint as ocp

DATA_FILE_BYTES = 32 << 20


def handler(
    multiprocessing_options: ocp.options.MultiprocessingOptions | None = None,
) -> ocp.PyTreeCheckpointHandler:
    """``PyTreeCheckpointHandler()``'s defaults (the same files), except that NumPy leaves are
    written without a copy."""
    registry = ocp.type_handlers.create_type_handler_registry(
        (np.ndarray, ocp.type_handlers.NumpyHandler(deepcopy_host_arrays=False)),
        *(
            (kind, ocp.type_handlers.get_type_handler(kind))
            for kind in (int, float, bytes, np.number, jax.Array, str)
        ),
    )
    options = multiprocessing_options or ocp.options.MultiprocessingOptions()
    return ocp.PyTreeCheckpointHandler(
        use_ocdbt=True,
        use_zarr3=False,
        use_compression=True,
        type_handler_registry=registry,
        multiprocessing_options=options,
    )


def save_args(tree, expert_stacks: bool = False) -> ocp.args.PyTreeSave:
    """The save arguments of ``tree`` for ``handler()``: bounded data files and, where
    ``expert_stacks`` (every array of two or more dimensions leads with the expert axis), chunks of
    whole experts (module docstring)."""
    per_leaf = None
    if expert_stacks:
        per_leaf = jax.tree.map(
            lambda leaf: ocp.SaveArgs(shard_axes=(0,) if np.ndim(leaf) >= 2 else ()), tree
        )
    return ocp.args.PyTreeSave(
        tree, save_args=per_leaf, ocdbt_target_data_file_size=DATA_FILE_BYTES
    )


def host_views(tree):
    """``tree`` with every ``jax.Array`` whose whole value sits in one CPU buffer of this process
    (on one device, or replicated over this process's devices) replaced by a NumPy view of that
    buffer (no copy); other leaves as they are. Use it only for a synchronous save whose arrays
    nothing changes or frees meanwhile, and only where one process writes the whole tree: with
    several processes Orbax must see ``jax.Array``s to write each once."""

    def view(leaf):
        if (
            isinstance(leaf, jax.Array)
            and jax.process_count() == 1
            and leaf.is_fully_replicated
            and all(device.platform == "cpu" for device in leaf.devices())
        ):
            return np.asarray(leaf.addressable_data(0))
        return leaf

    return jax.tree.map(view, tree)
