"""Reading a T5X checkpoint with every array checked for NaN and ±inf as it is read.

A non-finite weight is an error naming the array (and, in an expert stack, the
expert) and how many values are affected, unless the policy is "zero": then
they are replaced by 0 and reported through ``on_zeroed(key, count)``, where
``key`` is the param path, or ``path[e]`` for expert e of a stack. The
compressor's ternary grid is then computed from the finite values only, since
the grid's levels come from each row's min and max, and 0 is always a level.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
from flax import traverse_util

from qmoe_jax.checkpoints.base import T5XCheckpoint, unflatten
from qmoe_jax.checkpoints.errors import CheckpointError

POLICIES = ("error", "zero")


class NonFiniteWeightsError(CheckpointError):
    """A source array holds NaN or infinite values."""


def check_policy(policy: str) -> None:
    if policy not in POLICIES:
        raise ValueError(
            f"unknown non-finite policy {policy!r}; choose one of {', '.join(POLICIES)}"
        )


def _is_float(array: np.ndarray) -> bool:
    return array.dtype.kind == "f" or array.dtype.name == "bfloat16"


class FiniteWeights:
    """A T5X checkpoint whose ``read``, ``read_expert`` and ``read_params`` return finite arrays
    only.

    Everything else (``keys``, ``spec``, ``url``, ``check_shapes``, ...) is the wrapped
    checkpoint's.

    Args:
      checkpoint: the checkpoint to read.
      policy: "error" (raise ``NonFiniteWeightsError``) or "zero" (replace by 0 and report).
      on_zeroed: called with ``(key, count)`` for each array or expert whose values were zeroed.
    """

    def __init__(
        self,
        checkpoint: T5XCheckpoint,
        policy: str = "error",
        on_zeroed: Callable[[str, int], None] = lambda key, count: None,
    ):
        check_policy(policy)
        self.checkpoint = checkpoint
        self.policy = policy
        self.on_zeroed = on_zeroed

    def __getattr__(self, name: str) -> Any:
        return getattr(self.checkpoint, name)

    def _finite(self, array: np.ndarray, key: str, what: str) -> np.ndarray:
        if not _is_float(array):
            return array
        finite = np.isfinite(array)
        count = int(finite.size - np.count_nonzero(finite))
        if not count:
            return array
        if self.policy == "error":
            raise NonFiniteWeightsError(
                f"{what} of the checkpoint {self.checkpoint.url} holds {count} NaN or infinite "
                "values; fix the "
                "checkpoint, or pass --nonfinite zero to compress it with those values set to 0 "
                "(counted in "
                "report.json)"
            )
        self.on_zeroed(key, count)
        return np.where(finite, array, np.zeros((), array.dtype))

    def _finite_stack(self, array: np.ndarray, path: str, first: int) -> np.ndarray:
        """An expert stack's slice ``[first, first + len)``; non-finite values are handled one
        expert at a time."""
        if not _is_float(array) or np.isfinite(array).all():
            return array
        return np.stack(
            [
                self._finite(expert, f"{path}[{first + e}]", f"{path}, expert {first + e},")
                for e, expert in enumerate(array)
            ]
        )

    def read(self, path: str, index: Any = None) -> np.ndarray:
        return self._finite(self.checkpoint.read(path, index), path, path)

    def read_expert(self, path: str, experts: int | slice) -> np.ndarray:
        array = self.checkpoint.read_expert(path, experts)
        if isinstance(experts, slice):
            return self._finite_stack(array, path, experts.start or 0)
        return self._finite(array, f"{path}[{experts}]", f"{path}, expert {experts},")

    def read_params(self, paths: Iterable[str] | None = None) -> dict[str, Any]:
        flat = traverse_util.flatten_dict(self.checkpoint.read_params(paths), sep="/")
        spec = self.checkpoint.spec()
        return unflatten(
            {
                path: self._finite_stack(array, path, 0)
                if spec[path].is_expert_stack
                else self._finite(array, path, path)
                for path, array in flat.items()
            }
        )

    def check_all(self) -> None:
        """Reads every array once (an expert stack one expert at a time), so that an unreadable
        chunk or a non-finite value shows now rather than when its layer is reached."""
        for path, info in self.checkpoint.spec().items():
            if info.is_expert_stack:
                for expert in range(info.shape[0]):
                    self.read_expert(path, expert)
            else:
                self.read(path)
