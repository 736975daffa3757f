"""Reading JSON-lines files (metrics, inference records) that the tests' runs write."""

import json
import os


def read_json_lines(path: str | os.PathLike) -> list:
    """Each line of ``path`` parsed as JSON, in order."""
    with open(path) as f:
        return [json.loads(line) for line in f]
