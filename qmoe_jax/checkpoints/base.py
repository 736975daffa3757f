"""The common face of an opened T5X checkpoint, whichever format stores it.

Lingo: a *param path* is the "/"-joined key path of an array under the T5X
``target`` tree, e.g. ``encoder/layers_1/mlp/expert/wi/kernel``; an *expert
stack* is an array with ``expert`` among its path components and the expert
axis first, ``[E, d, f]``; a *slice read* reads ``[e]`` or ``[e0:e1]`` of one
and touches only the zarr chunks that overlap it. Optimizer state is never
read.
"""

from __future__ import annotations

import abc
import dataclasses
import difflib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import tensorstore as ts

from qmoe_jax.checkpoints import shapes
from qmoe_jax.checkpoints.errors import CheckpointError, CorruptCheckpointError, MissingArrayError
from qmoe_jax.checkpoints.storage import describe, read_error

Source = Any  # ts.TensorStore, or np.ndarray for arrays stored inline in a msgpack file


@dataclasses.dataclass(frozen=True)
class ArrayInfo:
    """Shape and dtype of one parameter, known without reading its data.

    Attributes:
      path: param path, e.g. ``"encoder/layers_1/mlp/expert/wi/kernel"``.
      shape: full shape, e.g. ``(E, d_model, d_ff)`` for an expert ``wi``.
      dtype: stored dtype (``float32`` or ``ml_dtypes.bfloat16`` in practice).
      chunks: zarr chunk shape, or ``None`` for an array stored inline in the
        legacy msgpack file.
    """

    path: str
    shape: tuple[int, ...]
    dtype: np.dtype
    chunks: tuple[int, ...] | None

    @property
    def is_expert_stack(self) -> bool:
        return "expert" in self.path.split("/") and len(self.shape) >= 1

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


def unflatten(flat: Mapping[str, Any]) -> dict[str, Any]:
    """``{"a/b": x}`` → ``{"a": {"b": x}}``."""
    tree: dict[str, Any] = {}
    for path, value in flat.items():
        *parents, name = path.split("/")
        node = tree
        for key in parents:
            node = node.setdefault(key, {})
        node[name] = value
    return tree


