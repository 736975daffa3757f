"""Which directories a command may write into, and one writer at a time.

The rules, for every command that writes an output directory:

- It writes only into a directory that is new, empty, or an output of its own
  kind that qmoe_jax made, recognized by the ``"format"`` marker of the
  directory's ``manifest.json`` (``OutputKind``), or, when that manifest was
  lost, by the names of everything the directory holds. Anything else is
  refused before any work starts, with a message that names the directory and
  what it holds.
- It holds an exclusive lock (``fcntl.flock`` on ``.qmoe_jax.lock`` in the
  directory) while it runs, so a second writer is refused, naming the first.
  The lock file stays; only the lock on it is released.
- It deletes only files it wrote itself; each writer names the entries it owns.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
from collections.abc import Callable, Iterator

MANIFEST = "manifest.json"
UNFINISHED_MANIFEST = MANIFEST + ".tmp"  # written, fsynced, then renamed over MANIFEST
LOCK_FILE = ".qmoe_jax.lock"
MAX_LISTED = 5


class OutputDirectoryError(ValueError):
    """An output directory that a command may not write into, or that another process is writing."""


@dataclasses.dataclass(frozen=True)
class OutputKind:
    """A kind of output directory that qmoe_jax writes.

    Attributes:
      marker: the value of its manifest's ``"format"`` field, e.g. ``"qmoe_jax.compressed"``.
      description: what such a directory is, for messages ("a qmoe_jax compressed checkpoint").
      written_before_marker: recognizes the manifests of this kind written before the marker
        existed.
      lost_manifest: recognizes, by the names of what it holds, a directory of this kind whose
        manifest is missing and can be rebuilt by the writer; such a directory is writable.
    """

    marker: str
    description: str
    written_before_marker: Callable[[dict], bool] = lambda manifest: False
    lost_manifest: Callable[[str], bool] = lambda directory: False

    def owns(self, manifest: dict) -> bool:
        if "format" in manifest:
            return manifest["format"] == self.marker
        return self.written_before_marker(manifest)


def read_json_object(path: str) -> dict | None:
    """The JSON object in the file at ``path``; None when the file is missing, unreadable or holds
    anything else."""
    try:
        with open(path) as f:
            value = json.load(f)
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def _listing(names: list[str]) -> str:
    shown = ", ".join(names[:MAX_LISTED])
    return shown + (f" and {len(names) - MAX_LISTED} more" if len(names) > MAX_LISTED else "")


def _entries(directory: str) -> list[str]:
    """Names in ``directory`` (directories with a trailing "/"), the lock file left out."""
    with os.scandir(directory) as entries:
        return sorted(
            entry.name + ("/" if entry.is_dir() else "")
            for entry in entries
            if entry.name != LOCK_FILE
        )


def check_writable(directory: str, kind: OutputKind) -> None:
    """Raises ``OutputDirectoryError`` unless ``directory`` is new, empty, or an output of
    ``kind``."""
    if not os.path.exists(directory):
        return
    if not os.path.isdir(directory):
        raise OutputDirectoryError(
            f"{directory} is a file, not a directory; choose a new directory for the output"
        )
    names = _entries(directory)
    if not names:
        return
    manifest = read_json_object(os.path.join(directory, MANIFEST))
    if manifest is not None and kind.owns(manifest):
        return
    unfinished = read_json_object(os.path.join(directory, UNFINISHED_MANIFEST))
    if names == [UNFINISHED_MANIFEST] and unfinished is not None and kind.owns(unfinished):
        return  # a run stopped while writing its first manifest
    if MANIFEST not in names and kind.lost_manifest(directory):
        return  # the writer rebuilds the manifest, or says why it cannot
    if MANIFEST in names and manifest is None:
        raise OutputDirectoryError(
            f"{directory}/{MANIFEST} is not a readable JSON object (damaged, or another tool's), "
            "so qmoe_jax will "
            f"not write there; choose a new or empty directory (or delete {directory} to start "
            "over)"
        )
    if MANIFEST in names:
        raise OutputDirectoryError(
            f'{directory} holds a {MANIFEST} that is not {kind.description}\'s (it lacks "format": '
            f'"{kind.marker}"), so qmoe_jax will not write there; choose a new or empty directory'
        )
    raise OutputDirectoryError(
        f"{directory} is not empty and is not {kind.description} (it holds {_listing(names)}), so "
        "qmoe_jax will "
        "not write there; choose a new or empty directory"
    )


@contextlib.contextmanager
def locked(directory: str) -> Iterator[None]:
    """Holds the directory's exclusive lock; ``OutputDirectoryError`` if another process holds
    it."""
    path = os.path.join(directory, LOCK_FILE)
    with open(path, "a+") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            holder = lock.read().strip() or "another process"
            raise OutputDirectoryError(
                f"{directory} is being written by {holder} (it holds {path}); wait for that run "
                "to end, "
                "or stop it, before starting another one there"
            ) from None
        lock.truncate(0)
        lock.write(f"qmoe_jax process {os.getpid()}\n")
        lock.flush()
        yield


@contextlib.contextmanager
def claimed(directory: str, kind: OutputKind) -> Iterator[str]:
    """Checks that ``directory`` may be written (``check_writable``), creates it and holds its lock
    while the block runs; yields its absolute path."""
    directory = os.path.abspath(directory)
    check_writable(directory, kind)
    os.makedirs(directory, exist_ok=True)
    with locked(directory):
        yield directory
