"""Opening a mapped checkpoint (docs/format.md §9): expert codes stay on disk until routed tokens
touch them.

Measured on jax 0.10.2 (docs/format.md §9.4): ``jax.device_put`` of a
read-only, 64-byte-aligned NumPy view of a file mapping gives a CPU array
that aliases the mapping (no copy, no page read), and jitted programs take it
as an argument in place. So the fused kernels read the routed experts' bytes
straight from the mapping, and the OS page cache is the expert cache; the
loader checks the aliasing and refuses to copy a stack into memory.

Calls of at most 16 tokens (decoding) instead get their routed experts'
arrays copied out of the mapping by the host (``ExpertResidency.gather``,
see ``models.mapped_experts``). What the host does, once per sparse layer
call (``ExpertResidency.touch``):

- verification: ``lazy`` (the default) reads each expert with ``pread`` and
  checks its SHA-256 the first time it is routed; ``full`` checks every expert
  at open. A truncated or changed file is an error naming the file and the
  expert before the kernels touch the mapping;
- a batched read-ahead (``MADV_WILLNEED``) of the step's routed experts that
  are already verified;
- a budget on the mapped pages this process keeps (``expert_cache_gb``): the
  experts routed least recently are released (``MADV_DONTNEED``; they stay in
  the page cache while the OS has room), which bounds the resident set.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import math
import mmap
import time
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from qmoe_jax.checkpoints.format_v1 import CompressedCheckpointError
from qmoe_jax.checkpoints.mapped_layout import MappedCheckpoint, MappedExpertError, MappedLayer
from qmoe_jax.codec import CompressedExperts, Dictionary
from qmoe_jax.inference.dense_forms import pack_dense_params
from qmoe_jax.models import SwitchConfig, SwitchTransformer
from qmoe_jax.models.mapped_experts import mapped_experts_cls

VERIFY_MODES = ("lazy", "full")
DEFAULT_EXPERT_CACHE_GB = 4.0
CALLBACK_LOGGER = "jax._src.callback"  # logs a failed callback's traceback before XLA raises


class ExpertResidency:
    """The host side of mapped experts: verification, read-ahead and the resident-set budget.

    Attributes:
      layers: ``{layer name: MappedLayer}``.
      verify: "lazy" or "full" (see the module docstring).
      budget_bytes: mapped expert bytes kept resident at most (the experts of the current call
        always are).
      stats: counters: ``calls``, ``routed`` (experts routed over all calls), ``verified`` and
        ``verified_bytes`` (experts read and checked), ``released`` (experts whose pages were
        released), ``seconds`` (host time in ``touch``).
      touched: every (layer, expert) routed so far.
      error: the last error ``touch`` raised (XLA reports a callback's exception wrapped in its
        own).
    """

    def __init__(
        self,
        layers: dict[str, MappedLayer],
        verify: str = "lazy",
        expert_cache_gb: float = DEFAULT_EXPERT_CACHE_GB,
        progress: bool = False,
    ):
        if verify not in VERIFY_MODES:
            raise ValueError(f"verify must be one of {', '.join(VERIFY_MODES)}, got {verify!r}")
        if not 0 < expert_cache_gb < math.inf:
            raise ValueError(f"expert_cache_gb must be positive and finite, got {expert_cache_gb}")
        self.layers = layers
        self.verify = verify
        self.budget_bytes = int(expert_cache_gb * 2**30)
        self.verified = {
            name: np.zeros(layer.index.num_experts, bool) for name, layer in layers.items()
        }
        self.resident: collections.OrderedDict[tuple[str, int], int] = collections.OrderedDict()
        self.resident_bytes = 0
        self.stats = collections.Counter(
            calls=0, routed=0, verified=0, verified_bytes=0, released=0, seconds=0.0
        )
        self.touched: set[tuple[str, int]] = set()
        self.stacks = {name: layer.stacks() for name, layer in layers.items()}
        self.error: Exception | None = None
        if verify == "full":
            total = sum(layer.index.bytes for layer in layers.values())
            with tqdm(
                total=total, desc="verify", unit="B", unit_scale=True, disable=not progress
            ) as bar:
                for name, layer in layers.items():
                    for expert in range(layer.index.num_experts):
                        bar.update(self._verify(name, expert))

    def _verify(self, name: str, expert: int) -> int:
        read = self.layers[name].verify(expert)
        self.verified[name][expert] = True
        self.stats["verified"] += 1
        self.stats["verified_bytes"] += read
        return read

    def touch(self, layer: str, counts: np.ndarray) -> np.ndarray:
        """Readies the experts with ``counts > 0`` of ``layer`` for the kernels; returns
        ``counts``."""
        started = time.perf_counter()
        try:
            self._touch(layer, np.asarray(counts))
        except Exception as error:
            self.error = error
            raise
        finally:
            self.stats["seconds"] += time.perf_counter() - started
        return np.asarray(counts)

    def gather(self, layer: str, expert_index: np.ndarray) -> dict[str, tuple[np.ndarray, ...]]:
        """``touch`` for the experts of ``expert_index int32[N]`` (one per token), then their arrays
        copied out
        of the mapping: ``{kernel: (codes [N, n], row_offsets [N, rows+1], minmax [N, rows, 2])}``.
        """
        expert_index = np.asarray(expert_index).reshape(-1)
        self.touch(layer, np.bincount(expert_index, minlength=self.layers[layer].index.num_experts))
        started = time.perf_counter()
        try:
            return {
                name: tuple(
                    np.take(array, expert_index, axis=0)
                    for array in (stack.codes, stack.row_offsets, stack.minmax)
                )
                for name, stack in self.stacks[layer].items()
            }
        finally:
            self.stats["seconds"] += time.perf_counter() - started

    def _touch(self, layer: str, counts: np.ndarray) -> None:
        mapped = self.layers[layer]
        routed = [int(e) for e in np.flatnonzero(counts > 0)]
        self.stats["calls"] += 1
        self.stats["routed"] += len(routed)
        self.touched.update((layer, expert) for expert in routed)
        mapped.check_unchanged(routed)
        verified = self.verified[layer]
        for expert in routed:
            if not verified[expert]:
                self._verify(layer, expert)
        mapped.advise(routed, mmap.MADV_WILLNEED)
        for expert in routed:
            key = (layer, expert)
            if key in self.resident:
                self.resident.move_to_end(key)
            else:
                self.resident[key] = self.expert_bytes(layer, expert)
                self.resident_bytes += self.resident[key]
        while self.resident_bytes > self.budget_bytes and len(self.resident) > len(routed):
            (name, expert), size = self.resident.popitem(last=False)
            self.layers[name].advise([expert], mmap.MADV_DONTNEED)
            self.resident_bytes -= size
            self.stats["released"] += 1

    def expert_bytes(self, layer: str, expert: int) -> int:
        """Bytes of an expert's codewords in use, row offsets and min/max (what the kernels read of
        it)."""
        return sum(size for _, size in self.layers[layer].index.regions(expert))

    def release_all(self) -> None:
        """Releases every mapped page of this process (the page cache keeps them while the OS has
        room)."""
        for layer in self.layers.values():
            layer.map.madvise(mmap.MADV_DONTNEED)
        self.resident.clear()
        self.resident_bytes = 0

    @contextlib.contextmanager
    def errors(self) -> Iterator[None]:
        """Re-raises a mapped-file error that surfaced from inside a jitted program as itself (one
        clear line), without jax's log of the callback's traceback."""
        self.error = None
        callback_log = logging.getLogger(CALLBACK_LOGGER)
        level = callback_log.level
        callback_log.setLevel(logging.CRITICAL)
        try:
            yield
        except Exception as error:
            if self.error is not None and not isinstance(error, MappedExpertError):
                raise self.error from error
            raise
        finally:
            callback_log.setLevel(level)


@dataclasses.dataclass
class MappedModel:
    """A mapped checkpoint opened for inference (``params`` hold the mapped stacks)."""

    config: SwitchConfig
    params: dict
    dictionaries: dict[str, Dictionary]
    residency: ExpertResidency

    def module(self) -> SwitchTransformer:
        return SwitchTransformer(
            self.config, experts_cls=mapped_experts_cls(self.dictionaries, self.residency)
        )


def _on_cpu_without_copy(array: np.ndarray, where: str) -> jax.Array:
    placed = jax.device_put(array, jax.devices("cpu")[0])
    if placed.unsafe_buffer_pointer() != array.ctypes.data:
        raise CompressedCheckpointError(
            f"this jax ({jax.__version__}) copied the mapped array {where} instead of "
            "aliasing it, which would load the experts into memory",
            "load the compressed checkpoint it was converted from instead",
        )
    return placed


def load_mapped_model(
    directory: str,
    verify: str = "lazy",
    expert_cache_gb: float = DEFAULT_EXPERT_CACHE_GB,
    dtype=jnp.float32,
    progress: bool = False,
    dense_dtype: str = "float32",
) -> MappedModel:
    """Opens a mapped checkpoint: dense parameters in memory, expert stacks mapped (docs/format.md
      §9).

    Args:
      verify: "lazy" (each expert on first use; the default) or "full" (every expert now).
      expert_cache_gb: mapped expert bytes kept resident at most (``ExpertResidency``).
      dtype: of the dense parameters and the activations.
      dense_dtype: storage of the dense matrices (``inference.dense_forms``).
    """
    if jax.default_backend() != "cpu":
        raise ValueError(
            f"mapped experts run on the CPU, but jax's default backend is {jax.default_backend()}; "
            "set JAX_PLATFORMS=cpu, or load the compressed checkpoint onto the accelerator"
        )
    checkpoint = MappedCheckpoint(directory)
    if not checkpoint.complete:
        raise CompressedCheckpointError(
            f"{directory} is unfinished", "re-run the command that wrote it"
        )
    config = dataclasses.replace(
        SwitchConfig(**checkpoint.header["model"]), dtype=jnp.dtype(dtype).name
    )
    params = pack_dense_params(checkpoint.dense_params(), dense_dtype, dtype, release_source=True)
    dictionaries, layers = {}, {}
    for name in checkpoint.layer_names():
        stats = checkpoint.manifest["layers"][name]["stats"]
        dictionaries[name] = checkpoint.dictionary(stats["dictionary"])
        layers[name] = checkpoint.open_layer(name)
        node = params
        for key in name.split("."):
            node = node.setdefault(key, {})
        expert = node.setdefault("expert", {})
        for kernel, stack in layers[name].stacks().items():
            arrays = [
                _on_cpu_without_copy(a, f"{name}/{kernel}")
                for a in (stack.codes, stack.row_offsets, stack.minmax)
            ]
            expert[kernel] = CompressedExperts(*arrays, stack.cols)
    residency = ExpertResidency(layers, verify, expert_cache_gb, progress)
    return MappedModel(config, params, dictionaries, residency)
