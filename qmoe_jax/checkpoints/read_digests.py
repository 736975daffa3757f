"""Hashes of what a run reads from its source checkpoint, compared with what it read before.

Every array read whole (``read``, ``read_params``), and every expert stack read
expert by expert from the first to the last (``read_expert`` in order, as the
calibration pass and ``FiniteWeights.check_all`` read it), gets a digest:
SHA-256 of its dtype name, shape and C-order bytes as stored, computed over the
slices as they come, so a stack read in groups has the digest of the same stack
read whole. Each digest goes to ``on_digest(path, digest)``. When
``recorded(path)`` returns an earlier digest of the same array and the new one
differs, the read raises ``ChangedArrayError`` naming the array, before its
values are used: a run never mixes two versions of its source.

Hashing costs one pass of SHA-256 over what is read, on the thread that reads;
it reads nothing more.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
from flax import traverse_util

from qmoe_jax.checkpoints.base import T5XCheckpoint
from qmoe_jax.checkpoints.errors import CheckpointError


class ChangedArrayError(CheckpointError):
    """An array of the source holds other values than when the run read it before.

    Attributes:
      path: its param path.
    """

    def __init__(self, message: str, path: str):
        super().__init__(message)
        self.path = path


def _start(dtype: np.dtype, shape: tuple[int, ...]) -> Any:
    return hashlib.sha256(f"{np.dtype(dtype).name}{tuple(shape)}".encode())


def _update(digest: Any, array: np.ndarray) -> None:
    digest.update(np.ascontiguousarray(array).reshape(-1).view(np.uint8))


def array_digest(array: np.ndarray) -> str:
    """The digest of one whole array (module docstring)."""
    array = np.asarray(array)
    digest = _start(array.dtype, array.shape)
    _update(digest, array)
    return digest.hexdigest()


class DigestedReads:
    """A T5X checkpoint whose reads are hashed and compared (module docstring).

    Everything but ``read``, ``read_expert`` and ``read_params`` is the wrapped checkpoint's.

    Args:
      checkpoint: the checkpoint to read (``FiniteWeights`` wraps this object in turn, so that
        what is hashed is what is stored).
      recorded: the digest recorded for a param path earlier, or None.
      on_digest: called with ``(path, digest)`` for every array read whole.

    Attributes:
      compared: the param paths whose digests matched a recorded one.
    """

    def __init__(
        self,
        checkpoint: T5XCheckpoint,
        recorded: Callable[[str], str | None] = lambda path: None,
        on_digest: Callable[[str, str], None] = lambda path, digest: None,
    ):
        self.checkpoint = checkpoint
        self.recorded = recorded
        self.on_digest = on_digest
        self.compared: set[str] = set()
        self._stacks: dict[str, tuple[Any, int]] = {}  # path -> (running digest, next expert)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.checkpoint, name)

    def _finish(self, path: str, digest: str) -> None:
        old = self.recorded(path)
        if old is not None and old != digest:
            raise ChangedArrayError(
                f"the array {path} of the checkpoint {self.checkpoint.url} holds other values "
                f"than when this run read it before (SHA-256 {old[:12]}…, now {digest[:12]}…)",
                path,
            )
        if old is not None:
            self.compared.add(path)
        self.on_digest(path, digest)

    def read(self, path: str, index: Any = None) -> np.ndarray:
        array = self.checkpoint.read(path, index)
        if index is None:
            self._finish(path, array_digest(array))
        return array

    def read_expert(self, path: str, experts: int | slice) -> np.ndarray:
        array = self.checkpoint.read_expert(path, experts)
        info = self.checkpoint.info(path)
        if isinstance(experts, slice):
            start = experts.start or 0
            stop = info.shape[0] if experts.stop is None else experts.stop
        else:
            start, stop = int(experts), int(experts) + 1
        if start == 0:
            self._stacks[path] = (_start(array.dtype, info.shape), 0)
        digest, expected = self._stacks.pop(path, (None, None))
        if digest is None or start != expected:
            return array  # not read in order from the first expert: not hashed
        _update(digest, array)
        if stop == info.shape[0]:
            self._finish(path, digest.hexdigest())
        else:
            self._stacks[path] = (digest, stop)
        return array

    def read_params(self, paths: Iterable[str] | None = None) -> dict[str, Any]:
        tree = self.checkpoint.read_params(paths)
        for path, array in traverse_util.flatten_dict(tree, sep="/").items():
            self._finish(path, array_digest(array))
        return tree
