"""The compressed checkpoint (format v1): Orbax trees plus a JSON manifest.

Layout of an output directory::

    manifest.json          format version; header (model config, source, grid, settings); dictionaries; layers
    dense/                 Orbax tree: every parameter except the expert kernels (as in the source)
    dictionaries/<fp16>/   Orbax tree {"entries": uint32[65536, 2]}, one per distinct dictionary
    layers/<layer>/        one finished sparse layer: arrays/ (Orbax) + layer.json (stats, checksums)
    report.json, report.png

``<layer>`` is the dotted path of a sparse MLP, e.g. ``encoder.layers_1.mlp``.
Its arrays are ``{kernel: {...}}`` per expert kernel (``wi``, ``wo``, or
``wi_0``, ``wi_1``, ``wo``): for ternary codes ``codes uint16[E, n]``,
``row_offsets int32[E, rows+1]``, ``minmax bfloat16[E, rows, 2]`` (rows = output
features, i.e. the T5X kernel transposed); for k-bit grids ``codes uint8[E, rows,
cols]`` and ``grid_params float32[E, rows, 2]`` (scale, zero). docs/format.md §8 has the whole layout.

Each layer is written into a temporary directory and renamed into place, and
the manifest is replaced atomically after it, so a crash (even kill -9) leaves
either the finished layer or nothing; a re-run resumes after the last finished
layer. Every array carries a SHA-256 in layer.json; loading verifies them, and
the dictionary fingerprints, and names the array that fails.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from typing import Any

import numpy as np
import orbax.checkpoint as ocp
from flax import traverse_util

from qmoe_jax.codec.dictionary import Dictionary, fingerprint_of

FORMAT_VERSION = 1
MANIFEST = "manifest.json"


class CompressedCheckpointError(ValueError):
    """A compressed checkpoint is missing, corrupt, or does not match what was asked for."""


def array_checksum(array: np.ndarray) -> str:
    """SHA-256 of the array's dtype, shape and C-order bytes."""
    array = np.ascontiguousarray(array)
    digest = hashlib.sha256(f"{array.dtype.str}{array.shape}".encode())
    digest.update(array.tobytes())
    return digest.hexdigest()


def _flat_checksums(tree: dict) -> dict[str, str]:
    flat = traverse_util.flatten_dict(tree, sep="/")
    return {path: array_checksum(np.asarray(value)) for path, value in sorted(flat.items())}


def _write_json_atomic(path: str, payload: Any) -> None:
    temporary = path + ".tmp"
    with open(temporary, "w") as f:
        json.dump(payload, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, path)


def _save_tree(path: str, tree: dict) -> None:
    ocp.PyTreeCheckpointer().save(path, tree)


def _restore_tree(path: str) -> dict:
    if not os.path.isdir(path):
        raise CompressedCheckpointError(f"{path} is missing; the compressed checkpoint is incomplete")
    try:
        return ocp.PyTreeCheckpointer().restore(path)
    except Exception as error:  # orbax raises many types for damaged trees
        raise CompressedCheckpointError(f"cannot read the Orbax tree at {path}: {error}") from error


def _verify(tree: dict, checksums: dict[str, str], where: str) -> None:
    found = _flat_checksums(tree)
    for path, expected in checksums.items():
        if path not in found:
            raise CompressedCheckpointError(f"{where}: array {path} is missing")
        if found[path] != expected:
            raise CompressedCheckpointError(
                f"{where}: checksum mismatch for array {path} (the file is corrupt; "
                "re-run compression for this layer by deleting its directory)"
            )


