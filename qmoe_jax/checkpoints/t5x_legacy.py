"""Legacy T5X checkpoints: one msgpack file ``checkpoint`` and one zarr v2 array per parameter.

Layout, as t5x's ``Checkpointer.save`` writes it (t5x/checkpoints.py, ``VERSION = 3``):

- ``checkpoint_<step>/checkpoint`` is ``{"version": 3, "optimizer": {"state": ..., "target":
  params}}`` serialized by ``flax.serialization`` (numpy arrays are msgpack ext type 1 holding
  ``(shape, dtype name, C-order bytes)``, numpy scalars ext type 3; "bfloat16" is a dtype name).
- Each parameter leaf is either such an inline array (T5X does this for arrays without
  partitioning axes, e.g. t5x/testdata/test_t5_tiny.checkpoint_0 holds every array inline)
  or the JSON of a tensorstore zarr spec, ``{"driver": "zarr", "dtype": "bfloat16",
  "kvstore": {"driver": "file", "path": "target.encoder.layers_1.mlp.expert.wi.kernel/"},
  "metadata": {"chunks": [...], "compressor": {"id": "gzip", "level": 1}, "shape": [...]}}``
  (t5x/testdata/tiny_t5/checkpoint_1/checkpoint). The kvstore path is relative to the
  checkpoint directory: the "/"-joined state-dict path with "/" replaced by "." (t5x
  ``_get_spec``); old tensorstore versions put it in the spec's own ``path``.
- Version 3 stores bfloat16 natively (zarr dtype "bfloat16"); version 2 stored it as
  uint16, which t5x itself refuses to read (``_read_ts``), and so do we.
"""

from __future__ import annotations

import re
from typing import Any

import msgpack
import numpy as np
import tensorstore as ts
from flax import serialization

from qmoe_jax.checkpoints.base import ArrayInfo, T5XCheckpoint
from qmoe_jax.checkpoints.errors import CorruptCheckpointError
from qmoe_jax.checkpoints.storage import child, describe, open_zarrs, parent

MSGPACK_FILE = "checkpoint"
VERSION = 3
_TF_INDEX_PREFIX = b"model_checkpoint_path"
_STEP_DIR = re.compile(r"^checkpoint_(\d+)$")


def is_tensorstore_spec(node: Any) -> bool:
    return isinstance(node, dict) and {"driver", "metadata"} <= node.keys()


def relative_array_path(spec: dict[str, Any]) -> str | None:
    """The zarr directory of a spec leaf, relative to the checkpoint directory."""
    kvstore = spec.get("kvstore")
    if isinstance(kvstore, dict) and kvstore.get("path"):
        return kvstore["path"]
    return spec.get("path")


def spec_dtype(spec: dict[str, Any]) -> np.dtype:
    """Tensorstore dtype name ("bfloat16", "float32") or, failing that, the zarr one ("<f4")."""
    name = str(spec.get("dtype") or spec["metadata"].get("dtype"))
    return ts.dtype(name).numpy_dtype if name.isalnum() else np.dtype(name)


def decode_msgpack(data: bytes, where: str) -> dict[str, Any]:
    """Decodes and validates the ``checkpoint`` msgpack file (``where`` names it)."""
    if data.startswith(_TF_INDEX_PREFIX):
        raise CorruptCheckpointError(
            f"{where} is a TensorFlow checkpoint index, not a T5X checkpoint; convert it to T5X "
            "first (t5x/scripts/convert_tf_checkpoint.py)"
        )
    try:
        contents = serialization.msgpack_restore(data)
    except (ValueError, TypeError, msgpack.UnpackException) as error:
        raise CorruptCheckpointError(
            f"{where} is not a readable msgpack file ({len(data)} bytes): {error}. "
            "The file is truncated or damaged; copy the checkpoint again."
        ) from None
    target = contents.get("optimizer", {}).get("target") if isinstance(contents, dict) else None
    if not isinstance(target, dict):
        keys = sorted(contents) if isinstance(contents, dict) else type(contents).__name__
        raise CorruptCheckpointError(
            f"{where} is a msgpack file but not a T5X checkpoint: expected "
            f"{{'version': 3, 'optimizer': {{'target': params, ...}}}}, found top level {keys}"
        )
    return contents


