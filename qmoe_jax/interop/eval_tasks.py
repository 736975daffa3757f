"""Evaluation tasks by name, as seqio registers them for T5X: span corruption, seq2seq JSON
lines, mixtures.

- ``SpanCorruptionTask``: T5's span corruption (noise density 0.15, mean span
  3, seed 0) on validation text; scored per example (target log-likelihood)
  and summarized as the paper's loss, nats per target token.
- ``Seq2SeqTask``: ``{"inputs", "targets"}`` JSON lines (``data.seq2seq``);
  scored per example and, unless ``predict=False``, predicted with greedy
  decoding and compared to the target string (exact match).
- ``Mixture``: a name for several tasks; each task is evaluated and written
  on its own, as seqio's evaluator does with a mixture's sub-tasks.

Lengths (``task_feature_lengths``, T5X's ``TASK_FEATURE_LENGTHS``):
``inputs`` is the encoder length (span corruption: default 128, the
bundled model's; seq2seq: default the longest example, rounded up to a
multiple of 8, else longer examples are truncated keeping EOS);
``targets`` is the decoder length of seq2seq tasks (span corruption derives
its own from ``inputs``) and the most tokens a prediction may have.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np

from qmoe_jax.data import Tokenizer, bundled
from qmoe_jax.data.seq2seq import Seq2SeqExample, read_jsonl, tokenize_examples
from qmoe_jax.inference.evaluation import Example, validation_set

SPAN_SOURCES = ("bundled", "c4", "text")


@dataclasses.dataclass(frozen=True)
class SpanCorruptionTask:
    """Span-corruption loss on ``source``: "bundled" (the bundled corpus's held-out plays), "c4"
    (C4's validation shards under ``location``, a directory or glob) or "text" (files matching the
    glob ``location``, one document each). ``num_examples``: the first N examples (None: all)."""

    name: str
    source: str = "bundled"
    location: str | None = None
    num_examples: int | None = None

    def __post_init__(self):
        if self.source not in SPAN_SOURCES:
            raise ValueError(
                f"task {self.name!r}: source must be one of {', '.join(SPAN_SOURCES)}, "
                f"got {self.source!r}"
            )


@dataclasses.dataclass(frozen=True)
class Seq2SeqTask:
    """A JSON-lines file of ``{"inputs", "targets"}`` at ``path``; ``predict``: also decode greedily
    and report exact match; ``num_examples``: the first N lines (None: all)."""

    name: str
    path: str | None = None
    predict: bool = True
    num_examples: int | None = None


@dataclasses.dataclass(frozen=True)
class Mixture:
    """Several tasks under one name, evaluated one by one."""

    name: str
    tasks: tuple[str, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "tasks", tuple(self.tasks))


Task = SpanCorruptionTask | Seq2SeqTask


class UnknownTaskError(ValueError):
    """A task or mixture name that no definition has."""


@dataclasses.dataclass(frozen=True)
class TaskData:
    """A task's tokenized examples and the batch lengths they run at; ``texts`` holds seq2seq
    pairs."""

    examples: list[Example]
    encoder_length: int
    decoder_length: int
    texts: list[Seq2SeqExample] | None = None


def resolve(name: str, definitions: Sequence[Task | Mixture]) -> list[Task]:
    """The tasks ``name`` stands for: itself, or a mixture's tasks (mixtures may nest), in order."""
    by_name: dict[str, Task | Mixture] = {}
    for item in definitions:
        if item.name in by_name and by_name[item.name] != item:
            raise ValueError(f"two different tasks or mixtures are named {item.name!r}; rename one")
        by_name[item.name] = item

    def expand(current: str, trail: tuple[str, ...]) -> list[Task]:
        if current not in by_name:
            where = f" (in mixture {trail[-1]!r})" if trail else ""
            raise UnknownTaskError(
                f"unknown task or mixture {current!r}{where}; known: {', '.join(sorted(by_name))}"
            )
        item = by_name[current]
        if not isinstance(item, Mixture):
            return [item]
        if current in trail:
            raise ValueError(f"mixture {current!r} contains itself (through {' -> '.join(trail)})")
        if not item.tasks:
            raise ValueError(f"mixture {current!r} lists no tasks")
        return [task for sub in item.tasks for task in expand(sub, trail + (current,))]

    return list(dict.fromkeys(expand(name, ())))


def _round_up(n: int) -> int:
    return -(-n // 8) * 8


def load_task(
    task: Task, tokenizer: Tokenizer, feature_lengths: Mapping[str, int] | None
) -> TaskData:
    """Reads and tokenizes ``task``'s examples (see the module docstring for the lengths)."""
    lengths = dict(feature_lengths or {})
    unknown = sorted(set(lengths) - {"inputs", "targets"})
    if unknown:
        raise ValueError(
            f"TASK_FEATURE_LENGTHS has unknown features {unknown}; use 'inputs' and 'targets'"
        )
    for feature, length in lengths.items():
        if not isinstance(length, int) or isinstance(length, bool) or length < 4:
            raise ValueError(
                f"TASK_FEATURE_LENGTHS['{feature}'] must be an integer of at least 4, got "
                f"{length!r}"
            )
    if isinstance(task, SpanCorruptionTask):
        if task.source != "bundled" and not task.location:
            raise ValueError(
                f"task {task.name!r} reads {task.source} data but its location is not set; set "
                f"{task.name}/SpanCorruptionTask.location (the built-in tasks read the macros "
                "C4_DIR "
                "and TEXT_FILES)"
            )
        source = "bundled" if task.source == "bundled" else f"{task.source}:{task.location}"
        found = validation_set(
            source, tokenizer, task.num_examples, lengths.get("inputs", bundled.INPUTS_LENGTH)
        )
        if not found.examples:
            raise ValueError(f"task {task.name!r}: {source} yields no examples")
        return TaskData(found.examples, found.encoder_length, found.decoder_length)
    if not task.path:
        raise ValueError(
            f"task {task.name!r} has no JSON-lines file; set {task.name}/Seq2SeqTask.path (the "
            "built-in jsonl_seq2seq task reads the macro JSONL_FILE)"
        )
    texts = read_jsonl(task.path)[: task.num_examples]
    examples = tokenize_examples(texts, tokenizer, lengths.get("inputs"), lengths.get("targets"))
    encoder_length = lengths.get("inputs") or _round_up(max(inputs.size for inputs, _ in examples))
    decoder_length = lengths.get("targets") or _round_up(
        max(targets.size for _, targets in examples)
    )
    return TaskData(examples, encoder_length, decoder_length, texts)


def as_list(tokens: np.ndarray) -> list[int]:
    return [int(t) for t in tokens]
