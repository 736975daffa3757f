"""Errors raised while reading or writing T5X checkpoints.

All of them are ``CheckpointError`` (a ``ValueError``), so callers can catch the
family at once; each message names the checkpoint, the array and the fix.
"""

from __future__ import annotations


class CheckpointError(ValueError):
    """Base class of every checkpoint error."""


class NotACheckpointError(CheckpointError):
    """The location holds neither a T5X ``checkpoint`` msgpack file nor an Orbax ``_METADATA``."""


class CorruptCheckpointError(CheckpointError):
    """The checkpoint is there but unreadable: bad msgpack, missing zarr metadata or chunks."""


class MissingArrayError(CheckpointError, LookupError):
    """A parameter path that the checkpoint does not hold."""


class ShapeMismatchError(CheckpointError):
    """The checkpoint's arrays disagree with the shapes a model config expects."""