def flatten_target(node: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Param path → spec dict or inline array; ``None`` and empty subtrees are skipped."""
    leaves: dict[str, Any] = {}
    for key, value in node.items():
        path = f"{prefix}{key}"
        if is_tensorstore_spec(value):
            leaves[path] = value
        elif isinstance(value, dict):
            leaves.update(flatten_target(value, path + "/"))
        elif isinstance(value, (np.ndarray, np.generic, int, float)):
            leaves[path] = np.asarray(value)
    return leaves


def _step(location: dict[str, Any], contents: dict[str, Any]) -> int | None:
    match = _STEP_DIR.match(parent(location)[1])
    if match:
        return int(match.group(1))
    step = contents["optimizer"].get("state", {}).get("step")
    return int(step) if isinstance(step, (np.ndarray, np.generic)) and np.ndim(step) == 0 else None


class LegacyT5XCheckpoint(T5XCheckpoint):
    """A legacy (msgpack + zarr) T5X checkpoint; see the module docstring for the layout."""

    format = "legacy"
    metadata_files = (MSGPACK_FILE,)

    def __init__(self, location: dict[str, Any], data: bytes, context: ts.Context):
        where = describe(child(location, MSGPACK_FILE))
        contents = decode_msgpack(data, where)
        super().__init__(location, _step(location, contents), context)
        self.version = contents.get("version")
        self._leaves = dict(sorted(flatten_target(contents["optimizer"]["target"]).items()))
        self._spec = {path: self._info(path, leaf, where) for path, leaf in self._leaves.items()}

    def _info(self, path: str, leaf: Any, where: str) -> ArrayInfo:
        if isinstance(leaf, np.ndarray):
            return ArrayInfo(path, leaf.shape, leaf.dtype, None)
        try:
            dtype = spec_dtype(leaf)
            metadata = leaf["metadata"]
            shape = tuple(metadata["shape"])
            info = ArrayInfo(path, shape, dtype, tuple(metadata.get("chunks", shape)))
        except (KeyError, TypeError, ValueError) as error:
            raise CorruptCheckpointError(
                f"{where}: the tensorstore spec of {path!r} is invalid ({error!r}): {leaf}"
            ) from None
        if relative_array_path(leaf) is None:
            raise CorruptCheckpointError(
                f"{where}: the tensorstore spec of {path!r} names no path: {leaf}"
            )
        if dtype == np.uint16 and (self.version or 0) < VERSION:
            raise CorruptCheckpointError(
                f"{where} is a version-{self.version} T5X checkpoint that stores bfloat16 "
                f"{path!r} as "
                "uint16; like t5x, we only read version 3 (native bfloat16). Re-save it with a "
                "current t5x."
            )
        return info

    def spec(self) -> dict[str, ArrayInfo]:
        return self._spec

    def _open_sources(self, paths: list[str]) -> dict[str, Any]:
        sources = {
            path: self._leaves[path] for path in paths if isinstance(self._leaves[path], np.ndarray)
        }
        arrays = {
            path: child(self.location, relative_array_path(self._leaves[path]).strip("/") + "/")
            for path in paths
            if path not in sources
        }
        stores = open_zarrs(arrays, self._context, where=self.url)
        for path, store in stores.items():
            info = self._spec[path]
            if tuple(store.shape) != info.shape or store.dtype.numpy_dtype != info.dtype:
                raise CorruptCheckpointError(
                    f"array {path!r} of {self.url}: its zarr metadata says {tuple(store.shape)} "
                    f"{store.dtype.numpy_dtype} but the msgpack spec says {info.shape} "
                    f"{info.dtype}; "
                    "the checkpoint is inconsistent"
                )
        return sources | stores
