"""The memory-mappable layout of a compressed checkpoint (docs/format.md §9): raw aligned expert
arrays.

A mapped checkpoint directory holds the same dense parameters and
dictionaries as format v1 (Orbax trees, read with the same checksums), but
each sparse layer's ternary expert stacks are one raw file of C-order arrays
at 4096-aligned offsets, so that a reader maps them (``mmap``) and hands the
kernels views of the file instead of loading them::

    manifest.json               "format": "qmoe_jax.mapped"; header, dense, dictionaries, layers
    dense/, dictionaries/<fp16>/  as in format v1 (§8.3, §8.4)
    layers/<layer>.experts      per kernel: codes uint16[E, n], row_offsets int32[E, rows+1],
                                minmax bf16[E, rows, 2]
    layers/<layer>.json         the index: offsets, shapes, codewords and SHA-256 of each expert

Every expert carries its own SHA-256 (its codewords in use, row offsets and
min/max of every kernel), so that a reader can verify an expert when it is
first touched instead of reading the whole file. ``MappedLayer`` owns the
file: it checks sizes at open, reads and verifies experts with ``pread`` (a
truncated or changed file is an error naming the file and the expert, never
a fault), and maps it read-only.
"""

from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import json
import mmap
import os
import shutil
from collections.abc import Callable, Iterable, Sequence

import ml_dtypes
import numpy as np

from qmoe_jax.checkpoints.compressed_trees import write_json_atomic
from qmoe_jax.checkpoints.format_v1 import (
    CompressedCheckpoint,
    CompressedCheckpointError,
    save_dense,
    save_dictionary,
)
from qmoe_jax.checkpoints.output_dir import MANIFEST, OutputKind, check_writable, read_json_object
from qmoe_jax.codec import CompressedExperts
from qmoe_jax.codec.dictionary import Dictionary

FORMAT = "qmoe_jax.mapped"
FORMAT_VERSION = 1
ALIGNMENT = 4096  # every array starts at a multiple of the page size
LAYER_FILE = "{}.experts"
INDEX_FILE = "{}.json"
CONVERT = "python -m qmoe_jax.convert --layout mmap"
MAPPED_OUTPUT = OutputKind(FORMAT, "a qmoe_jax mapped checkpoint")
_DTYPES = (
    ("codes", np.dtype(np.uint16)),
    ("row_offsets", np.dtype(np.int32)),
    ("minmax", np.dtype(ml_dtypes.bfloat16)),
)


class MappedExpertError(CompressedCheckpointError):
    """A mapped expert file is truncated, changed or unreadable; the message names the file and the
    expert."""


