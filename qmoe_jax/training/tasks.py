"""Fine-tuning tasks: training batches by step and held-out validation examples.

Task specs (``--task``):
- ``span_corruption`` or ``span_corruption:<text>``, text being ``bundled``
  (the bundled corpus: trains on its training works, validates on the held-out
  plays, as ``python -m qmoe_jax.evaluate`` scores them), ``c4:<dir or glob>``
  (C4's train and validation shards) or ``text:<glob>`` (text files; every
  ``TEXT_VALIDATION_EVERY``-th chunk is held out). Continued pre-training: the
  "repair" of compression error.
- ``jsonl:<train file>[,<validation file>]``: ``{"inputs", "targets"}`` lines
  (``data/seq2seq.py``); without a validation file its last
  ``JSONL_VALIDATION_FRACTION`` of the lines (at least one) is held out.
- ``name_the_work``: the bundled downstream task (``data/works.py``).

Batches are a function of the step: step k draws the same examples (and the
same span-corruption noise) whatever step a run resumed from.
"""

from __future__ import annotations

import dataclasses
import glob
import itertools
from collections.abc import Iterator

import numpy as np

from qmoe_jax.data import (
    SpanCorruptionConfig,
    Tokenizer,
    batch_examples,
    c4_documents,
    corpus,
    span_corrupt,
    text_file_documents,
    token_chunks,
    works,
)
from qmoe_jax.data.seq2seq import read_jsonl, tokenize_examples
from qmoe_jax.inference.evaluation import validation_set
from qmoe_jax.training.pretrain import training_batches

Example = tuple[np.ndarray, np.ndarray]
TEXT_VALIDATION_EVERY = 20
JSONL_VALIDATION_FRACTION = 0.1
SEQ2SEQ_TARGETS_LENGTH = 32


@dataclasses.dataclass
class Task:
    """A task's data at fixed batch lengths.

    Attributes:
      name: the spec it was made from.
      generative: scored by exact match of greedy generations too (seq2seq tasks).
      chunks: span corruption: the raw training chunks; examples: seq2seq: the tokenized training
        pairs.
      validation: held-out (inputs, targets) pairs, in a fixed order.
      first_sentinel: the tokenizer's first sentinel id (span corruption).
    """

    name: str
    generative: bool
    encoder_length: int
    decoder_length: int
    validation: list[Example]
    chunks: list[np.ndarray] | None = None
    examples: list[Example] | None = None
    first_sentinel: int = 0

    def batches(
        self, batch_size: int, seed: int, start_step: int = 0
    ) -> Iterator[dict[str, np.ndarray]]:
        """Endless training batches of ``batch_size``; the one of step k depends on (seed, k)
        only."""
        if self.chunks is not None:
            return training_batches(
                self.chunks,
                self.first_sentinel,
                batch_size,
                self.encoder_length,
                self.decoder_length,
                seed,
                start_step,
            )
        return _example_batches(
            self.examples, batch_size, self.encoder_length, self.decoder_length, seed, start_step
        )


def _example_batches(
    examples: list[Example],
    batch_size: int,
    encoder_length: int,
    decoder_length: int,
    seed: int,
    start_step: int,
) -> Iterator[dict[str, np.ndarray]]:
    per_epoch = len(examples) // batch_size
    if per_epoch == 0:
        raise ValueError(
            f"{len(examples)} training examples cannot fill one batch of {batch_size}; lower "
            "--batch_size"
        )
    for step in itertools.count(start_step):
        epoch, position = divmod(step, per_epoch)
        order = np.random.default_rng((seed, epoch)).permutation(len(examples))
        chosen = order[position * batch_size : (position + 1) * batch_size]
        yield batch_examples([examples[i] for i in chosen], encoder_length, decoder_length)


