"""What the files of a T5X checkpoint look like from outside, cheaply: the signals a resumed
compression run compares to tell that its source is the one it started from.

A *snapshot* maps each *group* of files to digests of their signals, one per
kind of signal, so that a difference names the array and the signal:

- a group is the chunk files (and zarr metadata) of one array, named by its
  param path; the format's own files (``checkpoint``, ``_METADATA``,
  ``manifest.ocdbt``), each named "the file <name>"; or, for an Orbax
  checkpoint on OCDBT, whose arrays share their data files, "the OCDBT data
  files";
- local files give their ``size``, ``mtime_ns``, ``ctime_ns`` and ``inode``
  (``os.stat``). Rewriting a file changes its mtime and ctime even when the
  size stays; replacing it changes its inode; only the kernel sets ctime, so a
  restored mtime does not hide a write. Moving the checkpoint (``mv``) keeps
  them all; copying it does not;
- other kvstores (``gs://``, ...) give each object's ``generation``, which
  changes with every write (a zero-length read returns it without data).

Each group also records its file count and, for local files, its bytes.
Taking a snapshot costs one stat per file, or one metadata request per object,
whatever the checkpoint's size; it reads no array data. What was read is
compared by content elsewhere (``read_digests``).
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

import tensorstore as ts

from qmoe_jax.checkpoints.base import T5XCheckpoint

LOCAL_SIGNALS = ("size", "mtime_ns", "ctime_ns", "inode")
REMOTE_SIGNALS = ("generation",)
DIGEST_CHARS = 16  # 64 bits of SHA-256 per signal: detection, not authentication
OCDBT_GROUP = "the OCDBT data files"
MAX_NAMED = 3


def _digest(lines: list[str]) -> str:
    return hashlib.sha256("".join(lines).encode()).hexdigest()[:DIGEST_CHARS]


def _local_stats(root: str, names: list[str] | None, skip: frozenset[str]) -> dict[str, Any]:
    """Signals of the files under the directory ``root`` (``names``: those files only)."""
    if names is None:
        names = []
        for folder, _, files in os.walk(root):
            names += [
                os.path.relpath(os.path.join(folder, name), root).replace(os.sep, "/")
                for name in files
            ]
        names = sorted(name for name in names if name not in skip)
    stats = {}
    for name in names:
        try:
            found = os.stat(os.path.join(root, name))
        except FileNotFoundError:
            continue
        stats[name] = (found.st_size, found.st_mtime_ns, found.st_ctime_ns, found.st_ino)
    group = {"files": len(stats), "bytes": sum(values[0] for values in stats.values())}
    for index, signal in enumerate(LOCAL_SIGNALS):
        group[signal] = _digest([f"{name}:{values[index]}\n" for name, values in stats.items()])
    return group


def _remote_stats(
    spec: dict, context: ts.Context, names: list[str] | None, skip: frozenset[str]
) -> dict[str, Any]:
    """Signals of the objects under the kvstore location ``spec`` (``names``: those only)."""
    store = ts.KvStore.open(spec, context=context).result()
    if names is None:
        names = sorted(
            key for key in (key.decode() for key in store.list().result()) if key not in skip
        )
    pending = {name: store.read(name.encode(), byte_range=slice(0, 0)) for name in names}
    generations = {}
    for name, future in pending.items():
        result = future.result()
        if result.state == "value":
            generations[name] = result.stamp.generation.hex()
    return {
        "files": len(generations),
        "generation": _digest([f"{name}:{value}\n" for name, value in generations.items()]),
    }


def _signals(
    spec: dict, context: ts.Context, names: list[str] | None = None, skip=frozenset()
) -> dict[str, Any]:
    if spec.get("driver") == "file":
        return _local_stats(spec["path"], names, skip)
    return _remote_stats(spec, context, names, skip)


def snapshot(checkpoint: T5XCheckpoint) -> dict[str, dict[str, Any]]:
    """``{group: {"files": n, signal: digest, ...}}`` of ``checkpoint`` (module docstring)."""
    groups: dict[str, dict[str, Any]] = {}
    metadata = frozenset(checkpoint.metadata_files)
    for name in checkpoint.metadata_files:
        groups[f"the file {name}"] = _signals(checkpoint.location, checkpoint.context, [name])
    paths = checkpoint.keys()
    for path, store in zip(paths, checkpoint.stores(paths)):
        if not isinstance(store, ts.TensorStore):
            continue  # stored inline in the msgpack file, whose signals are above
        spec = store.kvstore.spec().to_json()
        if spec.get("driver") == "ocdbt":
            if OCDBT_GROUP not in groups:
                groups[OCDBT_GROUP] = _signals(
                    checkpoint.location, checkpoint.context, skip=metadata
                )
            continue
        groups[path] = _signals(spec, checkpoint.context)
    return groups


def _change(group: str, old: dict[str, Any], new: dict[str, Any]) -> str:
    """One phrase for a group whose signals differ."""
    if "files" in old and old["files"] != new["files"]:
        return f"{group} ({old['files']} files, now {new['files']})"
    if "bytes" in old and old["bytes"] != new.get("bytes"):
        return f"{group} (its files hold {old['bytes']} bytes, now {new.get('bytes')})"
    changed = [
        signal
        for signal in LOCAL_SIGNALS + REMOTE_SIGNALS
        if signal in old and old[signal] != new.get(signal)
    ]
    return f"{group} (the {', '.join(changed)} of its files)"


def differences(old: dict[str, dict], new: dict[str, dict]) -> list[str]:
    """What differs between two snapshots, one phrase per group, in the order of ``old``; empty
    when nothing does."""
    found = [
        f"{group} (gone)" if group not in new else _change(group, old[group], new[group])
        for group in old
        if new.get(group) != old[group]
    ]
    found += [f"{group} (new)" for group in new if group not in old]
    return found


def describe_differences(found: list[str]) -> str:
    """The first few of ``differences``, and how many more."""
    shown = ", ".join(found[:MAX_NAMED])
    return shown + (f" and {len(found) - MAX_NAMED} more" if len(found) > MAX_NAMED else "")
