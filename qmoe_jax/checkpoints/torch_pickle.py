"""Reading PyTorch ``.pt`` files (``torch.save``'s zip format) without torch, safely.

A ``.pt`` file is a zip archive: ``<name>/data.pkl`` (a pickle of the saved
object), ``<name>/data/<key>`` (one raw little-endian storage per key) and a few
small records (``version``, ``byteorder``). The pickle rebuilds each tensor with
``torch._utils._rebuild_tensor_v2(storage, offset, size, stride, ...)`` and
names its storages by *persistent ids* ``("storage", torch.<Type>Storage, key,
location, numel)``.

Unpickling runs code named by the pickle, so this reader is a security
boundary: its unpickler resolves only the globals a state dict needs (the
tensor rebuild functions, ``collections.OrderedDict`` and the storage type
markers), each to a function of this module, and refuses any other global,
naming it (``UnsafePickleError``). Storages become numpy arrays: memory-mapped
from the file where the zip stores the entry uncompressed (what ``torch.save``
always does), read into memory otherwise. Tensors become numpy arrays (strided
views of their storage; ``bfloat16`` is ml_dtypes').

``load(path)`` returns the saved object with tensors as numpy arrays;
``load(path, lazy=True)`` returns ``LazyTensor`` placeholders that read nothing
until asked (``numpy()``, ``read_into()``), for streaming large files.
"""

from __future__ import annotations

import collections
import dataclasses
import mmap
import os
import pickle
import struct
import zipfile
from typing import Any

import ml_dtypes
import numpy as np

# Storage type markers (``torch.<name>``) and the numpy dtype of their elements.
STORAGE_DTYPES = {
    "DoubleStorage": np.dtype("<f8"),
    "FloatStorage": np.dtype("<f4"),
    "HalfStorage": np.dtype("<f2"),
    "BFloat16Storage": np.dtype(ml_dtypes.bfloat16),
    "LongStorage": np.dtype("<i8"),
    "IntStorage": np.dtype("<i4"),
    "ShortStorage": np.dtype("<i2"),
    "CharStorage": np.dtype("i1"),
    "ByteStorage": np.dtype("u1"),
    "BoolStorage": np.dtype("?"),
}
_LOCAL_HEADER = struct.Struct("<IHHHHHIIIHH")  # a zip entry's local file header (30 bytes)
_LOCAL_HEADER_SIGNATURE = 0x04034B50
_LFS_POINTER = b"version https://git-lfs.github.com/spec/"


class TorchFileError(ValueError):
    """A ``.pt`` file that is not a complete, well-formed PyTorch zip file."""


class UnsafePickleError(TorchFileError):
    """A pickle that asks for a global outside the allow-list (it could run code)."""


@dataclasses.dataclass(frozen=True)
class _StorageType:
    name: str

    @property
    def dtype(self) -> np.dtype:
        return STORAGE_DTYPES[self.name]


@dataclasses.dataclass(frozen=True)
class _Storage:
    archive: _Archive
    key: str
    dtype: np.dtype
    numel: int


@dataclasses.dataclass(frozen=True)
class LazyTensor:
    """A tensor of a ``.pt`` file that has not been read yet.

    Attributes:
      dtype: numpy dtype of the elements; shape, strides (in elements) and
        offset (in elements, into its storage) as torch recorded them.
    """

    storage: _Storage
    offset: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]

    @property
    def dtype(self) -> np.dtype:
        return self.storage.dtype

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    def _contiguous(self) -> bool:
        expected, step = [], 1
        for extent in reversed(self.shape):
            expected.insert(0, step)
            step *= extent
        return all(a == b for a, b, n in zip(self.strides, expected, self.shape) if n > 1)

    def numpy(self) -> np.ndarray:
        """The tensor as a numpy array: a read-only view of the memory-mapped storage where
        possible."""
        storage = self.storage.archive.storage_array(self.storage)
        if self.size == 0:
            return np.zeros(self.shape, self.dtype)
        itemsize = self.dtype.itemsize
        return np.lib.stride_tricks.as_strided(
            storage[self.offset :],
            self.shape,
            tuple(s * itemsize for s in self.strides),
            writeable=False,
        )

    def read_into(self, out: np.ndarray) -> None:
        """Copies the tensor's elements (C order) into ``out`` (same size and dtype), reading only
        its bytes."""
        if out.size != self.size or out.dtype != self.dtype or not out.flags.c_contiguous:
            raise ValueError(
                f"cannot read a {self.dtype}{list(self.shape)} tensor into a "
                f"{out.dtype}{list(out.shape)}"
                " array (it must be C-contiguous, of the same size and dtype)"
            )
        if self.size == 0:
            return
        if self._contiguous() and self.storage.archive.is_stored(self.storage.key):
            self.storage.archive.pread_into(self.storage, self.offset, out)
        else:
            np.copyto(out.reshape(self.shape), self.numpy())