class CompressedCheckpointWriter:
    """Writes (or resumes writing) a compressed checkpoint directory.

    Args:
      directory: output directory (created if missing).
      header: run description stored in the manifest (config, source,
        settings). Resuming requires the same header, so that a resumed run
        can never mix layers made with different settings.
    """

    def __init__(self, directory: str, header: dict):
        directory = os.path.abspath(directory)  # Orbax writes absolute paths only
        self.directory = directory
        os.makedirs(os.path.join(directory, "layers"), exist_ok=True)
        os.makedirs(os.path.join(directory, "dictionaries"), exist_ok=True)
        path = os.path.join(directory, MANIFEST)
        if os.path.exists(path):
            with open(path) as f:
                self.manifest = json.load(f)
            if self.manifest.get("header") != json.loads(json.dumps(header)):
                raise CompressedCheckpointError(
                    f"{directory} holds a compressed checkpoint made with other settings; "
                    "use a new --output_dir, or delete it to start over"
                )
        else:
            self.manifest = {"format_version": FORMAT_VERSION, "header": header, "dense": None,
                             "dictionaries": {}, "layers": {}, "complete": False}
            _write_json_atomic(path, self.manifest)
        for name in os.listdir(os.path.join(directory, "layers")):
            if name not in self.manifest["layers"]:
                shutil.rmtree(os.path.join(directory, "layers", name))  # unfinished leftovers

    def _commit(self) -> None:
        _write_json_atomic(os.path.join(self.directory, MANIFEST), self.manifest)

    def finished_layers(self) -> list[str]:
        return list(self.manifest["layers"])

    def has_dense(self) -> bool:
        return self.manifest["dense"] is not None

    def write_dense(self, params: dict) -> None:
        """Saves the non-expert parameters (nested dict of arrays)."""
        path = os.path.join(self.directory, "dense")
        if os.path.exists(path):
            shutil.rmtree(path)
        _save_tree(path, params)
        self.manifest["dense"] = {"checksums": _flat_checksums(params)}
        self._commit()

    def write_dictionary(self, dictionary: Dictionary) -> str:
        """Saves a dictionary once; returns its fingerprint."""
        fingerprint = dictionary.fingerprint
        if fingerprint not in self.manifest["dictionaries"]:
            path = os.path.join(self.directory, "dictionaries", fingerprint[:16])
            if os.path.exists(path):
                shutil.rmtree(path)
            _save_tree(path, {"entries": np.asarray(dictionary.entries)})
            self.manifest["dictionaries"][fingerprint] = {"p0": dictionary.p0, "directory": fingerprint[:16]}
            self._commit()
        return fingerprint

    def write_layer(self, name: str, arrays: dict, stats: dict) -> None:
        """Atomically saves one finished sparse layer (``arrays`` as in the module docstring)."""
        final = os.path.join(self.directory, "layers", name)
        staging = final + ".partial"
        for path in (final, staging):
            if os.path.exists(path):
                shutil.rmtree(path)
        os.makedirs(staging)
        _save_tree(os.path.join(staging, "arrays"), arrays)
        record = {"stats": stats, "checksums": _flat_checksums(arrays)}
        _write_json_atomic(os.path.join(staging, "layer.json"), record)
        os.replace(staging, final)
        self.manifest["layers"][name] = record
        self._commit()

    def finalize(self, report: dict) -> None:
        self.manifest["complete"] = True
        self.manifest["report"] = report
        self._commit()


class CompressedCheckpoint:
    """A finished (or partial) compressed checkpoint opened for reading."""

    def __init__(self, directory: str):
        directory = os.path.abspath(directory)
        path = os.path.join(directory, MANIFEST)
        if not os.path.isfile(path):
            raise CompressedCheckpointError(
                f"{directory} is not a qmoe_jax compressed checkpoint (no {MANIFEST}); "
                "make one with `python -m qmoe_jax.compress`"
            )
        with open(path) as f:
            self.manifest = json.load(f)
        version = self.manifest.get("format_version")
        if version != FORMAT_VERSION:
            raise CompressedCheckpointError(
                f"{directory} has format version {version}; this qmoe_jax reads version {FORMAT_VERSION}"
            )
        self.directory = directory

    @property
    def header(self) -> dict:
        return self.manifest["header"]

    @property
    def complete(self) -> bool:
        return bool(self.manifest.get("complete"))

    def layer_names(self) -> list[str]:
        return list(self.manifest["layers"])

    def dense_params(self) -> dict:
        if self.manifest["dense"] is None:
            raise CompressedCheckpointError(f"{self.directory} has no dense parameters yet")
        tree = _restore_tree(os.path.join(self.directory, "dense"))
        _verify(tree, self.manifest["dense"]["checksums"], "dense parameters")
        return tree

    def dictionary(self, fingerprint: str) -> Dictionary:
        record = self.manifest["dictionaries"].get(fingerprint)
        if record is None:
            raise CompressedCheckpointError(f"dictionary {fingerprint[:16]}… is not in {self.directory}")
        tree = _restore_tree(os.path.join(self.directory, "dictionaries", record["directory"]))
        entries = np.asarray(tree["entries"])
        if fingerprint_of(entries) != fingerprint:
            raise CompressedCheckpointError(
                f"dictionary {record['directory']} does not match its fingerprint (corrupt file)"
            )
        return Dictionary.from_entries(entries, record["p0"])

    def layer(self, name: str) -> tuple[dict, dict]:
        """(arrays, stats) of a finished sparse layer, checksums verified."""
        record = self.manifest["layers"].get(name)
        if record is None:
            raise CompressedCheckpointError(
                f"layer {name} is not in {self.directory} (finished: {', '.join(self.layer_names()) or 'none'})"
            )
        tree = _restore_tree(os.path.join(self.directory, "layers", name, "arrays"))
        _verify(tree, record["checksums"], f"layer {name}")
        return tree, record["stats"]
