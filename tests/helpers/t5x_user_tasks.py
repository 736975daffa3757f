"""A T5X user's own seqio tasks, as their ``MIXTURE_OR_TASK_MODULE`` registers them.

Nothing here is qmoe_jax's: a TSV text source, the user's own preprocessor
(parsing the lines) and metric functions, seqio's tokenization and EOS, and a
mixture of the task with qmoe_jax's ``qmoe_span_corruption``. The tests run
stock ``t5x.eval``/``t5x.infer``/``t5x.train`` with
``MIXTURE_OR_TASK_MODULE='helpers.t5x_user_tasks'`` on the compressed model.

The data is ``$QMOE_USER_TASK_DATA/{train,validation,test}.tsv``, one
``input<TAB>target`` pair per line; the vocabulary is the bundled model's.
"""

import os

import numpy as np
import seqio
import tensorflow as tf

from qmoe_jax.data import bundled

TASK = "user_quotes"
MIXTURE = "user_quotes_and_span_corruption"
SPLITS = ("train", "validation", "test")


def parse_tsv(dataset: tf.data.Dataset) -> tf.data.Dataset:
    """The user's preprocessor: ``input<TAB>target`` lines into ``inputs``/``targets`` strings."""

    def parse(line):
        fields = tf.strings.split(line, "\t", maxsplit=1)
        return {"inputs": fields[0], "targets": fields[1]}

    return dataset.map(parse, num_parallel_calls=tf.data.AUTOTUNE)


def sequence_accuracy(targets, predictions) -> dict:
    """Percent of predictions equal to their target."""
    return {
        "sequence_accuracy": 100.0 * float(np.mean([t == p for t, p in zip(targets, predictions)]))
    }


def mean_score(targets, scores) -> dict:
    """Mean log-likelihood of the targets."""
    return {"mean_score": float(np.mean(scores))}


def _register() -> None:
    folder = os.environ.get("QMOE_USER_TASK_DATA", "")
    vocabulary = seqio.SentencePieceVocabulary(bundled.tokenizer_path(), extra_ids=100)
    features = {name: seqio.Feature(vocabulary, add_eos=True) for name in ("inputs", "targets")}
    for name in (MIXTURE, TASK):
        for registry in (seqio.MixtureRegistry, seqio.TaskRegistry):
            if name in registry.names():
                registry.remove(name)
    seqio.TaskRegistry.add(
        TASK,
        source=seqio.TextLineDataSource(
            {split: os.path.join(folder, f"{split}.tsv") for split in SPLITS}
        ),
        preprocessors=[
            parse_tsv,
            seqio.preprocessors.tokenize,
            seqio.CacheDatasetPlaceholder(),
            seqio.preprocessors.append_eos_after_trim,
        ],
        output_features=features,
        metric_fns=[sequence_accuracy, mean_score],
    )
    import qmoe_jax.interop.seqio_tasks  # noqa: F401  (registers qmoe_span_corruption)

    seqio.MixtureRegistry.add(MIXTURE, [TASK, "qmoe_span_corruption"], default_rate=1.0)


_register()