class T5XCheckpoint(abc.ABC):
    """A T5X checkpoint opened lazily: listing is free, arrays are read on request.

    Obtain one with ``open_t5x_checkpoint``. Param paths are "/"-joined strings
    relative to the ``target`` tree (see the module docstring).
    """

    format: str = ""
    metadata_files: tuple[
        str, ...
    ] = ()  # the format's own files at ``location`` (see ``fingerprint``)

    def __init__(self, location: dict[str, Any], step: int | None, context: ts.Context):
        self.location = location
        self.step = step
        self._context = context
        self._opened: dict[str, Source] = {}

    @property
    def url(self) -> str:
        """Where the checkpoint is (a local path or a kvstore URL)."""
        return describe(self.location)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r}, step={self.step})"

    @abc.abstractmethod
    def spec(self) -> dict[str, ArrayInfo]:
        """Every parameter's ``ArrayInfo`` by param path, sorted; reads no array data."""

    @abc.abstractmethod
    def _open_sources(self, paths: list[str]) -> dict[str, Source]:
        """Opens the arrays at ``paths`` (metadata only), concurrently."""

    def keys(self) -> list[str]:
        """Sorted param paths of every array under ``target``."""
        return list(self.spec())

    def __contains__(self, path: str) -> bool:
        return path in self.spec()

    def info(self, path: str) -> ArrayInfo:
        """``ArrayInfo`` of one param path; ``MissingArrayError`` if absent."""
        if path not in self:
            keys = self.keys()
            close = difflib.get_close_matches(path, keys, n=3, cutoff=0.6)
            hint = f"; close matches: {', '.join(close)}" if close else ""
            raise MissingArrayError(
                f"{path!r} is not an array of the checkpoint {self.url} "
                f"({len(keys)} arrays; list them with .keys()){hint}"
            )
        return self.spec()[path]

    @property
    def context(self) -> ts.Context:
        """The tensorstore context every array is opened in."""
        return self._context

    def stores(self, paths: list[str]) -> list[Source]:
        """The arrays at ``paths`` opened for reading (zarr metadata read, no data): TensorStores,
        or numpy arrays for arrays stored inline in a legacy msgpack file."""
        return self._sources(paths)

    def check_stored(self) -> None:
        """Opens every array, which checks its zarr metadata (against the msgpack spec, for the
        legacy format), and checks that every chunk of it that a read needs is stored.

        Raises:
          CorruptCheckpointError: naming the array whose metadata is unreadable or wrong, or the
            arrays with missing chunk files.
        """
        paths = self.keys()
        must_be_stored = {
            path: source
            for path, source in zip(paths, self._sources(paths))
            if isinstance(source, ts.TensorStore)
            and not source.spec().to_json().get("fill_missing_data_reads", True)
        }
        pending = {
            path: source.storage_statistics(query_fully_stored=True)
            for path, source in must_be_stored.items()
        }
        incomplete = [
            path for path, statistics in pending.items() if not statistics.result().fully_stored
        ]
        if incomplete:
            shown = ", ".join(incomplete[:5]) + (
                f" and {len(incomplete) - 5} more" if len(incomplete) > 5 else ""
            )
            raise CorruptCheckpointError(
                f"the checkpoint {self.url} is incomplete: chunk files of {shown} are "
                "missing; copy the checkpoint again"
            )

    def _sources(self, paths: list[str]) -> list[Source]:
        unopened = [path for path in paths if path not in self._opened]
        if unopened:
            self._opened.update(self._open_sources(unopened))
        return [self._opened[path] for path in paths]

    def _start_read(self, path: str, index: Any) -> Any:
        (source,) = self._sources([path])
        view = source if index is None else source[index]
        if isinstance(view, (np.ndarray, np.generic)):
            return np.array(view)
        return view.read()

    def _finish_read(self, path: str, pending: Any) -> np.ndarray:
        if isinstance(pending, np.ndarray):
            return pending
        try:
            return pending.result()
        except ValueError as error:
            raise read_error(f"array {path!r} of {self.url}", error) from None

    def read(self, path: str, index: Any = None) -> np.ndarray:
        """Reads one array, or the part ``array[index]`` of it (numpy basic indexing).

        Only the zarr chunks that overlap ``index`` are read. Returns the stored
        dtype; cast it yourself.
        """
        self.info(path)
        return self._finish_read(path, self._start_read(path, index))

    def read_expert(self, path: str, experts: int | slice) -> np.ndarray:
        """Reads expert ``e`` (``[d, f]``) or experts ``e0:e1`` (``[e1-e0, d, f]``) of a stack.

        The read touches only the chunks holding those experts. When the writer
        put several experts in one chunk (T5X chunks by host shard), that whole
        chunk is read and decompressed, but nothing outside it.
        """
        info = self.info(path)
        if not info.is_expert_stack:
            raise CheckpointError(
                f"{path!r} is not an expert stack (expected a path with an 'expert' component, "
                f"shape [E, ...]); it has shape {info.shape}, read it with read()"
            )
        num_experts = info.shape[0]
        if isinstance(experts, (int, np.integer)):
            if not 0 <= experts < num_experts:
                raise CheckpointError(
                    f"expert {experts} is out of range: {path} holds {num_experts} experts "
                    f"(0..{num_experts - 1})"
                )
            return self.read(path, int(experts))
        if isinstance(experts, slice):
            start = 0 if experts.start is None else experts.start
            stop = num_experts if experts.stop is None else experts.stop
            if experts.step not in (None, 1) or not 0 <= start < stop <= num_experts:
                raise CheckpointError(
                    f"expert range {start}:{stop}:{experts.step} is invalid for {path}, which "
                    "holds "
                    f"{num_experts} experts; use e0:e1 with 0 <= e0 < e1 <= {num_experts}"
                )
            return self.read(path, slice(start, stop))
        raise TypeError(f"experts must be an int or a slice, got {type(experts).__name__}")

    def read_params(self, paths: Iterable[str] | None = None) -> dict[str, Any]:
        """Reads arrays concurrently into a nested dict shaped like the T5X tree.

        Args:
          paths: param paths or subtree prefixes (``"encoder/layers_3"`` reads
            every array under it). ``None`` reads the dense parameters: every
            array except the expert stacks, which you read with ``read_expert``.

        Returns:
          ``{"encoder": {"layers_0": {...}}, ...}`` with numpy leaves.
        """
        spec = self.spec()
        if paths is None:
            selected = [p for p, info in spec.items() if not info.is_expert_stack]
        else:
            selected = []
            for prefix in paths:
                under = [p for p in spec if p == prefix or p.startswith(prefix.rstrip("/") + "/")]
                if not under:
                    self.info(prefix)
                selected.extend(p for p in under if p not in selected)
        self._sources(selected)
        pending = {path: self._start_read(path, None) for path in selected}
        return unflatten({path: self._finish_read(path, p) for path, p in pending.items()})

    def check_shapes(
        self,
        expected: Mapping[str, Sequence[int]],
        *,
        config_name: str | None = None,
        allow_extra: bool = False,
    ) -> None:
        """Raises ``ShapeMismatchError`` unless the checkpoint holds exactly these shapes.

        Args:
          expected: param path → shape, e.g. from a model config.
          config_name: named in the message ("the config switch-base-16 expects ...").
          allow_extra: accept arrays the config does not expect. Off by default,
            since an unexpected array (say ``decoder/logits_dense/kernel``) means
            the config would silently ignore trained weights.
        """
        shapes.check_shapes(
            {path: info.shape for path, info in self.spec().items()},
            expected,
            where=self.url,
            config_name=config_name,
            allow_extra=allow_extra,
        )
