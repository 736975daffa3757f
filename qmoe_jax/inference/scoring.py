"""Per-example scores: the log-likelihood of each example's targets, as T5X's ``score_batch``.

A score is ``sum_t log p(target_t | inputs, target_<t)`` in nats over the
example's target tokens (EOS included), teacher-forced, dropout off, eval
capacity. Examples are batched exactly as ``evaluation.mean_cross_entropy``
batches them (fixed order, fixed batch size, last batch padded with empty
examples), so MoE routing groups match and ``-sum(scores) / sum(lengths)``
is that function's loss.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from tqdm import tqdm

from qmoe_jax.inference.evaluation import (
    Example,
    model_inputs,
    padded_batches,
    token_log_likelihoods,
)


@dataclasses.dataclass(frozen=True)
class Scores:
    """log_likelihoods float64[N] (nats per example) and target_tokens int64[N], in example
    order."""

    log_likelihoods: np.ndarray
    target_tokens: np.ndarray

    @property
    def loss(self) -> float:
        """Length-weighted mean cross-entropy in nats per target token."""
        return float(-self.log_likelihoods.sum() / max(int(self.target_tokens.sum()), 1))


def make_score_step(model):
    """A jitted (params, batch) -> float32[B] per-row target log-likelihood."""

    @jax.jit
    def step(params, batch):
        logits = model.apply({"params": params}, *model_inputs(batch), enable_dropout=False)
        token = token_log_likelihoods(logits, batch["decoder_target_tokens"])
        return (token * batch["decoder_loss_weights"]).sum(axis=-1)

    return step


def score_examples(
    model,
    params,
    examples: list[Example],
    batch_size: int,
    encoder_length: int,
    decoder_length: int,
    progress: bool = False,
    desc: str = "score",
) -> Scores:
    """Scores every example of ``examples`` ((inputs, targets) int32 arrays ending with EOS)."""
    if not examples:
        raise ValueError("no examples to score")
    step = make_score_step(model)
    batches = padded_batches(examples, batch_size, encoder_length, decoder_length)
    shown = tqdm(batches, desc=desc, unit="batch") if progress else batches
    rows = [np.asarray(jax.device_get(step(params, batch)), np.float64) for batch in shown]
    scores = np.concatenate(rows)[: len(examples)]
    lengths = np.asarray([targets.size for _, targets in examples], np.int64)
    return Scores(scores, lengths)
