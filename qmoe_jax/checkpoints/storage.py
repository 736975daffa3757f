"""File access through tensorstore key-value stores, so every path works remotely too.

Lingo: a *location* is a kvstore JSON spec whose ``path`` names a directory (it
ends in "/"); a *key* is a name relative to a location; an *array* is a zarr
directory (v2 ``.zarray`` or v3 ``zarr.json``) at a location. Local paths become
``{"driver": "file"}`` specs; URLs (``file://``, ``gs://``, ``memory://``, ...)
are parsed by tensorstore. A ``memory://`` store lives in a ``ts.Context``, so
pass the same context to the writer and the reader.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any

import tensorstore as ts

from qmoe_jax.checkpoints.errors import CheckpointError, CorruptCheckpointError

PathOrUrl = str | os.PathLike | dict
MAX_LISTED_NAMES = 40


def location(path_or_url: PathOrUrl) -> dict[str, Any]:
    """Kvstore spec of a directory given as a local path, a URL or a kvstore JSON spec."""
    if isinstance(path_or_url, dict):
        spec = dict(path_or_url)
    else:
        text = os.fspath(path_or_url)
        if "://" in text:
            try:
                spec = ts.KvStore.Spec(text).to_json()
            except ValueError as error:
                raise CheckpointError(
                    f"{text!r} is not a tensorstore kvstore URL: {error}"
                ) from None
        else:
            spec = {"driver": "file", "path": os.path.abspath(os.path.expanduser(text))}
    path = spec.get("path", "")
    spec["path"] = path if path == "" or path.endswith("/") else path + "/"
    return spec


def child(spec: dict[str, Any], name: str) -> dict[str, Any]:
    """The location (``name`` ending in "/") or key ``name`` under ``spec``."""
    return dict(spec, path=spec["path"] + name)


def parent(spec: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """(parent location, last path component) of a location."""
    head, _, name = spec["path"].rstrip("/").rpartition("/")
    absolute = spec["path"].startswith("/")
    return dict(spec, path=head + "/" if head or absolute else ""), name


def describe(spec: dict[str, Any]) -> str:
    """A readable name of a location: the local path for files, else its URL."""
    if spec.get("driver") == "file":
        return spec["path"]
    try:
        return ts.KvStore.Spec(spec).url
    except ValueError:
        return str(spec)


def is_local(spec: dict[str, Any]) -> bool:
    return spec.get("driver") == "file"


def _open(spec: dict[str, Any], context: ts.Context) -> ts.KvStore:
    return ts.KvStore.open(spec, context=context).result()


def read_keys(spec: dict[str, Any], keys: Iterable[str], context: ts.Context) -> list[bytes | None]:
    """Reads several keys of one location concurrently; ``None`` for a missing key."""
    store = _open(spec, context)
    futures = [store.read(key.encode()) for key in keys]
    results = [future.result() for future in futures]
    return [bytes(r.value) if r.state == "value" else None for r in results]


def read_key(spec: dict[str, Any], key: str, context: ts.Context) -> bytes | None:
    return read_keys(spec, [key], context)[0]


def write_key(spec: dict[str, Any], key: str, value: bytes, context: ts.Context) -> None:
    _open(spec, context).write(key.encode(), value).result()


def list_names(spec: dict[str, Any], context: ts.Context) -> list[str]:
    """Top-level names under a location, directories with a trailing "/" (for messages)."""
    names = set()
    for key in _open(spec, context).list().result():
        first, slash, _ = key.decode(errors="replace").partition("/")
        names.add(first + slash)
    return sorted(names)


def format_names(names: list[str]) -> str:
    if not names:
        return "nothing (the location is empty or does not exist)"
    shown = ", ".join(names[:MAX_LISTED_NAMES])
    more = len(names) - MAX_LISTED_NAMES
    return shown + (f", ... and {more} more" if more > 0 else "")


def open_zarrs(
    arrays: Mapping[str, dict[str, Any]],
    context: ts.Context,
    *,
    where: str,
    zarr3: bool = False,
    all_chunks_stored: bool = False,
) -> dict[str, ts.TensorStore]:
    """Opens existing zarr arrays (name → location) concurrently, reading only their metadata.

    A missing chunk reads as an error, not as zeros, whenever an array has no
    fill value (T5X's zarr arrays: ``"fill_value": null``) or the writer stored
    every chunk (``all_chunks_stored``, Orbax's default). ``where`` names the
    checkpoint in error messages.
    """
    driver = "zarr3" if zarr3 else "zarr"

    def start(name: str, fill_missing: bool) -> ts.Future:
        spec = {"driver": driver, "kvstore": arrays[name], "fill_missing_data_reads": fill_missing}
        return ts.open(spec, open=True, read=True, context=context)

    pending = {name: start(name, fill_missing=False) for name in arrays}
    stores = {}
    for name, future in pending.items():
        try:
            stores[name] = future.result()
        except ValueError as error:
            metadata = "zarr.json" if zarr3 else ".zarray"
            raise CorruptCheckpointError(
                f"array {name!r} of {where}: cannot open its zarr array at "
                f"{describe(arrays[name])} "
                f"(expected a {metadata} file there): {error}. The checkpoint is incomplete or "
                "damaged; copy it again."
            ) from None
    with_fill = [name for name, store in stores.items() if store.fill_value is not None]
    if not all_chunks_stored:
        reopened = {name: start(name, fill_missing=True) for name in with_fill}
        stores.update({name: future.result() for name, future in reopened.items()})
    return stores


def read_error(what: str, error: Exception) -> CorruptCheckpointError:
    """The error for a failed chunk read (missing or undecodable chunk file)."""
    return CorruptCheckpointError(
        f"{what}: reading its data failed: {error}. A chunk file is missing or damaged; "
        "the checkpoint is incomplete, copy it again."
    )
