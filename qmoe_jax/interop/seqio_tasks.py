"""seqio tasks for stock ``t5x.eval`` on a qmoe_jax export (``MIXTURE_OR_TASK_MODULE``).

Import this module only where seqio and TensorFlow are installed (a T5X
environment); nothing else in qmoe_jax imports it. ``configs/t5x/*.gin`` name
it as ``MIXTURE_OR_TASK_MODULE``; t5x imports it after parsing gin, and it
reads its settings from gin macros:

- ``VOCABULARY_FILE`` (required): the SentencePiece model, used with 100 extra ids;
- ``QMOE_SPAN_SOURCE`` (default ``'bundled'``) and ``QMOE_NUM_EXAMPLES``
  (default None: all) for ``qmoe_span_corruption``;
- ``QMOE_JSONL_FILE`` for ``qmoe_jsonl_seq2seq``.

Tasks (split ``test``, the split T5X's eval.gin and infer.gin read):

- ``qmoe_span_corruption``: qmoe_jax's own span-corruption validation
  examples (``inference.validation_set``, encoder length
  ``TASK_FEATURE_LENGTHS['inputs']``), already tokenized, so T5X scores
  exactly the examples ``python -m qmoe_jax.evaluate`` scores; metric: the
  mean and the sum of the per-example log-likelihood.
- ``qmoe_jsonl_seq2seq``: ``{"inputs", "targets"}`` JSON lines, tokenized by
  seqio; scored and predicted (exact match, in percent). Its ``train`` and
  ``validation`` splits read the same file, for ``t5x.train`` (docs/gin.md §8).
"""

from __future__ import annotations

import gin
import numpy as np
import seqio
import tensorflow as tf

from qmoe_jax.data import Tokenizer, bundled
from qmoe_jax.data.seq2seq import read_jsonl
from qmoe_jax.data.tokenizer import NUM_SENTINELS
from qmoe_jax.inference.evaluation import validation_set

SPLIT = "test"


def _macro(name: str, default=None, required: bool = False):
    try:
        return gin.query_parameter(f"%{name}")
    except ValueError:
        if required:
            raise ValueError(f"qmoe_jax.interop.seqio_tasks needs the gin macro {name}") from None
        return default


def score_metrics(targets, scores) -> dict:
    """Mean and sum of the per-example target log-likelihoods (nats)."""
    scores = np.asarray(scores, np.float64)
    return {"mean_log_likelihood": float(scores.mean()), "sum_log_likelihood": float(scores.sum())}


def exact_match(targets, predictions) -> dict:
    """Percent of predictions equal to their target string."""
    return {"exact_match": 100.0 * float(np.mean([p == t for p, t in zip(predictions, targets)]))}


def _span_corruption_dataset(split: str, shuffle_files: bool = False, seed=None) -> tf.data.Dataset:
    tokenizer = Tokenizer(_macro("VOCABULARY_FILE", required=True))
    lengths = _macro("TASK_FEATURE_LENGTHS") or {}
    found = validation_set(
        _macro("QMOE_SPAN_SOURCE", "bundled"),
        tokenizer,
        _macro("QMOE_NUM_EXAMPLES"),
        lengths.get("inputs", bundled.INPUTS_LENGTH),
    )
    inputs = [x for x, _ in found.examples]
    targets = [y for _, y in found.examples]
    spec = tf.TensorSpec([None], tf.int32)
    return tf.data.Dataset.from_generator(
        lambda: ({"inputs": x, "targets": y} for x, y in zip(inputs, targets)),
        output_signature={"inputs": spec, "targets": spec},
    )


def _jsonl_dataset(split: str, shuffle_files: bool = False, seed=None) -> tf.data.Dataset:
    examples = read_jsonl(_macro("QMOE_JSONL_FILE", required=True))
    spec = tf.TensorSpec([], tf.string)
    return tf.data.Dataset.from_generator(
        lambda: ({"inputs": e.inputs, "targets": e.targets} for e in examples),
        output_signature={"inputs": spec, "targets": spec},
    )


def _register() -> None:
    vocabulary = seqio.SentencePieceVocabulary(
        _macro("VOCABULARY_FILE", required=True), extra_ids=NUM_SENTINELS
    )
    features = {name: seqio.Feature(vocabulary, add_eos=True) for name in ("inputs", "targets")}
    for name in ("qmoe_span_corruption", "qmoe_jsonl_seq2seq"):
        if name in seqio.TaskRegistry.names():
            seqio.TaskRegistry.remove(name)
    seqio.TaskRegistry.add(
        "qmoe_span_corruption",
        source=seqio.FunctionDataSource(_span_corruption_dataset, splits=[SPLIT]),
        preprocessors=[],
        output_features=features,
        metric_fns=[score_metrics],
    )
    seqio.TaskRegistry.add(
        "qmoe_jsonl_seq2seq",
        source=seqio.FunctionDataSource(_jsonl_dataset, splits=["train", "validation", SPLIT]),
        preprocessors=[seqio.preprocessors.tokenize, seqio.preprocessors.append_eos_after_trim],
        output_features=features,
        metric_fns=[score_metrics, exact_match],
    )


_register()
