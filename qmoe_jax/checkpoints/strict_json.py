"""Strict JSON for everything qmoe_jax writes: NaN and ±Infinity are refused, never written.

Python's ``json`` writes ``float("nan")`` as ``NaN`` and ``float("inf")`` as
``Infinity``. Neither is JSON (RFC 8259): jq, JavaScript's ``JSON.parse`` and
most other readers refuse the file. Every manifest, report, metrics line and
result that qmoe_jax writes goes through ``dumps`` or ``dump``, which raise
``NonFiniteNumberError`` naming where the number sits instead. A command checks
its own results first, with a message that says what went wrong; this is the
backstop that keeps a non-finite number out of a file whatever the path.

``loads`` is the strict reader: it refuses ``NaN`` and ``Infinity`` in the text.
"""

from __future__ import annotations

import json
import math
from typing import IO, Any


class NonFiniteNumberError(ValueError):
    """A value to be written as JSON holds NaN or an infinity."""


def nonfinite_paths(value: Any, prefix: str = "") -> list[str]:
    """Where ``value`` holds a non-finite float: "/"-joined keys and list indices, e.g.
    ``"moe/bits_per_weight"`` (``""`` for the value itself)."""
    if isinstance(value, float):
        return [] if math.isfinite(value) else [prefix]
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, (list, tuple)):
        items = enumerate(value)
    else:
        return []
    found = []
    for key, item in items:
        found += nonfinite_paths(item, f"{prefix}/{key}" if prefix else str(key))
    return found


def _refuse(value: Any, what: str) -> None:
    paths = nonfinite_paths(value)
    if paths:
        shown = ", ".join(paths[:3]) + (f" and {len(paths) - 3} more" if len(paths) > 3 else "")
        raise NonFiniteNumberError(
            f"{what} holds a non-finite number (NaN or infinity) at {shown or 'its top level'}, "
            "which JSON cannot hold, so it is not written; this is a bug in qmoe_jax unless an "
            "input was non-finite"
        )


def dumps(value: Any, *, what: str = "a JSON value", **options) -> str:
    """``json.dumps(value, **options)`` that refuses NaN and ±inf (``NonFiniteNumberError``
    naming ``what`` and where the number sits)."""
    _refuse(value, what)
    return json.dumps(value, allow_nan=False, **options)


def dump(value: Any, file: IO[str], *, what: str = "a JSON value", **options) -> None:
    """``json.dump`` with the refusal of ``dumps``; nothing is written when it refuses."""
    file.write(dumps(value, what=what, **options))


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def loads(text: str | bytes) -> Any:
    """``json.loads`` that refuses ``NaN``, ``Infinity`` and ``-Infinity`` (``ValueError``)."""
    return json.loads(text, parse_constant=_no_constant)
