"""Span-corruption validation loss, the paper's quality metric.

The loss is teacher-forced and length-weighted: the sum of token
cross-entropies (nats) over all target tokens of N validation examples,
divided by the number of target tokens. Examples are batched in a fixed
order with a fixed batch size (the last batch padded with empty examples), so
MoE routing groups, and with them the result, are reproducible.
"""

from __future__ import annotations

import dataclasses
import glob
import itertools
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from qmoe_jax.data import (
    SpanCorruptionConfig,
    Tokenizer,
    batch_examples,
    bundled,
    c4_documents,
    corpus,
    span_corruption_examples,
    text_file_documents,
)

Example = tuple[np.ndarray, np.ndarray]


def validation_documents(source: str):
    """Documents of a validation source: "bundled" (the bundled corpus's held-out
    plays), "c4:<dir or glob>" (C4's validation shards) or "text:<glob>" (each
    matching UTF-8 file is one document, in sorted path order)."""
    if source == "bundled":
        return corpus.documents("validation")
    kind, _, location = source.partition(":")
    if kind == "c4" and location:
        return c4_documents(location, split="validation")
    if kind == "text" and location:
        paths = sorted(glob.glob(location))
        if not paths:
            raise ValueError(f"no text files match {location!r} (validation source {source!r})")
        return text_file_documents(paths)
    raise ValueError(
        f"unknown validation source {source!r}; use 'bundled', 'c4:<dir or glob>' or 'text:<glob>'"
    )


def validation_examples(
    documents, tokenizer: Tokenizer, config: SpanCorruptionConfig, num_samples: int | None = None
) -> list[Example]:
    """The first ``num_samples`` span-corruption examples of ``documents`` (all if None)."""
    examples = span_corruption_examples(documents, tokenizer, config)
    return list(itertools.islice(examples, num_samples))


@dataclasses.dataclass(frozen=True)
class ValidationSet:
    """Validation examples with the batch lengths they are scored at."""

    source: str
    examples: list[Example]
    encoder_length: int
    decoder_length: int


def validation_set(
    source: str,
    tokenizer: Tokenizer,
    num_samples: int | None = None,
    inputs_length: int = bundled.INPUTS_LENGTH,
) -> ValidationSet:
    """The first ``num_samples`` validation examples of ``source`` (see ``validation_documents``),
    span-corrupted with seed 0; C4 is packed per document, the bundled text concatenated. The
    decoder length is the targets length rounded up to a multiple of 8."""
    packing = "document" if source.startswith("c4:") else "concat"
    config = SpanCorruptionConfig(inputs_length=inputs_length, packing=packing)
    examples = validation_examples(validation_documents(source), tokenizer, config, num_samples)
    targets_length = config.lengths[1]
    return ValidationSet(source, examples, inputs_length, targets_length + (-targets_length) % 8)


def bundled_validation_examples(
    tokenizer: Tokenizer, num_samples: int | None = None
) -> list[Example]:
    """Examples of the bundled corpus's validation split (seed 0, inputs length 128)."""
    return validation_examples(
        corpus.documents("validation"), tokenizer, bundled.span_corruption_config(), num_samples
    )


def token_log_likelihoods(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """float32[B, T]: log p(target) of each position (nats), from logits f32|bf16[B, T, V] and
    targets int32[B, T]."""
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]


def token_cross_entropy(
    logits: jax.Array, targets: jax.Array, weights: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Sum of per-token cross-entropy (nats) over weighted positions, and the weight sum.

    logits f32|bf16[B, T, V]; targets int32[B, T]; weights f32[B, T].
    """
    token_loss = -token_log_likelihoods(logits, targets)
    return (token_loss * weights).sum(), weights.sum()


def model_inputs(batch: dict) -> tuple:
    """The model's positional inputs (encoder tokens, decoder inputs, decoder targets) of a
    batch."""
    return (
        batch["encoder_input_tokens"],
        batch["decoder_input_tokens"],
        batch["decoder_target_tokens"],
    )


def padded_batches(
    examples: list[Example], batch_size: int, encoder_length: int, decoder_length: int
) -> list[dict[str, np.ndarray]]:
    """Fixed-size batches in order; the last one is filled with empty examples (zero loss
    weight)."""
    empty = (np.zeros(0, np.int32), np.zeros(0, np.int32))
    batches = []
    for start in range(0, len(examples), batch_size):
        chunk = examples[start : start + batch_size]
        chunk = chunk + [empty] * (batch_size - len(chunk))
        batches.append(batch_examples(chunk, encoder_length, decoder_length))
    return batches


def make_eval_step(model):
    """A jitted (params, batch) -> (loss_sum, weight_sum) with dropout off and eval capacity."""

    @jax.jit
    def step(params, batch):
        logits = model.apply({"params": params}, *model_inputs(batch), enable_dropout=False)
        return token_cross_entropy(
            logits, batch["decoder_target_tokens"], batch["decoder_loss_weights"]
        )

    return step


def batch_sums(eval_step, params, batches) -> list[tuple[float, float]]:
    """(loss sum, weight sum) of each of ``batches``, in order."""
    sums = []
    for batch in batches:
        batch_loss, batch_weight = eval_step(params, batch)
        sums.append((float(batch_loss), float(batch_weight)))
    return sums


def mean_of_sums(sums: list[tuple[float, float]]) -> float:
    """Length-weighted mean cross-entropy from per-batch ``batch_sums``, added in their order (so
    sums computed in several processes give the one-process figure)."""
    loss_sum = weight_sum = 0.0
    for batch_loss, batch_weight in sums:
        loss_sum += batch_loss
        weight_sum += batch_weight
    return loss_sum / max(weight_sum, 1.0)


def evaluate_batches(eval_step, params, batches) -> float:
    """Length-weighted mean cross-entropy (nats per target token) over ``batches``."""
    return mean_of_sums(batch_sums(eval_step, params, batches))


def mean_cross_entropies(
    model,
    params_by_name: Mapping[str, dict],
    examples: list[Example],
    batch_size: int = 32,
    encoder_length: int | None = None,
    decoder_length: int | None = None,
    progress: bool = False,
) -> dict[str, float]:
    """``{name: loss}`` of ``model`` under each parameter tree, on the same batches and one compiled
    step.

    Loss: length-weighted mean cross-entropy in nats per target token. Lengths
    default to the longest example, rounded up to a multiple of 8.
    """
    if not examples:
        raise ValueError("no validation examples to evaluate")

    def round_up(n):
        return -(-n // 8) * 8

    encoder_length = encoder_length or round_up(max(i.size for i, _ in examples))
    decoder_length = decoder_length or round_up(max(t.size for _, t in examples))
    batches = padded_batches(examples, batch_size, encoder_length, decoder_length)
    eval_step = make_eval_step(model)
    losses = {}
    for name, params in params_by_name.items():
        shown = tqdm(batches, desc=f"evaluate {name}", unit="batch") if progress else batches
        losses[name] = evaluate_batches(eval_step, params, shown)
    return losses


def mean_cross_entropy(
    model,
    params,
    examples: list[Example],
    batch_size: int = 32,
    encoder_length: int | None = None,
    decoder_length: int | None = None,
    progress: bool = False,
) -> float:
    """Length-weighted mean cross-entropy (nats per target token) of ``model`` on ``examples``."""
    return mean_cross_entropies(
        model, {"model": params}, examples, batch_size, encoder_length, decoder_length, progress
    )["model"]