class _Archive:
    """One open ``.pt`` zip file: its entries, a memory map of the file, and the storages'
    arrays."""

    def __init__(self, path: str):
        self.path = path
        with open(path, "rb") as f:
            if f.read(len(_LFS_POINTER)) == _LFS_POINTER:
                raise TorchFileError(
                    f"{path} is a Git LFS pointer, not the file itself; run `git lfs pull` in its "
                    "repository to download it"
                )
        try:
            self.zip = zipfile.ZipFile(path)
        except zipfile.BadZipFile as error:
            raise TorchFileError(
                f"{path} is not a complete PyTorch file ({error}; the file is truncated, damaged "
                "or not written by torch.save); download it again"
            ) from None
        names = self.zip.namelist()
        pickles = [name for name in names if name.endswith("/data.pkl") or name == "data.pkl"]
        if len(pickles) != 1:
            raise TorchFileError(
                f"{path} holds {len(pickles)} data.pkl records, expected 1; it is not a PyTorch "
                "file written by torch.save (zip format)"
            )
        self.pickle_name = pickles[0]
        self.prefix = self.pickle_name[: -len("data.pkl")]
        self.infos = {info.filename: info for info in self.zip.infolist()}
        if f"{self.prefix}byteorder" in self.infos:
            order = self.zip.read(f"{self.prefix}byteorder").decode(errors="replace").strip()
            if order != "little":
                raise TorchFileError(
                    f"{path} was saved on a {order}-endian machine; only little-endian PyTorch "
                    "files are read"
                )
        # Open for the archive's life: storages are read from it (pread, mmap) on demand.
        self.file = open(path, "rb")  # noqa: SIM115
        self.size = os.fstat(self.file.fileno()).st_size
        self._map: mmap.mmap | None = (
            None  # mapped on first use: reading with read_into maps nothing
        )
        self.arrays: dict[str, np.ndarray] = {}

    def _info(self, key: str) -> zipfile.ZipInfo:
        info = self.infos.get(f"{self.prefix}data/{key}")
        if info is None:
            raise TorchFileError(
                f"{self.path}: the pickle names storage {key!r}, but the archive has no entry "
                f"{self.prefix}data/{key}; the file is damaged"
            )
        return info

    def is_stored(self, key: str) -> bool:
        return self._info(key).compress_type == zipfile.ZIP_STORED

    def _data_offset(self, info: zipfile.ZipInfo) -> int:
        header = os.pread(self.file.fileno(), _LOCAL_HEADER.size, info.header_offset)
        if len(header) < _LOCAL_HEADER.size:
            raise TorchFileError(
                f"{self.path}: entry {info.filename} lies past the end of the file; the file is "
                "truncated; download it again"
            )
        fields = _LOCAL_HEADER.unpack(header)
        if fields[0] != _LOCAL_HEADER_SIGNATURE:
            raise TorchFileError(
                f"{self.path}: entry {info.filename} has no valid zip header; the file is damaged"
            )
        start = info.header_offset + _LOCAL_HEADER.size + fields[9] + fields[10]
        if start + info.file_size > self.size:
            raise TorchFileError(
                f"{self.path}: entry {info.filename} needs {start + info.file_size} bytes but "
                f"the file has {self.size}; the file is truncated; download it again"
            )
        return start

    def _checked_size(self, storage: _Storage, info: zipfile.ZipInfo) -> None:
        needed = storage.numel * storage.dtype.itemsize
        if info.file_size < needed:
            raise TorchFileError(
                f"{self.path}: storage {storage.key} holds {info.file_size} bytes but its "
                f"tensors need {needed}; the file is damaged"
            )

    def storage_array(self, storage: _Storage) -> np.ndarray:
        """The storage as a 1-d numpy array (memory-mapped when stored uncompressed)."""
        array = self.arrays.get(storage.key)
        if array is None or array.dtype != storage.dtype:
            info = self._info(storage.key)
            self._checked_size(storage, info)
            if info.compress_type == zipfile.ZIP_STORED:
                if self._map is None:
                    self._map = mmap.mmap(self.file.fileno(), 0, access=mmap.ACCESS_READ)
                array = (
                    np.frombuffer(self._map, storage.dtype, storage.numel, self._data_offset(info))
                    if storage.numel
                    else np.zeros(0, storage.dtype)
                )
            else:
                try:
                    data = self.zip.read(info.filename)
                except (zipfile.BadZipFile, OSError, EOFError) as error:
                    raise TorchFileError(
                        f"{self.path}: cannot read entry {info.filename} ({error}); the file is "
                        "damaged; download it again"
                    ) from None
                array = np.frombuffer(data, storage.dtype, storage.numel)
            self.arrays[storage.key] = array
        return array

    def pread_into(self, storage: _Storage, offset: int, out: np.ndarray) -> None:
        info = self._info(storage.key)
        self._checked_size(storage, info)
        start = self._data_offset(info) + offset * storage.dtype.itemsize
        view = memoryview(out.reshape(-1).view(np.uint8))
        done = 0
        while done < len(view):
            count = os.preadv(self.file.fileno(), [view[done:]], start + done)
            if count == 0:
                raise TorchFileError(
                    f"{self.path}: storage {storage.key} ends early; the file is truncated"
                )
            done += count

    def read_pickle(self) -> bytes:
        try:
            return self.zip.read(self.pickle_name)
        except (zipfile.BadZipFile, OSError, EOFError) as error:
            raise TorchFileError(
                f"{self.path}: cannot read {self.pickle_name} ({error}); the file is damaged; "
                "download it again"
            ) from None


