"""Whether a compression run may continue the run stored in its output directory.

A run continues a stored one only when the stored manifest's header matches
its own in everything the output depends on: the source checkpoint's
fingerprint (``checkpoints.fingerprint``), the tokenizer's SHA-256, the model
config and every setting. The source's path and the tokenizer's file name may
differ, so a moved copy of the same checkpoint or tokenizer resumes. Values
zeroed under ``--nonfinite zero`` must stay zeroed: such a run continues only
with ``--nonfinite zero``.
"""

from __future__ import annotations

import json

from qmoe_jax.checkpoints.format_v1 import CompressedCheckpointError

NAMED_ELSEWHERE = ("tokenizer",)  # settings compared by content, not by value


class ResumeRefusedError(CompressedCheckpointError):
    """The output directory holds a run that this run may not continue."""


def _shown(value) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    return "unset" if value is None else str(value)


def header_differences(stored: dict, header: dict) -> list[str]:
    """What differs between a stored run header and a new one, one phrase each; empty when they
    match."""
    found = []
    if stored["source_fingerprint"] != header["source_fingerprint"]:
        if stored["source"] == header["source"]:
            found.append(f"the checkpoint at {header['source']} changed since this run started")
        else:
            found.append(
                f"the checkpoint {header['source']} is not the one this run started from "
                f"({stored['source']})"
            )
    old_tokenizer, new_tokenizer = stored["settings"]["tokenizer"], header["settings"]["tokenizer"]
    if stored["tokenizer_sha256"] != header["tokenizer_sha256"]:
        found.append(
            f"the tokenizer {new_tokenizer} changed since this run started"
            if old_tokenizer == new_tokenizer
            else f"the tokenizer {new_tokenizer} is not the one this run started with "
            f"({old_tokenizer})"
        )
    model = [
        f"{key} {_shown(stored['model'].get(key))} -> {_shown(header['model'].get(key))}"
        for key in sorted(stored["model"].keys() | header["model"].keys())
        if stored["model"].get(key) != header["model"].get(key)
    ]
    if model:
        found.append("the model config differs (" + ", ".join(model) + ")")
    for key in sorted(stored["settings"].keys() | header["settings"].keys()):
        old, new = stored["settings"].get(key), header["settings"].get(key)
        if key not in NAMED_ELSEWHERE and old != new:
            found.append(f"--{key} was {_shown(old)}, now {_shown(new)}")
    return found


def check_resume(stored: dict, header: dict, nonfinite: str, directory: str) -> None:
    """Raises ``ResumeRefusedError`` naming every difference unless a run with ``header`` and the
    ``--nonfinite`` policy ``nonfinite`` may continue the stored manifest ``stored`` of
    ``directory``."""
    missing = [key for key in header if key not in stored["header"]]
    if missing:
        problems = [
            f"its header lacks {', '.join(missing)}, so it was not written by python -m "
            "qmoe_jax.compress"
        ]
    else:
        problems = header_differences(
            stored["header"], json.loads(json.dumps(header))
        )  # tuples as JSON lists
    zeroed = sum(stored["nonfinite_zeroed"].values())
    if zeroed and nonfinite != "zero":
        problems.append(
            f"it set {zeroed} non-finite source values to 0 (--nonfinite zero), now --nonfinite "
            f"{nonfinite}"
        )
    if problems:
        raise ResumeRefusedError(
            f"{directory} holds a run that this one cannot continue: " + "; ".join(problems),
            "re-run with the checkpoint, tokenizer and settings it started with, or choose a new "
            "--output_dir "
            f"(or delete {directory} to start over)",
        )
