"""Text in, text out: prompts through a decoding strategy in fixed-shape batches.

Prompts use T5's span-infilling syntax (``<extra_id_0>`` marks a span to
fill), and get EOS appended as in training. Every batch has the same shape
(the last one padded with empty prompts), so the decoding program compiles
once per run.

What a prompt may cost is bounded before any decoding: without an explicit
encoder length a prompt may have at most ``DEFAULT_MAX_INPUTS_LENGTH`` tokens
(T5's pretraining input length), and ``check_attention_memory`` refuses an
encoder length whose attention scores alone cannot fit in memory. A
non-finite score (NaN logits) is an error, never a result.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Iterator, Sequence

import jax
import numpy as np
from tqdm import tqdm

from qmoe_jax.data.tokenizer import EOS_ID, Tokenizer
from qmoe_jax.inference.strategies import DecodingConfig, generate
from qmoe_jax.models import SwitchConfig

DEFAULT_MAX_INPUTS_LENGTH = 512  # T5's and Switch's pretraining input length
ATTENTION_SCORE_BYTES = 4  # float32 logits of the encoder's self-attention


@dataclasses.dataclass(frozen=True)
class Generated:
    inputs: str
    text: str
    tokens: list[int]
    score: float


def encode_prompts(
    tokenizer: Tokenizer, prompts: Sequence[str], inputs_length: int | None
) -> np.ndarray:
    """``int32[len(prompts), inputs_length]`` prompt tokens with EOS, padded with 0.

    inputs_length None: the longest prompt rounded up to a multiple of 8, which may be at most
    ``DEFAULT_MAX_INPUTS_LENGTH``; a longer prompt is refused before anything is decoded.
    """
    for number, prompt in enumerate(prompts, 1):
        if not prompt.strip():
            raise ValueError(
                f"prompt {number} is empty; give the text to continue, e.g. "
                '"The <extra_id_0> walks in the park."'
            )
    encoded = [tokenizer.encode_with_sentinels(prompt) + [EOS_ID] for prompt in prompts]
    longest = max(len(ids) for ids in encoded)
    explicit = inputs_length is not None
    if not explicit:
        inputs_length = -(-longest // 8) * 8
    bound = inputs_length if explicit else DEFAULT_MAX_INPUTS_LENGTH
    for prompt, ids in zip(prompts, encoded):
        if len(ids) > bound:
            which = "encoder length" if explicit else "default bound (T5's pretraining length)"
            raise ValueError(
                f"the prompt {prompt[:60]!r} has {len(ids)} tokens with EOS, more than the {which} "
                f"{bound}; shorten it, or raise the bound with --inputs_length "
                f"{-(-len(ids) // 8) * 8} (the encoder's memory grows with batch size × length²)"
            )
    out = np.zeros((len(prompts), inputs_length), np.int32)
    for row, ids in enumerate(encoded):
        out[row, : len(ids)] = ids
    return out


def available_memory_bytes() -> int | None:
    """Memory this process's first device may still use: its allocator's free bytes on an
    accelerator, the host's available memory on CPU; None when neither is known. (A device of
    another process of a multi-process run has no memory statistics here.)"""
    stats = jax.local_devices()[0].memory_stats() or {}
    if "bytes_limit" in stats:
        return int(stats["bytes_limit"] - stats.get("bytes_in_use", 0))
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        pages = os.sysconf("SC_AVPHYS_PAGES") if hasattr(os, "sysconf") else -1
        return pages * os.sysconf("SC_PAGE_SIZE") if pages > 0 else None


def attention_bytes(config: SwitchConfig, batch_size: int, inputs_length: int) -> int:
    """Bytes of one encoder layer's self-attention scores for a batch: a lower bound on what
    decoding that batch needs at once."""
    return batch_size * config.num_heads * inputs_length**2 * ATTENTION_SCORE_BYTES


def check_attention_memory(
    config: SwitchConfig, batch_size: int, inputs_length: int, available: int | None = None
) -> None:
    """Raises ``ValueError`` when the attention scores of one batch alone exceed the memory the
    device has (``available_memory_bytes``), before any decoding starts."""
    available = available_memory_bytes() if available is None else available
    needed = attention_bytes(config, batch_size, inputs_length)
    if available is not None and needed > available:
        raise ValueError(
            f"decoding batches of {batch_size} prompts of {inputs_length} tokens needs at least "
            f"{needed / 2**30:.1f} GiB for the encoder's attention scores alone (batch × "
            f"{config.num_heads} heads × length² × {ATTENTION_SCORE_BYTES} bytes), more than the "
            f"{available / 2**30:.1f} GiB available; lower --batch_size or --inputs_length"
        )


def generate_texts(
    model,
    params,
    tokenizer: Tokenizer,
    prompts: Sequence[str],
    config: DecodingConfig,
    batch_size: int = 8,
    inputs_length: int | None = None,
    seed: int = 0,
    progress: bool = False,
) -> Iterator[Generated]:
    """Yields one ``Generated`` per prompt, in order, decoding ``batch_size`` prompts at a time."""
    if not prompts:
        raise ValueError("no prompts to generate from")
    tokens = encode_prompts(tokenizer, prompts, inputs_length)
    yield from generate_encoded(
        model, params, tokenizer, prompts, tokens, config, batch_size, seed, progress
    )


def generate_encoded(
    model,
    params,
    tokenizer: Tokenizer,
    prompts: Sequence[str],
    tokens: np.ndarray,
    config: DecodingConfig,
    batch_size: int = 8,
    seed: int = 0,
    progress: bool = False,
) -> Iterator[Generated]:
    """``generate_texts`` of prompts already encoded (``encode_prompts``); a non-finite score is a
    ``ValueError`` naming the prompt."""
    for prompt, (ids, score) in zip(
        prompts, generate_tokens(model, params, tokens, config, batch_size, seed, progress)
    ):
        if not math.isfinite(score):
            raise ValueError(
                f"the model's score for the prompt {prompt[:60]!r} is {score}: its parameters hold "
                "NaN or infinite values, or its activations overflow, so nothing it generates "
                "means anything; check the checkpoint (python -m qmoe_jax.evaluate reports the "
                "same as a non-finite loss)"
            )
        yield Generated(prompt, tokenizer.decode(ids), ids, score)


def generate_tokens(
    model,
    params,
    tokens: np.ndarray,
    config: DecodingConfig,
    batch_size: int = 8,
    seed: int = 0,
    progress: bool = False,
) -> Iterator[tuple[list[int], float]]:
    """Decodes ``tokens int32[N, L_enc]`` (prompts with EOS, padded with 0) ``batch_size`` rows at a
    time.

    Yields (generated ids up to and including EOS, score) per row, in order.
    """
    starts = range(0, len(tokens), batch_size)
    if progress:
        starts = tqdm(starts, desc="generate", unit="batch")
    rng = jax.random.PRNGKey(seed)
    for index, start in enumerate(starts):
        batch = tokens[start : start + batch_size]
        filled = np.zeros((batch_size, tokens.shape[1]), np.int32)
        filled[: len(batch)] = batch
        decoded = generate(model, params, filled, config, jax.random.fold_in(rng, index))
        out_tokens, scores = jax.device_get((decoded.tokens, decoded.scores))
        for row in range(len(batch)):
            ids = [int(t) for t in out_tokens[row]]
            ids = ids[: ids.index(EOS_ID) + 1] if EOS_ID in ids else [t for t in ids if t]
            yield ids, float(scores[row])
