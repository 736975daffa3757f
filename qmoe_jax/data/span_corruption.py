"""T5 span corruption (Raffel et al. 2020, t5.data.preprocessors.span_corruption).

Lingo: a chunk of ``tokens_length`` raw tokens gets a noise mask with
``round(tokens_length * noise_density)`` noise tokens in
``round(noise / mean_noise_span_length)`` spans; the chunk always starts with a
non-noise span and ends with a noise span. Inputs replace each noise span by
one sentinel (``<extra_id_0>``, ``<extra_id_1>``, ... = descending ids from the
top of the vocabulary); targets replace each non-noise span by the same
sentinel, so targets read ``<extra_id_0> noise_0 <extra_id_1> noise_1 ...``.
Both end with EOS. Randomness is seeded per example: the same (seed, index)
gives the same mask everywhere.
"""

from __future__ import annotations

import numpy as np

EOS_ID = 1


def _round(x: np.floating) -> int:
    # tf.round rounds half to even, like np.round; T5 computes in float32.
    return int(np.round(np.float32(x)))


def random_spans_helper(
    inputs_length: int,
    noise_density: float = 0.15,
    mean_noise_span_length: float = 3.0,
) -> tuple[int, int]:
    """Raw chunk length and targets length so that corrupted inputs fill ``inputs_length``.

    Counts one sentinel per span on both sides and one EOS, as T5 does.

    Returns:
      (tokens_length, targets_length); e.g. (568, 114) for inputs_length 512.
    """

    def lengths(tokens_length: int) -> tuple[int, int]:
        noise = _round(np.float32(tokens_length) * np.float32(noise_density))
        spans = _round(np.float32(noise) / np.float32(mean_noise_span_length))
        return tokens_length - noise + spans + 1, noise + spans + 1

    tokens_length = inputs_length - 1
    while lengths(tokens_length + 1)[0] <= inputs_length:
        tokens_length += 1
    return tokens_length, lengths(tokens_length)[1]


def random_segmentation(num_items: int, num_segments: int, rng: np.random.Generator) -> np.ndarray:
    """Splits ``num_items`` into ``num_segments`` non-empty runs uniformly at random; returns run
    lengths."""
    first_in_segment = np.arange(num_items - 1) < num_segments - 1
    rng.shuffle(first_in_segment)
    segment_id = np.cumsum(np.concatenate([[0], first_in_segment]))
    return np.bincount(segment_id, minlength=num_segments)


def random_spans_noise_mask(
    length: int,
    rng: np.random.Generator,
    noise_density: float = 0.15,
    mean_noise_span_length: float = 3.0,
) -> np.ndarray:
    """bool[length]: True on noise tokens. Starts with non-noise, ends with noise."""
    original_length = length
    length = max(length, 2)
    noise = _round(np.float32(length) * np.float32(noise_density))
    noise = min(max(noise, 1), length - 1)
    spans = max(_round(np.float32(noise) / np.float32(mean_noise_span_length)), 1)
    noise_lengths = random_segmentation(noise, spans, rng)
    nonnoise_lengths = random_segmentation(length - noise, spans, rng)
    interleaved = np.stack([nonnoise_lengths, noise_lengths], axis=1).reshape(-1)
    span_start = np.zeros(length, np.int64)
    span_start[np.cumsum(interleaved)[:-1]] = 1
    is_noise = np.cumsum(span_start) % 2 == 1
    return is_noise[:original_length]


def noise_span_to_unique_sentinel(
    tokens: np.ndarray, noise_mask: np.ndarray, first_sentinel: int
) -> np.ndarray:
    """Replaces each noise span by one sentinel, counting down from ``first_sentinel``."""
    previous_is_noise = np.concatenate([[False], noise_mask[:-1]])
    first_noise = noise_mask & ~previous_is_noise
    subsequent_noise = noise_mask & previous_is_noise
    sentinels = first_sentinel + 1 - np.cumsum(first_noise)
    tokens = np.where(first_noise, sentinels, tokens)
    return tokens[~subsequent_noise]


def span_corrupt(
    tokens: np.ndarray,
    rng: np.random.Generator,
    first_sentinel: int,
    noise_density: float = 0.15,
    mean_noise_span_length: float = 3.0,
) -> tuple[np.ndarray, np.ndarray]:
    """Corrupts one chunk of token ids.

    Args:
      tokens: int32[length] raw token ids (no EOS).
      rng: the example's generator.
      first_sentinel: id of ``<extra_id_0>`` (vocabulary size with sentinels − 1).

    Returns:
      (inputs, targets), int32 arrays, each ending with EOS.
    """
    tokens = np.asarray(tokens, np.int32)
    if tokens.ndim != 1 or tokens.size == 0:
        raise ValueError(
            f"span_corrupt needs a non-empty 1-D token array, got shape {tokens.shape}"
        )
    mask = random_spans_noise_mask(tokens.size, rng, noise_density, mean_noise_span_length)
    inputs = noise_span_to_unique_sentinel(tokens, mask, first_sentinel)
    targets = noise_span_to_unique_sentinel(tokens, ~mask, first_sentinel)
    eos = np.asarray([EOS_ID], np.int32)
    return np.concatenate([inputs, eos]).astype(np.int32), np.concatenate([targets, eos]).astype(
        np.int32
    )
