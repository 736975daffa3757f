"""Calibration samples: span-corrupted examples, padded, with their premasks."""

from __future__ import annotations

import itertools
from collections.abc import Iterable

import numpy as np

from qmoe_jax.calibration.layer_pass import CalibrationData
from qmoe_jax.data import (
    SpanCorruptionConfig,
    Tokenizer,
    batch_examples,
    hessian_masks,
    span_corruption_examples,
)


def calibration_data(
    documents: Iterable[str],
    tokenizer: Tokenizer,
    config: SpanCorruptionConfig,
    num_samples: int,
    spread: bool = False,
    premask: str = "encoder",
) -> CalibrationData:
    """``num_samples`` span-corruption examples of ``documents`` as one padded batch.

    Args:
      spread: False takes the first examples (streaming, as QMoE does on C4);
        True reads all of them and takes an evenly spaced subset, so a small
        corpus of long documents is sampled throughout.
      premask: which positions are kept out of the Hessians (``hessian_masks``).

    Raises:
      ValueError: if the documents yield fewer samples than asked for.
    """
    examples = span_corruption_examples(documents, tokenizer, config)
    if spread:
        examples = list(examples)
        if len(examples) > num_samples:
            examples = [
                examples[i]
                for i in np.linspace(0, len(examples) - 1, num_samples).round().astype(int)
            ]
    examples = list(itertools.islice(examples, num_samples))
    if len(examples) < num_samples:
        raise ValueError(
            f"the calibration text yields only {len(examples)} samples of {config.inputs_length} "
            "tokens, "
            f"fewer than --num_samples {num_samples}; pass more text or lower --num_samples"
        )
    targets_length = config.lengths[1]
    batch = batch_examples(examples, config.inputs_length, targets_length + (-targets_length) % 8)
    encoder_premask, decoder_premask = hessian_masks(batch, tokenizer, premask)
    return CalibrationData(
        batch["encoder_input_tokens"],
        batch["decoder_input_tokens"],
        batch["decoder_target_tokens"],
        encoder_premask,
        decoder_premask,
    )
