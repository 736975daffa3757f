"""Text in, text out: prompts through a decoding strategy in fixed-shape batches.

Prompts use T5's span-infilling syntax (``<extra_id_0>`` marks a span to
fill), and get EOS appended as in training. Every batch has the same shape
(the last one padded with empty prompts), so the decoding program compiles
once per run.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence

import jax
import numpy as np
from tqdm import tqdm

from qmoe_jax.data.tokenizer import EOS_ID, Tokenizer
from qmoe_jax.inference.strategies import DecodingConfig, generate


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

    inputs_length None: the longest prompt rounded up to a multiple of 8.
    """
    encoded = [tokenizer.encode_with_sentinels(prompt) + [EOS_ID] for prompt in prompts]
    longest = max(len(ids) for ids in encoded)
    if inputs_length is None:
        inputs_length = -(-longest // 8) * 8
    for prompt, ids in zip(prompts, encoded):
        if len(ids) > inputs_length:
            raise ValueError(
                f"the prompt {prompt[:60]!r} has {len(ids)} tokens with EOS, more than the encoder "
                f"length {inputs_length}; shorten it or raise --inputs_length"
            )
    out = np.zeros((len(prompts), inputs_length), np.int32)
    for row, ids in enumerate(encoded):
        out[row, : len(ids)] = ids
    return out


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
    for prompt, (ids, score) in zip(
        prompts, generate_tokens(model, params, tokens, config, batch_size, seed, progress)
    ):
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
