"""The Orbax trees of a compressed checkpoint (format v1, ``format_v1``) and their integrity:
writing and reading a tree, the SHA-256 of every array, the size of every file, and the rule that
no stored number is NaN or infinite."""

from __future__ import annotations

import hashlib
import os
import re
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import traverse_util

from qmoe_jax.checkpoints import orbax_trees, strict_json


class CompressedCheckpointError(ValueError):
    """A compressed checkpoint is missing, corrupt, or does not match what was asked for.

    Attributes:
      problem: what is wrong, without the advice that follows it in the message.
    """

    def __init__(self, problem: str, fix: str = ""):
        super().__init__(f"{problem}; {fix}" if fix else problem)
        self.problem = problem


def array_checksum(array: np.ndarray) -> str:
    """SHA-256 of the array's dtype, shape and C-order bytes."""
    array = np.ascontiguousarray(array)
    digest = hashlib.sha256(f"{array.dtype.str}{array.shape}".encode())
    digest.update(array.reshape(-1).view(np.uint8))  # the C-order bytes, without copying them
    return digest.hexdigest()


def flat_checksums(tree: dict) -> dict[str, str]:
    """``array_checksum`` of every array of ``tree``, by "/"-joined path."""
    flat = traverse_util.flatten_dict(tree, sep="/")
    return {path: array_checksum(np.asarray(value)) for path, value in sorted(flat.items())}


def write_json_atomic(path: str, payload: Any) -> None:
    """Writes ``payload`` as JSON to ``path`` so that a crash leaves the old file or the new one,
    never half."""
    temporary = path + ".tmp"
    with open(temporary, "w") as f:
        strict_json.dump(payload, f, what=path, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, path)


def checkpointer() -> ocp.Checkpointer:
    """The checkpointer of every tree of the format (``orbax_trees``): the files of
    ``PyTreeCheckpointer()``, written by this process alone."""
    local = this_process_only()
    return ocp.Checkpointer(orbax_trees.handler(local), multiprocessing_options=local)


def this_process_only() -> ocp.options.MultiprocessingOptions:
    """Orbax options under which a process reads and writes a tree alone, without waiting for the
    other processes of a multi-process JAX run (only one of them writes an output directory;
    docs/multihost.md)."""
    process = jax.process_index()
    return ocp.options.MultiprocessingOptions(primary_host=process, active_processes={process})


def save_tree(path: str, tree: dict, expert_stacks: bool = False) -> None:
    """Saves ``tree`` as an Orbax PyTree at ``path``; ``expert_stacks``: every array of two or more
    dimensions leads with the expert axis, and is stored in chunks of whole experts."""
    try:
        checkpointer().save(path, args=orbax_trees.save_args(tree, expert_stacks))
    except (
        ValueError
    ) as error:  # tensorstore reports a failed write, a full disk included, as a ValueError
        code = re.search(r"os_error_code='(\d+)'", str(error))
        if code is None:
            raise
        raise OSError(int(code.group(1)), os.strerror(int(code.group(1))), path) from error


def file_sizes(path: str) -> dict[str, int]:
    """Size in bytes of every file under ``path``, by "/"-joined path relative to it."""
    sizes = {}
    for folder, _, files in os.walk(path):
        for name in files:
            full = os.path.join(folder, name)
            sizes[os.path.relpath(full, path).replace(os.sep, "/")] = os.path.getsize(full)
    return dict(sorted(sizes.items()))


def missing_or_resized(path: str, sizes: dict[str, int]) -> str | None:
    """What differs between the files under ``path`` and their recorded sizes; None when nothing
    does."""
    if not os.path.isdir(path):
        return f"{path} is missing"
    for name, size in sizes.items():
        full = os.path.join(path, name)
        if not os.path.isfile(full):
            return f"its file {name} is missing"
        if os.path.getsize(full) != size:
            return f"its file {name} has {os.path.getsize(full)} bytes instead of {size}"
    return None


def require_finite(tree: dict, where: str) -> None:
    """Raises ``CompressedCheckpointError`` naming the first floating array of ``tree`` that holds
    a NaN or an infinity (``where`` says whose tree it is)."""
    for path, value in traverse_util.flatten_dict(tree, sep="/").items():
        value = np.asarray(value)
        if value.dtype.kind == "f" or value.dtype.name == "bfloat16":
            bad = int(np.count_nonzero(~np.isfinite(value)))
            if bad:
                raise CompressedCheckpointError(
                    f"{where}: array {path} holds {bad} NaN or infinite values, "
                    "which a compressed checkpoint never stores"
                )


def restore_tree(path: str, fix: str, part: str | None = None, rerun: str = "") -> dict:
    """The Orbax tree at ``path``, inside ``part`` (the directory a re-run rewrites; default
    ``path``). A missing ``part`` comes with the advice ``rerun`` (there is nothing to delete),
    anything else with ``fix``."""
    part = part or path
    if not os.path.isdir(part):
        raise CompressedCheckpointError(f"{part} is missing", rerun or fix)
    if not os.path.isdir(path):
        raise CompressedCheckpointError(f"{path} is missing", fix)
    try:
        local = this_process_only()
        handler = ocp.PyTreeCheckpointHandler(multiprocessing_options=local)
        return ocp.Checkpointer(handler, multiprocessing_options=local).restore(path)
    except Exception as error:  # orbax raises many types for damaged trees
        raise CompressedCheckpointError(
            f"cannot read the Orbax tree at {path}: {error}", fix
        ) from error


def verify_checksums(tree: dict, checksums: dict[str, str], where: str, fix: str) -> None:
    """Raises ``CompressedCheckpointError`` (with the advice ``fix``) unless every array that
    ``checksums`` names is in ``tree`` with that SHA-256."""
    found = flat_checksums(tree)
    for path, expected in checksums.items():
        if path not in found:
            raise CompressedCheckpointError(f"{where}: array {path} is missing", fix)
        if found[path] != expected:
            raise CompressedCheckpointError(
                f"{where}: checksum mismatch for array {path} (the file is corrupt)", fix
            )
