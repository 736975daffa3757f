"""Orbax T5X checkpoints: ``checkpoint_<step>/state/``, an Orbax PyTree checkpoint on OCDBT.

Layout, as t5x's ``OrbaxCheckpointManagerInterface`` writes it (t5x/checkpoints.py: an
Orbax ``CheckpointManager`` with ``step_prefix="checkpoint"`` and an item ``"state"``
saved by ``PyTreeCheckpointHandler(use_ocdbt=True)`` from ``train_state.state_dict()``,
i.e. ``{"target": params, "state": {"step": ..., ...}}``):

- ``state/_METADATA`` is JSON: ``{"tree_metadata": {"('target', 'encoder', ...)":
  {"key_metadata": [{"key": "target", "key_type": 2}, ...], "value_metadata":
  {"value_type": "np.ndarray", "skip_deserialize": false}}, ...}, "use_ocdbt": true,
  "use_zarr3": false, "store_array_data_equal_to_fill_value": true}``
  (orbax/checkpoint/_src/metadata/tree.py; key_type 2 = dict key, 1 = sequence index).
- The arrays live in an OCDBT database rooted at ``state/`` (``manifest.ocdbt``; each
  process writes ``ocdbt.process_<i>/`` and the root manifest joins them), each a zarr
  array under the "."-joined key path: ``target.encoder.layers_1.mlp.expert.wi.kernel/``.
  Without OCDBT the same names are plain directories under ``state/``.
- Chunks: Orbax writes one chunk per array shard (or per ``SaveArgs.chunk_byte_size``),
  so a slice read of an expert-sharded stack touches only that shard's chunk.

T5X itself detects this format by the presence of ``_METADATA`` (t5x/checkpoint_utils.py,
``detect_checkpoint_type``). We read it with tensorstore alone; no Orbax import.
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any

import tensorstore as ts

from qmoe_jax.checkpoints.base import ArrayInfo, T5XCheckpoint
from qmoe_jax.checkpoints.errors import CorruptCheckpointError
from qmoe_jax.checkpoints.storage import child, describe, open_zarrs, parent

METADATA_FILE = "_METADATA"
STATE_DIR = "state"
OCDBT_MANIFEST = "manifest.ocdbt"  # the OCDBT root; it changes with every save
ARRAY_VALUE_TYPES = frozenset({"np.ndarray", "jax.Array", "scalar"})
_STEP_DIR = re.compile(r"^checkpoint_(\d+)$")


def _key_path(tree_key: str, entry: dict[str, Any]) -> list[str]:
    if "key_metadata" in entry:
        return [str(k["key"]) for k in entry["key_metadata"]]
    return [str(k) for k in ast.literal_eval(tree_key)]


def decode_metadata(data: bytes, where: str) -> tuple[dict[str, str], dict[str, Any]]:
    """(param path → storage name, the ``_METADATA`` JSON) for the arrays under ``target``."""
    try:
        metadata = json.loads(data)
        tree = metadata["tree_metadata"]
        entries = {
            tree_key: (_key_path(tree_key, entry), entry.get("value_metadata", {}))
            for tree_key, entry in tree.items()
        }
    except (ValueError, KeyError, TypeError, SyntaxError) as error:
        raise CorruptCheckpointError(
            f"{where} is not a readable Orbax PyTree metadata file ({len(data)} bytes): {error!r}"
        ) from None
    names = {}
    for keys, value in entries.values():
        if (
            keys[0] == "target"
            and len(keys) > 1
            and not value.get("skip_deserialize", False)
            and value.get("value_type") in ARRAY_VALUE_TYPES
        ):
            names["/".join(keys[1:])] = ".".join(keys)
    if not names:
        roots = sorted({keys[0] for keys, _ in entries.values()})
        raise CorruptCheckpointError(
            f"{where} is an Orbax checkpoint without a T5X 'target' tree of arrays "
            f"(top-level keys: {roots}); expected T5X's {{'target': params, 'state': ...}}"
        )
    return dict(sorted(names.items())), metadata


class OrbaxT5XCheckpoint(T5XCheckpoint):
    """An Orbax T5X checkpoint, read through tensorstore; ``location`` is its ``state/``
    directory."""

    format = "orbax"
    metadata_files = (METADATA_FILE, OCDBT_MANIFEST)

    def __init__(self, location: dict[str, Any], data: bytes, context: ts.Context):
        directory, name = parent(location)
        match = _STEP_DIR.match(parent(directory)[1] if name == STATE_DIR else name)
        super().__init__(location, int(match.group(1)) if match else None, context)
        self._names, metadata = decode_metadata(data, describe(child(location, METADATA_FILE)))
        self._zarr3 = bool(metadata.get("use_zarr3", False))
        self._all_chunks_stored = bool(metadata.get("store_array_data_equal_to_fill_value", False))
        self._use_ocdbt = bool(metadata.get("use_ocdbt", True))
        self._spec: dict[str, ArrayInfo] | None = None

    def _array_location(self, name: str) -> dict[str, Any]:
        if self._use_ocdbt:
            return {"driver": "ocdbt", "base": self.location, "path": name + "/"}
        return child(self.location, name + "/")

    def _open_sources(self, paths: list[str]) -> dict[str, Any]:
        arrays = {path: self._array_location(self._names[path]) for path in paths}
        return open_zarrs(
            arrays,
            self._context,
            where=self.url,
            zarr3=self._zarr3,
            all_chunks_stored=self._all_chunks_stored,
        )

    def keys(self) -> list[str]:
        """Sorted param paths, from ``_METADATA`` alone (no array is opened)."""
        return list(self._names)

    def __contains__(self, path: str) -> bool:
        return path in self._names

    @staticmethod
    def _array_info(path: str, store: ts.TensorStore) -> ArrayInfo:
        return ArrayInfo(
            path,
            tuple(store.shape),
            store.dtype.numpy_dtype,
            tuple(store.chunk_layout.read_chunk.shape),
        )

    def info(self, path: str) -> ArrayInfo:
        """``ArrayInfo`` of one param path; opens only that array (reads its zarr metadata)."""
        if self._spec is None and path in self._names:
            (store,) = self._sources([path])
            return self._array_info(path, store)
        return super().info(path)

    def spec(self) -> dict[str, ArrayInfo]:
        """Every parameter's ``ArrayInfo``; the first call reads each array's zarr metadata."""
        if self._spec is None:
            stores = self._sources(list(self._names))
            self._spec = {
                path: self._array_info(path, store) for path, store in zip(self._names, stores)
            }
        return self._spec
