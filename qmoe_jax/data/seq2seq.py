"""Seq2seq examples from JSON-lines files of ``{"inputs": ..., "targets": ...}``.

The generic text-to-text form of T5 tasks: each line is one JSON object with
two strings. Both are tokenized with the model's vocabulary and end with EOS,
as T5's ``seqio`` preprocessors append it. Inputs and targets may hold
``<extra_id_j>`` sentinel marks (span infilling), which become sentinel ids, as
seqio's vocabulary (its sentinels are user-defined pieces) tokenizes them.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np

from qmoe_jax.data.tokenizer import EOS_ID, Tokenizer


@dataclasses.dataclass(frozen=True)
class Seq2SeqExample:
    """One text pair, with where it came from (``file:line``) for error messages and per-example
    output."""

    inputs: str
    targets: str
    source: str = ""


def read_jsonl(path: str) -> list[Seq2SeqExample]:
    """Every non-blank line of ``path`` as a ``Seq2SeqExample``.

    Raises ValueError naming the file and line of the first malformed line: not
    JSON, not an object, or ``inputs``/``targets`` missing or not strings.
    """
    examples = []
    try:
        with open(path, encoding="utf-8") as handle:
            lines = handle.readlines()
    except OSError as error:
        raise ValueError(f"cannot read task file {path}: {error.strerror or error}") from error
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(
                f"{where}: not valid JSON ({error.msg}); each line must be one "
                '{"inputs": "...", "targets": "..."} object'
            ) from error
        if not isinstance(record, dict):
            raise ValueError(
                f'{where}: expected a JSON object with "inputs" and "targets", '
                f"got {type(record).__name__}"
            )
        for key in ("inputs", "targets"):
            if not isinstance(record.get(key), str):
                found = "missing" if key not in record else f"a {type(record[key]).__name__}"
                raise ValueError(f'{where}: "{key}" must be a string, it is {found}')
        examples.append(Seq2SeqExample(record["inputs"], record["targets"], where))
    if not examples:
        raise ValueError(f"task file {path} holds no examples")
    return examples


def tokenize_example(
    example: Seq2SeqExample,
    tokenizer: Tokenizer,
    inputs_length: int | None = None,
    targets_length: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """(inputs, targets) int32 token arrays, each ending with EOS, truncated to the given lengths
    (EOS kept as the last token), as T5's ``trim_and_pad`` with ``append_eos`` does."""

    def tokens(ids: list[int], length: int | None) -> np.ndarray:
        ids = ids + [EOS_ID]
        if length is not None and len(ids) > length:
            ids = ids[: length - 1] + [EOS_ID]
        return np.asarray(ids, np.int32)

    return (
        tokens(tokenizer.encode_with_sentinels(example.inputs), inputs_length),
        tokens(tokenizer.encode_with_sentinels(example.targets), targets_length),
    )


def tokenize_examples(
    examples: list[Seq2SeqExample],
    tokenizer: Tokenizer,
    inputs_length: int | None = None,
    targets_length: int | None = None,
) -> list[tuple[np.ndarray, np.ndarray]]:
    """``tokenize_example`` over ``examples``, in order."""
    return [
        tokenize_example(example, tokenizer, inputs_length, targets_length) for example in examples
    ]