def _aligned(offset: int) -> int:
    return -(-offset // ALIGNMENT) * ALIGNMENT


@dataclasses.dataclass(frozen=True)
class KernelLayout:
    """Where one expert kernel's stack lies in a layer file.

    Attributes:
      name: ``wi``, ``wo``, ``wi_0`` or ``wi_1``.
      rows, cols: of each matrix W_e[rows, cols] (y = W·x orientation).
      codes_per_expert: n, the stack's padded stream length (codes is uint16[E, n]).
      offsets: byte offset of ``codes``, ``row_offsets`` and ``minmax`` in the file.
      codewords: each expert's codewords in use (``row_offsets[e, rows]``).
    """

    name: str
    rows: int
    cols: int
    codes_per_expert: int
    offsets: dict[str, int]
    codewords: tuple[int, ...]

    def shapes(self, experts: int) -> dict[str, tuple[int, ...]]:
        return {
            "codes": (experts, self.codes_per_expert),
            "row_offsets": (experts, self.rows + 1),
            "minmax": (experts, self.rows, 2),
        }

    def regions(self, expert: int) -> list[tuple[int, int]]:
        """(offset, bytes) of the parts of the stack that expert ``expert`` owns and the kernels
        read."""
        return [
            (
                self.offsets["codes"] + 2 * expert * self.codes_per_expert,
                2 * self.codewords[expert],
            ),
            (self.offsets["row_offsets"] + 4 * expert * (self.rows + 1), 4 * (self.rows + 1)),
            (self.offsets["minmax"] + 4 * expert * self.rows, 4 * self.rows),
        ]


@dataclasses.dataclass(frozen=True)
class LayerIndex:
    """The index of one layer file (``layers/<layer>.json``)."""

    file: str
    bytes: int
    num_experts: int
    kernels: tuple[KernelLayout, ...]
    expert_sha256: tuple[str, ...]

    @classmethod
    def plan(
        cls,
        file: str,
        num_experts: int,
        kernels: Sequence[tuple[str, int, int, int]],
        codewords: dict[str, Sequence[int]],
        expert_sha256: Sequence[str] = (),
    ) -> LayerIndex:
        """The layout of ``kernels`` [(name, rows, cols, codes_per_expert)] in this order, each
        array aligned."""
        offset, layouts = 0, []
        for name, rows, cols, length in kernels:
            offsets = {}
            for array, dtype in _DTYPES:
                offsets[array] = offset
                per_expert = {"codes": length, "row_offsets": rows + 1, "minmax": 2 * rows}[array]
                offset = _aligned(offset + num_experts * per_expert * dtype.itemsize)
            layouts.append(
                KernelLayout(
                    name, rows, cols, length, offsets, tuple(int(n) for n in codewords[name])
                )
            )
        return cls(file, offset, num_experts, tuple(layouts), tuple(expert_sha256))

    def to_json(self) -> dict:
        return {
            "file": self.file,
            "bytes": self.bytes,
            "num_experts": self.num_experts,
            "kernels": [
                dataclasses.asdict(k) | {"codewords": list(k.codewords)} for k in self.kernels
            ],
            "expert_sha256": list(self.expert_sha256),
        }

    @classmethod
    def from_json(cls, value: dict) -> LayerIndex:
        kernels = tuple(
            KernelLayout(
                k["name"],
                k["rows"],
                k["cols"],
                k["codes_per_expert"],
                dict(k["offsets"]),
                tuple(k["codewords"]),
            )
            for k in value["kernels"]
        )
        return cls(
            value["file"],
            value["bytes"],
            value["num_experts"],
            kernels,
            tuple(value["expert_sha256"]),
        )

    def regions(self, expert: int) -> list[tuple[int, int]]:
        return [region for kernel in self.kernels for region in kernel.regions(expert)]


def expert_checksum(parts: Iterable) -> str:
    """SHA-256 of an expert: the bytes of its regions (``LayerIndex.regions``) one after another."""
    digest = hashlib.sha256()
    for part in parts:
        digest.update(part)
    return digest.hexdigest()


def _expert_parts(kernels: dict, layouts: Sequence[KernelLayout], expert: int) -> list[bytes]:
    """The bytes of expert ``expert``'s regions, taken from arrays ``{kernel: (codes, row_offsets,
    minmax)}``."""
    parts = []
    for layout in layouts:
        codes, row_offsets, minmax = kernels[layout.name]
        parts += [
            np.ascontiguousarray(codes[: layout.codewords[expert]], np.uint16).tobytes(),
            np.ascontiguousarray(row_offsets, np.int32).tobytes(),
            np.ascontiguousarray(minmax).view(np.uint16).tobytes(),
        ]
    return parts


class MappedCheckpointWriter:
    """Writes a mapped checkpoint into a new or empty directory (or over an unfinished one of its
    kind).

    The caller holds the directory's lock (``output_dir.claimed``). A layer
    file is reserved in full (``posix_fallocate``) before anything is written
    to it, so a full disk stops the write at its start with ``OSError``
    (ENOSPC) and the partial file is removed.
    """

    def __init__(self, directory: str, header: dict, source: dict | None = None):
        directory = os.path.abspath(directory)
        check_writable(directory, MAPPED_OUTPUT)
        stored = read_json_object(os.path.join(directory, MANIFEST))
        if stored is not None and stored.get("complete"):
            raise CompressedCheckpointError(
                f"{directory} already holds a finished mapped checkpoint",
                "use it, or delete it to write it again",
            )
        for name in ("dense", "dictionaries", "layers"):  # what an unfinished write of ours left
            shutil.rmtree(os.path.join(directory, name), ignore_errors=True)
        os.makedirs(os.path.join(directory, "layers"), exist_ok=True)
        os.makedirs(os.path.join(directory, "dictionaries"), exist_ok=True)
        self.directory = directory
        self.manifest = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "header": header,
            "source": source,
            "dense": None,
            "dictionaries": {},
            "layers": {},
            "complete": False,
        }
        self._commit()

    def _commit(self) -> None:
        write_json_atomic(os.path.join(self.directory, MANIFEST), self.manifest)

    def write_dense(self, params: dict) -> None:
        self.manifest["dense"] = save_dense(self.directory, params)
        self._commit()

    def copy_dense(self, source: str, record: dict) -> None:
        """Copies a v1 checkpoint's ``dense/`` (``record``: its manifest entry) as it is."""
        shutil.copytree(os.path.join(source, "dense"), os.path.join(self.directory, "dense"))
        self.manifest["dense"] = record
        self._commit()

    def write_dictionary(self, dictionary: Dictionary) -> str:
        fingerprint = dictionary.fingerprint
        if fingerprint not in self.manifest["dictionaries"]:
            self.manifest["dictionaries"][fingerprint] = save_dictionary(self.directory, dictionary)
            self._commit()
        return fingerprint

    def copy_dictionary(self, source: str, fingerprint: str, record: dict) -> None:
        shutil.copytree(
            os.path.join(source, "dictionaries", record["directory"]),
            os.path.join(self.directory, "dictionaries", record["directory"]),
        )
        self.manifest["dictionaries"][fingerprint] = record
        self._commit()

    def write_layer(
        self,
        name: str,
        kernels: Sequence[tuple[str, int, int, int]],
        codewords: dict[str, Sequence[int]],
        experts: Iterable[dict],
        stats: dict,
        progress: Callable[[int], None] = lambda n: None,
    ) -> None:
        """Writes one layer file and its index.

        Args:
          kernels: [(kernel, rows, cols, codes_per_expert)] in storage order.
          codewords: kernel -> each expert's codewords in use.
          experts: for e = 0 … E-1, ``{kernel: (codes, row_offsets, minmax)}`` of expert e (codes
            may be longer than its codewords; the rest is not stored).
          stats: the layer's stats (as format v1's ``layer.json``; ``dictionary`` names its
            fingerprint).
          progress: called with the bytes written after each expert.
        """
        num_experts = len(next(iter(codewords.values())))
        file = LAYER_FILE.format(name)
        path = os.path.join(self.directory, "layers", file)
        plan = LayerIndex.plan(file, num_experts, kernels, codewords)
        checksums = []
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.posix_fallocate(fd, 0, plan.bytes)
            for expert, arrays in enumerate(experts):
                parts = _expert_parts(arrays, plan.kernels, expert)
                for (offset, size), part in zip(plan.regions(expert), parts, strict=True):
                    if len(part) != size or os.pwrite(fd, part, offset) != size:
                        raise CompressedCheckpointError(
                            f"layer {name}: expert {expert} did not write {size} bytes"
                        )
                checksums.append(expert_checksum(parts))
                progress(sum(len(p) for p in parts))
            if len(checksums) != num_experts:
                raise CompressedCheckpointError(
                    f"layer {name}: {len(checksums)} experts given, {num_experts} planned"
                )
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            os.remove(path)
            raise
        os.close(fd)
        index = dataclasses.replace(plan, expert_sha256=tuple(checksums))
        index_path = os.path.join(self.directory, "layers", INDEX_FILE.format(name))
        write_json_atomic(index_path, index.to_json())
        with open(index_path, "rb") as f:
            index_sha256 = hashlib.sha256(f.read()).hexdigest()
        self.manifest["layers"][name] = {
            "stats": stats,
            "index": INDEX_FILE.format(name),
            "index_sha256": index_sha256,
            "file": file,
            "bytes": plan.bytes,
        }
        self._commit()

    def finalize(self, report: dict | None = None) -> None:
        self.manifest["complete"] = True
        if report is not None:
            self.manifest["report"] = report
        self._commit()


