"""What identifies a T5X checkpoint's model, cheaply: the fingerprint a resumed compression run
compares.

Two hex SHA-256 digests:

- ``arrays``: every array's param path, shape and dtype;
- ``content``: the format's own files (legacy: the ``checkpoint`` msgpack file,
  which also holds the arrays stored inline; Orbax: ``_METADATA`` and the OCDBT
  root ``manifest.ocdbt``, which changes with every save), then the first
  ``SAMPLE_BYTES`` of the first chunk file of every zarr array, as stored
  (compressed).

A copy of a checkpoint has the fingerprint of the original; another model, or
the same directory saved again, has another. It costs one small read per array,
whatever the checkpoint's size.
"""

from __future__ import annotations

import hashlib

import tensorstore as ts

from qmoe_jax.checkpoints.base import T5XCheckpoint
from qmoe_jax.checkpoints.storage import read_keys

SAMPLE_BYTES = 4096


def first_chunk_key(store: ts.TensorStore) -> str:
    """The storage key of chunk (0, …, 0) of a zarr v2 or v3 array, relative to the array's
    directory."""
    metadata = store.spec().to_json()["metadata"]
    zeros = ["0"] * store.rank
    if metadata.get("zarr_format") == 2:
        return metadata.get("dimension_separator", ".").join(zeros) or "0"
    encoding = metadata.get("chunk_key_encoding", {"name": "default"})
    default = encoding["name"] == "default"
    separator = encoding.get("configuration", {}).get("separator", "/" if default else ".")
    return separator.join((["c"] if default else []) + zeros) or "0"


def source_fingerprint(checkpoint: T5XCheckpoint) -> dict[str, str]:
    """``{"arrays": …, "content": …}`` of ``checkpoint`` (see the module docstring)."""
    spec = checkpoint.spec()
    arrays = hashlib.sha256(
        "".join(f"{path} {info.shape} {info.dtype.name}\n" for path, info in spec.items()).encode()
    )
    content = hashlib.sha256()
    files = read_keys(checkpoint.location, checkpoint.metadata_files, checkpoint.context)
    for name, data in zip(checkpoint.metadata_files, files):
        content.update(
            f"{name} {len(data) if data is not None else 'missing'}\n".encode() + (data or b"")
        )
    paths = list(spec)
    chunks = {
        path: (store.kvstore, first_chunk_key(store))
        for path, store in zip(paths, checkpoint.stores(paths))
        if isinstance(store, ts.TensorStore)
    }
    samples = {
        path: kvstore.read(key, byte_range=slice(0, SAMPLE_BYTES))
        for path, (kvstore, key) in chunks.items()
    }
    for path, pending in samples.items():
        try:
            sample = pending.result()
        except ValueError:  # a chunk file shorter than SAMPLE_BYTES: read it whole
            kvstore, key = chunks[path]
            sample = kvstore.read(key).result()
        data = sample.value if sample.state == "value" else b""
        content.update(
            f"{path} {len(data) if sample.state == 'value' else 'missing'}\n".encode() + data
        )
    return {"arrays": arrays.hexdigest(), "content": content.hexdigest()}
