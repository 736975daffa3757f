"""Text sources: C4 shards, plain text files, and in-memory strings.

A *document* is one string; sources yield documents lazily so that a C4 shard
(~350k documents, 300 MB uncompressed) is never held in memory at once.
C4 layout (allenai/c4 `en/`): `c4-<split>.<k>-of-<n>.json.gz`, one JSON object
per line with a "text" field.
"""

from __future__ import annotations

import glob
import gzip
import json
import os
from collections.abc import Iterable, Iterator


def c4_shard_paths(location: str, split: str = "train") -> list[str]:
    """Shard files of one C4 split under ``location`` (a directory or a glob), sorted.

    Raises:
      FileNotFoundError: if nothing matches, naming the pattern that was tried.
    """
    if os.path.isdir(location):
        patterns = [os.path.join(location, f"c4-{split}.*-of-*.json*")]
    else:
        patterns = [location]
    paths = sorted(p for pattern in patterns for p in glob.glob(pattern))
    if not paths:
        raise FileNotFoundError(
            f"no C4 shards match {patterns[0]!r}; expected files named like "
            f"'c4-{split}.00000-of-01024.json.gz' (allenai/c4, en/)"
        )
    return paths


def c4_documents(location: str, split: str = "train") -> Iterator[str]:
    """Yields the "text" field of every line of the C4 shards of ``split``, in shard order."""
    for path in c4_shard_paths(location, split):
        opener = gzip.open if path.endswith(".gz") else open
        with opener(path, "rt", encoding="utf-8") as lines:
            for line_number, line in enumerate(lines, start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                    text = record["text"]
                except (json.JSONDecodeError, KeyError, TypeError) as error:
                    raise ValueError(
                        f"{path}:{line_number} is not a C4 record (one JSON object with a "
                        f"'text' field per line): {error}"
                    ) from None
                yield text


def text_file_documents(paths: Iterable[str], unit: str = "file") -> Iterator[str]:
    """Yields documents from UTF-8 text files.

    Args:
      paths: files to read, in order.
      unit: "file" (each file is one document) or "paragraph" (blank-line
        separated blocks are documents).
    """
    if unit not in ("file", "paragraph"):
        raise ValueError(f"unit must be 'file' or 'paragraph', got {unit!r}")
    for path in paths:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"text file {path!r} does not exist")
        with open(path, encoding="utf-8") as f:
            text = f.read()
        if unit == "file":
            yield text
        else:
            for block in text.split("\n\n"):
                if block.strip():
                    yield block.strip()


def string_documents(texts: Iterable[str]) -> Iterator[str]:
    """Yields documents from an iterable of strings, checking their type."""
    for index, text in enumerate(texts):
        if not isinstance(text, str):
            raise TypeError(f"document {index} is a {type(text).__name__}, expected str")
        yield text
