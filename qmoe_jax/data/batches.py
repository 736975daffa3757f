"""From documents to span-corrupted, padded batches (T5's span_corruption task).

Two ways to cut documents into examples:
- "concat" (T5 pre-training): tokenize, concatenate all documents, split into
  chunks of ``tokens_length`` raw tokens (``random_spans_helper``), corrupt each.
- "document" (QMoE's C4 evaluation): each document that fits in one chunk is one
  example; longer documents are skipped.
Example ``i`` is corrupted with ``np.random.default_rng((seed, i))``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator

import numpy as np

from qmoe_jax.data.span_corruption import random_spans_helper, span_corrupt
from qmoe_jax.data.tokenizer import PAD_ID, Tokenizer


@dataclasses.dataclass(frozen=True)
class SpanCorruptionConfig:
    """How examples are made. Lengths count tokens after corruption, EOS included."""

    inputs_length: int = 128
    noise_density: float = 0.15
    mean_noise_span_length: float = 3.0
    packing: str = "concat"
    seed: int = 0

    def __post_init__(self):
        if self.packing not in ("concat", "document"):
            raise ValueError(f"packing must be 'concat' or 'document', got {self.packing!r}")
        if self.inputs_length < 4:
            raise ValueError(f"inputs_length must be at least 4, got {self.inputs_length}")

    @property
    def lengths(self) -> tuple[int, int]:
        """(tokens_length, targets_length): raw chunk length and the targets length."""
        return random_spans_helper(
            self.inputs_length, self.noise_density, self.mean_noise_span_length
        )


def token_chunks(
    documents: Iterable[str], tokenizer: Tokenizer, config: SpanCorruptionConfig
) -> Iterator[np.ndarray]:
    """Raw token chunks (int32, no EOS) per ``config.packing``."""
    tokens_length, _ = config.lengths
    if config.packing == "document":
        for text in documents:
            ids = tokenizer.encode(text)
            if 0 < len(ids) <= tokens_length:
                yield np.asarray(ids, np.int32)
        return
    buffer = np.zeros(0, np.int32)
    for text in documents:
        buffer = np.concatenate([buffer, np.asarray(tokenizer.encode(text), np.int32)])
        while buffer.size >= tokens_length:
            yield buffer[:tokens_length]
            buffer = buffer[tokens_length:]
    if buffer.size:
        yield buffer


def span_corruption_examples(
    documents: Iterable[str], tokenizer: Tokenizer, config: SpanCorruptionConfig
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Yields (inputs, targets) int32 arrays, both ending with EOS."""
    first_sentinel = tokenizer.sentinel(0)
    for index, chunk in enumerate(token_chunks(documents, tokenizer, config)):
        rng = np.random.default_rng((config.seed, index))
        yield span_corrupt(
            chunk, rng, first_sentinel, config.noise_density, config.mean_noise_span_length
        )


def batch_examples(
    examples: list[tuple[np.ndarray, np.ndarray]], encoder_length: int, decoder_length: int
) -> dict[str, np.ndarray]:
    """Pads examples into T5X's feature arrays.

    Returns:
      encoder_input_tokens int32[B, encoder_length], decoder_input_tokens
      int32[B, decoder_length] (targets shifted right, starting with PAD = 0),
      decoder_target_tokens int32[B, decoder_length], decoder_loss_weights
      float32[B, decoder_length] (1 on real target tokens).
    """
    batch = len(examples)
    encoder = np.full((batch, encoder_length), PAD_ID, np.int32)
    targets = np.full((batch, decoder_length), PAD_ID, np.int32)
    for row, (inputs, target) in enumerate(examples):
        if inputs.size > encoder_length or target.size > decoder_length:
            raise ValueError(
                f"example {row} has {inputs.size} input and {target.size} target tokens, more than "
                f"the batch shape ({encoder_length}, {decoder_length}); raise the lengths"
            )
        encoder[row, : inputs.size] = inputs
        targets[row, : target.size] = target
    decoder_inputs = np.concatenate(
        [np.full((batch, 1), PAD_ID, np.int32), targets[:, :-1]], axis=1
    )
    return {
        "encoder_input_tokens": encoder,
        "decoder_input_tokens": decoder_inputs,
        "decoder_target_tokens": targets,
        "decoder_loss_weights": (targets != PAD_ID).astype(np.float32),
    }


PREMASKS = ("encoder", "encoder_decoder", "none")


def check_premask(premask: str) -> None:
    if premask not in PREMASKS:
        raise ValueError(f"unknown premask {premask!r}; choose one of {', '.join(PREMASKS)}")


def hessian_masks(
    batch: dict[str, np.ndarray], tokenizer: Tokenizer, premask: str = "encoder"
) -> tuple[np.ndarray, np.ndarray]:
    """Premasking: which token positions feed Hessians (docs/calibration.md §2).

    Padding never does. Beyond that, ``premask`` drops:

    - "encoder": encoder positions holding a sentinel.
    - "encoder_decoder": those, and decoder positions whose target (the next
      token) is a sentinel. This is QMoE's mask (``switch.py``).
    - "none": nothing.

    The masks apply to Hessian inputs only; every token still flows through the
    (quantized) model. On the bundled model the decoder part of QMoE's mask
    hurts: GPTQ never sees the quarter of decoder positions that predict a
    sentinel, leaves their expert outputs worse than RTN does, and the loss on
    the other targets rises almost as much as with RTN (docs/measurements.md, quality.py).

    Returns:
      (encoder_mask bool[B, Le], decoder_mask bool[B, Ld]).
    """
    check_premask(premask)
    encoder = batch["encoder_input_tokens"]
    targets = batch["decoder_target_tokens"]
    encoder_mask = encoder != PAD_ID
    decoder_mask = targets != PAD_ID
    if premask != "none":
        encoder_mask &= ~tokenizer.is_sentinel(encoder)
    if premask == "encoder_decoder":
        decoder_mask &= ~tokenizer.is_sentinel(targets)
    return encoder_mask, decoder_mask