class MappedLayer:
    """One layer file opened for reading: sizes checked, mapped read-only, experts verified on
      request.

    ``stacks()`` gives the kernels' ``CompressedExperts`` as views of the
    mapping (no copy). ``verify(e)`` reads expert e with ``pread`` and checks
    its SHA-256; ``check_unchanged()`` checks that the file still has its size
    and modification time (a truncated mapping would fault when read).
    """

    def __init__(self, directory: str, name: str, record: dict):
        self.name = name
        index_path = os.path.join(directory, "layers", record["index"])
        try:
            with open(index_path, "rb") as f:
                raw = f.read()
        except OSError as error:
            raise MappedExpertError(
                f"cannot read the index {index_path} of layer {name}: {error.strerror}",
                f"re-run `{CONVERT}`",
            ) from error
        if hashlib.sha256(raw).hexdigest() != record["index_sha256"]:
            raise MappedExpertError(
                f"the index {index_path} of layer {name} does not match its checksum in the "
                "manifest (the file is corrupt)",
                f"re-run `{CONVERT}`",
            )
        self.index = LayerIndex.from_json(json.loads(raw))
        self.path = os.path.join(directory, "layers", self.index.file)
        try:
            self.fd = os.open(self.path, os.O_RDONLY)
        except OSError as error:
            raise MappedExpertError(
                f"cannot open {self.path} (layer {name}): {error.strerror}", f"re-run `{CONVERT}`"
            ) from error
        status = os.fstat(self.fd)
        self.stamp = (status.st_size, status.st_mtime_ns, status.st_ino)
        self.damaged: MappedExpertError | None = None
        self._check_size(status.st_size, range(self.index.num_experts))
        self.map = mmap.mmap(self.fd, self.index.bytes, access=mmap.ACCESS_READ)
        # Experts are read one by one in routing order, so the OS's read-ahead (often several MB)
        # would read their neighbours too: reads and page faults fetch what is asked for, and
        # ``advise`` WILLNEED asks.
        os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_RANDOM)
        self.map.madvise(mmap.MADV_RANDOM)

    def _check_size(self, size: int, experts: Iterable[int]) -> None:
        if size == self.index.bytes:
            return
        past = [e for e in experts if max(o + n for o, n in self.index.regions(e)) > size]
        which = (
            f"expert {past[0]} (and {len(past) - 1} more) lies past its end"
            if past
            else "no expert lies past it"
        )
        self._damaged(
            MappedExpertError(
                f"{self.path} has {size} bytes but the manifest recorded {self.index.bytes} (it "
                "was truncated or changed "
                f"after the manifest was written); in layer {self.name}, {which}",
                f"re-run `{CONVERT}` to write it again",
            )
        )

    def _damaged(self, error: MappedExpertError) -> None:
        """Raises ``error``; once the file is mapped, first replaces the mapping by zero pages
        (``poison``) and keeps the error, so that every later use of this layer raises it too."""
        if hasattr(self, "map"):
            if self.damaged is None:
                self.poison()
            self.damaged = error
        raise error

    def check_unchanged(self, experts: Iterable[int]) -> None:
        """Raises ``MappedExpertError`` naming the file and an expert if the file was resized or
        rewritten."""
        if self.damaged is not None:
            raise self.damaged
        status = os.fstat(self.fd)
        experts = list(experts)
        self._check_size(status.st_size, experts)
        if (status.st_mtime_ns, status.st_ino) != self.stamp[1:]:
            raise MappedExpertError(
                f"{self.path} was modified after it was opened (layer {self.name}, while reading "
                f"expert {experts[0] if experts else 0})",
                "open the model again",
            )

    def read(self, expert: int) -> list[bytes]:
        """The bytes of expert ``expert``'s regions, read with ``pread``."""
        parts = []
        for offset, size in self.index.regions(expert):
            part = os.pread(self.fd, size, offset)
            if len(part) != size:
                self._damaged(
                    MappedExpertError(
                        f"{self.path} ends inside expert {expert} of layer {self.name} (read "
                        f"{len(part)} of {size} bytes "
                        f"at offset {offset}); it was truncated",
                        f"re-run `{CONVERT}` to write it again",
                    )
                )
            parts.append(part)
        return parts

    def verify(self, expert: int) -> int:
        """Reads expert ``expert`` and checks its SHA-256; returns the bytes read."""
        parts = self.read(expert)
        if expert_checksum(parts) != self.index.expert_sha256[expert]:
            raise MappedExpertError(
                f"expert {expert} of layer {self.name} in {self.path} does not match its "
                "checksum (the file was changed after the manifest was written)",
                f"re-run `{CONVERT}` to write it again",
            )
        return sum(len(p) for p in parts)

    def stacks(self) -> dict[str, CompressedExperts]:
        """``{kernel: CompressedExperts}`` whose arrays are read-only views of the mapping."""
        out = {}
        for kernel in self.index.kernels:
            shapes = kernel.shapes(self.index.num_experts)
            arrays = [
                np.frombuffer(
                    self.map, dtype, int(np.prod(shapes[array])), kernel.offsets[array]
                ).reshape(shapes[array])
                for array, dtype in _DTYPES
            ]
            out[kernel.name] = CompressedExperts(*arrays, kernel.cols)
        return out

    def advise(self, experts: Iterable[int], advice: int) -> None:
        """``madvise`` the given experts' regions: for MADV_DONTNEED the pages wholly inside them (a
        neighbour keeps its pages), otherwise every page they touch."""
        for expert in experts:
            for offset, size in self.index.regions(expert):
                if advice == mmap.MADV_DONTNEED:
                    start, end = _aligned(offset), (offset + size) // mmap.PAGESIZE * mmap.PAGESIZE
                else:
                    start, end = offset // mmap.PAGESIZE * mmap.PAGESIZE, _aligned(offset + size)
                if end > start:
                    self.map.madvise(advice, start, end - start)

    def poison(self) -> None:
        """Replaces the mapping by zero pages (same address, no file behind it).

        XLA runs the rest of a program after a host callback failed, so a
        kernel may still read the mapping of a file found truncated; zero
        pages read as experts without codewords instead of faulting. The
        program's results are discarded with the error, and the layer raises
        it at every later use (``check_unchanged``).
        """
        address = np.frombuffer(self.map, np.uint8, 1).ctypes.data
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_long,
        ]
        length = _aligned(self.index.bytes)
        flags = (
            mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | 0x10
        )  # MAP_FIXED: replace the pages at this address
        if libc.mmap(address, length, mmap.PROT_READ, flags, -1, 0) != address:
            raise OSError(ctypes.get_errno(), f"cannot replace the mapping of {self.path}")

    def close(self) -> None:
        self.map.close()
        os.close(self.fd)