def _round_up(n: int) -> int:
    return -(-n // 8) * 8


def _span_corruption(
    spec: str, source: str, tokenizer: Tokenizer, inputs_length: int, validation_examples: int
) -> Task:
    kind, _, location = source.partition(":")
    if kind not in ("bundled", "c4", "text") or (kind != "bundled" and not location):
        raise ValueError(
            f"unknown text {source!r} in task {spec!r}; use span_corruption:bundled, "
            "span_corruption:c4:<dir or glob> or span_corruption:text:<glob>"
        )
    config = SpanCorruptionConfig(
        inputs_length=inputs_length, packing="document" if kind == "c4" else "concat"
    )
    if kind == "bundled":
        documents = corpus.documents("train")
    elif kind == "c4":
        documents = c4_documents(location, split="train")
    else:
        paths = sorted(glob.glob(location))
        if not paths:
            raise ValueError(f"no text files match {location!r} (task {spec!r})")
        documents = text_file_documents(paths)
    chunks = [
        chunk
        for chunk in token_chunks(documents, tokenizer, config)
        if chunk.size == config.lengths[0]
    ]
    if kind == "text":
        held_out = chunks[::TEXT_VALIDATION_EVERY]
        chunks = [chunk for index, chunk in enumerate(chunks) if index % TEXT_VALIDATION_EVERY]
        validation = [
            span_corrupt(chunk, np.random.default_rng((0, index)), tokenizer.sentinel(0))
            for index, chunk in enumerate(held_out[:validation_examples])
        ]
    else:
        validation = validation_set(source, tokenizer, validation_examples, inputs_length).examples
    if not chunks or not validation:
        raise ValueError(
            f"task {spec!r} has {len(chunks)} training chunks and {len(validation)} validation "
            f"examples of {config.lengths[0]} tokens; it needs text for both"
        )
    return Task(
        spec,
        False,
        inputs_length,
        _round_up(config.lengths[1]),
        validation,
        chunks=chunks,
        first_sentinel=tokenizer.sentinel(0),
    )


def _seq2seq(
    spec: str, train, validation, tokenizer: Tokenizer, inputs_length: int, validation_examples: int
) -> Task:
    train_pairs = tokenize_examples(train, tokenizer, inputs_length, SEQ2SEQ_TARGETS_LENGTH)
    held_out = tokenize_examples(validation, tokenizer, inputs_length, SEQ2SEQ_TARGETS_LENGTH)
    order = np.random.default_rng(0).permutation(len(held_out))[:validation_examples]
    held_out = [held_out[i] for i in order]
    longest = max(t.size for _, t in train_pairs + held_out)
    return Task(spec, True, inputs_length, _round_up(longest), held_out, examples=train_pairs)


def load_task(
    spec: str, tokenizer: Tokenizer, inputs_length: int, validation_examples: int
) -> Task:
    """The task named by ``spec`` (see the module docstring), with at most ``validation_examples``
    held out (a seeded sample for seq2seq tasks, the first ones for span corruption)."""
    if validation_examples < 1:
        raise ValueError(f"validation examples must be at least 1, got {validation_examples}")
    if spec == "span_corruption" or spec.startswith("span_corruption:"):
        return _span_corruption(
            spec, spec.partition(":")[2] or "bundled", tokenizer, inputs_length, validation_examples
        )
    if spec.startswith("jsonl:"):
        files = spec[len("jsonl:") :].split(",")
        if not files[0] or len(files) > 2:
            raise ValueError(
                f"task {spec!r}: use jsonl:<train file> or jsonl:<train file>,<validation file>"
            )
        train = read_jsonl(files[0])
        if len(files) == 2:
            validation = read_jsonl(files[1])
        else:
            held = max(1, int(len(train) * JSONL_VALIDATION_FRACTION))
            if held >= len(train):
                raise ValueError(
                    f"{files[0]} holds {len(train)} example(s): too few to hold some out for "
                    "validation; pass a validation file as jsonl:<train>,<validation>"
                )
            train, validation = train[:-held], train[-held:]
        return _seq2seq(spec, train, validation, tokenizer, inputs_length, validation_examples)
    if spec == "name_the_work":
        return _seq2seq(
            spec,
            works.examples("train"),
            works.examples("validation"),
            tokenizer,
            inputs_length,
            validation_examples,
        )
    raise ValueError(
        f"unknown task {spec!r}; use span_corruption[:bundled|c4:<dir>|text:<glob>], "
        "jsonl:<train>[,<validation>] or name_the_work"
    )
