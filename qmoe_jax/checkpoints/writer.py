"""Writing T5X checkpoints as t5x lays them out: legacy msgpack + zarr, or Orbax on OCDBT.

Used for the bundled model and for test fixtures. What is written is t5x's
``InferenceState.state_dict()`` (t5x/train_state.py): ``{"target": params,
"state": {"step": int32}}``, with no optimizer slots.

Legacy chunking. t5x chooses the zarr chunks of an array from the part one host
writes (its shard): for a ``jax.Array`` the chunk is the shard itself (jax
``array_serialization``); for a numpy array it is the largest shape dividing the
shard with at most 64 MiB / itemsize elements, shrinking the largest dimension
first (t5x/checkpoints.py, ``_choose_chunk_shape``); the compressor is gzip.
Switch runs shard the expert axis, so we take ``experts_per_chunk`` experts as the
shard of an expert stack (``[experts_per_chunk, d, f]``) and the whole array as
the shard of anything else, then apply the 64 MiB rule. A slice read of one expert
then touches one chunk.

Atomicity. A local checkpoint is written to ``checkpoint_<step>.tmp-<ns>/`` and
renamed, as t5x does. Other kvstores cannot rename; there the arrays go first and
the ``checkpoint`` msgpack file last, and readers need that file, so a torn write
is never taken for a checkpoint. Orbax commits atomically by itself.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Mapping, Sequence
from typing import Any

import ml_dtypes
import numpy as np
import tensorstore as ts
from flax import serialization

from qmoe_jax.checkpoints.base import unflatten
from qmoe_jax.checkpoints.errors import CheckpointError
from qmoe_jax.checkpoints.storage import (
    PathOrUrl,
    child,
    describe,
    is_local,
    location,
    read_key,
    write_key,
)
from qmoe_jax.checkpoints.t5x_legacy import MSGPACK_FILE, VERSION
from qmoe_jax.checkpoints.t5x_orbax import STATE_DIR

DESIRED_CHUNK_BYTES = 64 * 1024 * 1024
FORMATS = ("legacy", "orbax")


def t5x_chunk_shape(write_shape: Sequence[int], target_elements: int) -> tuple[int, ...]:
    """Largest chunk dividing ``write_shape`` with at most ``target_elements`` elements.

    Greedy, as t5x: while too large, replace the largest chunk dimension (the
    first one on ties) by its next smaller divisor of the write shape.
    """
    divisors = [
        [d for d in range(1, max(size, 1) + 1) if max(size, 1) % d == 0] for size in write_shape
    ]
    while int(np.prod([d[-1] for d in divisors])) > target_elements:
        largest = max(range(len(divisors)), key=lambda i: (divisors[i][-1], -i))
        divisors[largest].pop()
    return tuple(d[-1] for d in divisors)


def _is_floating(dtype: np.dtype) -> bool:
    return dtype.kind == "f" or dtype == ml_dtypes.bfloat16


def _flatten(
    params: Mapping[str, Any], prefix: tuple[str, ...] = ()
) -> dict[tuple[str, ...], np.ndarray]:
    flat = {}
    for key, value in params.items():
        if not isinstance(key, str) or not key or "/" in key or "." in key:
            raise CheckpointError(
                f"parameter key {key!r} under {'/'.join(prefix) or 'the root'} is not a name T5X "
                "can "
                "store: keys must be non-empty strings without '/' or '.'"
            )
        if isinstance(value, Mapping):
            flat.update(_flatten(value, prefix + (key,)))
        else:
            array = np.asarray(value)
            if array.dtype.kind not in "biu" and not _is_floating(array.dtype):
                raise CheckpointError(
                    f"parameter {'/'.join(prefix + (key,))} has dtype {array.dtype}; "
                    "only numeric arrays can be stored"
                )
            flat[prefix + (key,)] = array
    return flat


def _is_expert_stack(keys: tuple[str, ...], array: np.ndarray) -> bool:
    return "expert" in keys and array.ndim >= 1


def _chunks(
    keys: tuple[str, ...], array: np.ndarray, experts_per_chunk: int | None
) -> tuple[int, ...]:
    write_shape = array.shape
    if experts_per_chunk is not None and _is_expert_stack(keys, array):
        if array.shape[0] % experts_per_chunk:
            raise CheckpointError(
                f"{'/'.join(keys)} holds {array.shape[0]} experts, not a multiple of "
                f"experts_per_chunk={experts_per_chunk}"
            )
        write_shape = (experts_per_chunk,) + array.shape[1:]
    return t5x_chunk_shape(write_shape, DESIRED_CHUNK_BYTES // array.dtype.itemsize)


def _legacy_spec(
    keys: tuple[str, ...], array: np.ndarray, chunks: tuple[int, ...]
) -> dict[str, Any]:
    """The spec JSON t5x puts in the msgpack file, kvstore path relative to the checkpoint."""
    return ts.Spec(
        {
            "driver": "zarr",
            "dtype": ts.dtype(array.dtype).name,
            "kvstore": {"driver": "file", "path": ".".join(("target",) + keys)},
            "metadata": {
                "compressor": {"id": "gzip"},
                "shape": list(array.shape),
                "chunks": list(chunks),
            },
        }
    ).to_json()


def _sorted_tree(tree: Any) -> Any:
    """Keys in sorted order at every level, as ``jax.tree_util.tree_map`` leaves t5x's state
    dict."""
    if isinstance(tree, dict):
        return {key: _sorted_tree(tree[key]) for key in sorted(tree)}
    return tree


def _write_legacy(
    final: dict, staging: dict, step: int, arrays: dict, experts_per_chunk, context
) -> None:
    specs, writes = {}, []
    for keys, array in arrays.items():
        spec = _legacy_spec(keys, array, _chunks(keys, array, experts_per_chunk))
        store = ts.open(
            dict(spec, kvstore=child(staging, spec["kvstore"]["path"])),
            create=True,
            context=context,
        ).result()
        writes.append(store.write(array))
        specs["/".join(keys)] = spec
    for write in writes:
        write.result()
    contents = {
        "version": VERSION,
        "optimizer": {"state": {"step": np.int32(step)}, "target": _sorted_tree(unflatten(specs))},
    }
    # in_place=True keeps key order and lists as given; t5x's to_bytes does the same, and this
    # reproduces t5x/testdata/tiny_t5/checkpoint_1/checkpoint byte for byte from its contents.
    write_key(
        staging, MSGPACK_FILE, serialization.msgpack_serialize(contents, in_place=True), context
    )
    if staging is not final:
        os.rename(staging["path"].rstrip("/"), final["path"].rstrip("/"))


def _write_orbax(root: dict, step: int, arrays: dict, experts_per_chunk: int | None) -> None:
    import orbax.checkpoint as ocp  # heavy; only this writer needs it (the reader uses tensorstore)

    def save_args(keys: tuple[str, ...], array: np.ndarray) -> Any:
        if experts_per_chunk is None or not _is_expert_stack(keys, array):
            return ocp.SaveArgs()
        return ocp.SaveArgs(chunk_byte_size=experts_per_chunk * array[0].nbytes, shard_axes=(0,))

    state = {
        "target": unflatten({"/".join(k): a for k, a in arrays.items()}),
        "state": {"step": np.int32(step)},
    }
    args = {
        "target": unflatten({"/".join(k): save_args(k, a) for k, a in arrays.items()}),
        "state": {"step": ocp.SaveArgs()},
    }
    options = ocp.CheckpointManagerOptions(step_prefix="checkpoint", create=True)
    handlers = {STATE_DIR: ocp.PyTreeCheckpointHandler(use_ocdbt=True)}
    with ocp.CheckpointManager(root["path"], options=options, item_handlers=handlers) as manager:
        manager.save(
            step, args=ocp.args.Composite(**{STATE_DIR: ocp.args.PyTreeSave(state, save_args=args)})
        )
        manager.wait_until_finished()


def write_t5x_checkpoint(
    path: PathOrUrl,
    params: Mapping[str, Any],
    step: int,
    format: str = "legacy",
    dtype: Any = None,
    *,
    experts_per_chunk: int | None = 1,
    context: ts.Context | None = None,
) -> str:
    """Writes ``params`` as the T5X checkpoint ``<path>/checkpoint_<step>/``.

    Args:
      path: the model directory (t5x's ``checkpoints_dir``): a local path, a
        kvstore URL or spec (``memory://`` for tests; Orbax needs a local path).
      params: nested dict of arrays, the T5X ``target`` tree, e.g.
        ``{"encoder": {"layers_1": {"mlp": {"expert": {"wi": {"kernel": [E, d, f]}}}}}}``.
      step: training step; names the directory and is stored as ``state/step``.
      format: "legacy" (msgpack + zarr v2, gzip) or "orbax" (OCDBT, under ``state/``).
      dtype: cast floating arrays to this dtype first (e.g. ``"bfloat16"``), as
        t5x's ``save_dtype``; ``None`` stores them as given.
      experts_per_chunk: experts per chunk of an expert stack (the shard of the
        expert axis; see the module docstring); ``None`` chunks every array whole
        (t5x's single-host rule), so expert slices share chunks.
      context: tensorstore context (share it with the reader for ``memory://``).

    Returns:
      The checkpoint directory, to pass to ``open_t5x_checkpoint``.
    """
    if format not in FORMATS:
        raise CheckpointError(f"format must be one of {FORMATS}, got {format!r}")
    context = ts.Context() if context is None else context
    root = location(path)
    final = child(root, f"checkpoint_{int(step)}/")
    arrays = _flatten(params)
    if not arrays:
        raise CheckpointError("params holds no arrays; nothing to write")
    if dtype is not None:
        target_dtype = np.dtype(dtype)
        arrays = {
            k: a.astype(target_dtype) if _is_floating(a.dtype) else a for k, a in arrays.items()
        }
    exists = (
        os.path.exists(final["path"]) if is_local(root) else read_key(final, MSGPACK_FILE, context)
    )
    if exists:
        raise CheckpointError(f"{describe(final)} already exists; delete it or write another step")
    if format == "orbax":
        if not is_local(root):
            raise CheckpointError(f"the Orbax writer needs a local directory, got {describe(root)}")
        _write_orbax(root, int(step), arrays, experts_per_chunk)
        return describe(final)
    staging = (
        child(root, f"checkpoint_{int(step)}.tmp-{time.time_ns()}/") if is_local(root) else final
    )
    try:
        _write_legacy(final, staging, int(step), arrays, experts_per_chunk, context)
    except BaseException:
        if staging is not final:
            shutil.rmtree(staging["path"], ignore_errors=True)
        raise
    return describe(final)