class MappedCheckpoint(CompressedCheckpoint):
    """A mapped checkpoint opened for reading; ``dense_params`` and ``dictionary`` work as in format
    v1."""

    def __init__(self, directory: str):
        directory = os.path.abspath(directory)
        manifest = read_json_object(os.path.join(directory, MANIFEST))
        if manifest is None or not MAPPED_OUTPUT.owns(manifest):
            raise CompressedCheckpointError(
                f"{directory} is not a qmoe_jax mapped checkpoint",
                f"make one from a compressed checkpoint with `{CONVERT}`",
            )
        if manifest.get("format_version") != FORMAT_VERSION:
            raise CompressedCheckpointError(
                f"{directory} has mapped format version {manifest.get('format_version')}; "
                f"this qmoe_jax reads version {FORMAT_VERSION}"
            )
        self.manifest = manifest
        self.directory = directory

    def layer(self, name: str):
        raise CompressedCheckpointError(
            f"{self.directory} stores layer {name} mapped, not as an Orbax tree",
            "open it with open_layer",
        )

    def open_layer(self, name: str) -> MappedLayer:
        record = self.manifest["layers"].get(name)
        if record is None:
            raise CompressedCheckpointError(f"layer {name} is not in {self.directory}")
        return MappedLayer(self.directory, name, record)


def is_mapped_checkpoint(path: str) -> bool:
    manifest = read_json_object(os.path.join(path, MANIFEST))
    return manifest is not None and MAPPED_OUTPUT.owns(manifest)