def _rebuild_tensor(storage: _Storage, offset: int, shape, strides, *unused) -> LazyTensor:
    if not isinstance(storage, _Storage):
        raise TorchFileError(
            f"a tensor is rebuilt from {type(storage).__name__}, not from a storage"
        )
    shape, strides = tuple(int(n) for n in shape), tuple(int(s) for s in strides)
    if (
        len(shape) != len(strides)
        or min(shape, default=1) < 0
        or min(strides, default=0) < 0
        or offset < 0
    ):
        raise TorchFileError(
            f"a tensor of shape {shape}, strides {strides}, offset {offset} is malformed"
        )
    last = offset + sum((n - 1) * s for n, s in zip(shape, strides)) if all(shape) else offset - 1
    if last >= storage.numel:
        raise TorchFileError(
            f"a tensor of shape {shape}, strides {strides}, offset {offset} reaches past its "
            f"storage {storage.key} of {storage.numel} elements"
        )
    return LazyTensor(storage, int(offset), shape, strides)


def _rebuild_parameter(data: LazyTensor, requires_grad, backward_hooks) -> LazyTensor:
    return data


_ALLOWED_GLOBALS = {
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("collections", "OrderedDict"): collections.OrderedDict,
} | {("torch", name): _StorageType(name) for name in STORAGE_DTYPES}


def allowed_globals() -> list[str]:
    """The globals a pickle may name, as ``module.name``."""
    return sorted(f"{module}.{name}" for module, name in _ALLOWED_GLOBALS)


class _RestrictedUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, archive: _Archive):
        import io

        super().__init__(io.BytesIO(data))
        self.archive = archive

    def find_class(self, module: str, name: str):
        allowed = _ALLOWED_GLOBALS.get((module, name))
        if allowed is None:
            raise UnsafePickleError(
                f"{self.archive.path}: its pickle asks for the global {module}.{name}, which a "
                "PyTorch state dict "
                f"never needs, so it is refused (a pickle can run code through globals; allowed: "
                f"{', '.join(allowed_globals())}); do not load this file"
            )
        return allowed

    def persistent_load(self, pid):
        if not (
            isinstance(pid, tuple)
            and len(pid) == 5
            and pid[0] == "storage"
            and isinstance(pid[1], _StorageType)
            and isinstance(pid[4], int)
        ):
            raise TorchFileError(
                f"{self.archive.path}: its pickle holds a persistent id {pid!r:.80}, not a "
                "PyTorch storage"
            )
        _, storage_type, key, _location, numel = pid
        return _Storage(self.archive, str(key), storage_type.dtype, numel)


def _materialize(value: Any) -> Any:
    if isinstance(value, LazyTensor):
        return value.numpy()
    if isinstance(value, dict):
        out = type(value)() if isinstance(value, collections.OrderedDict) else {}
        for key, item in value.items():
            out[key] = _materialize(item)
        return out
    if isinstance(value, (list, tuple)):
        return type(value)(_materialize(item) for item in value)
    return value


def load(path: str, lazy: bool = False) -> Any:
    """The object ``torch.save`` wrote to ``path``, with tensors as numpy arrays (or ``LazyTensor``s
    if ``lazy``).

    Raises:
      UnsafePickleError: the pickle names a global outside ``allowed_globals()``.
      TorchFileError: the file is truncated, damaged, or not a zip-format PyTorch file.
      OSError: the file cannot be opened.
    """
    archive = _Archive(path)
    data = archive.read_pickle()
    try:
        value = _RestrictedUnpickler(data, archive).load()
    except (
        pickle.UnpicklingError,
        EOFError,
        AttributeError,
        IndexError,
        TypeError,
        ValueError,
        KeyError,
        struct.error,
    ) as error:
        if isinstance(error, TorchFileError):
            raise
        raise TorchFileError(
            f"{path}: its pickle {archive.pickle_name} is malformed ({type(error).__name__}: "
            f"{error}); the file is damaged; download it again"
        ) from None
    return value if lazy else _materialize(value)
