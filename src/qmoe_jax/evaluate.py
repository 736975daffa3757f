"""Span-corruption validation loss, the paper's quality metric.

The loss is teacher-forced and length-weighted: the sum of token
cross-entropies (nats) over all target tokens of N validation examples,
divided by the number of target tokens. Examples are batched in a fixed
order with a fixed batch size (the last batch padded with empty examples), so
MoE routing groups, and with them the result, are reproducible.

    python -m qmoe_jax.evaluate                     # the bundled model
    python -m qmoe_jax.evaluate --checkpoint gs://.../checkpoint_500100 --config switch-base-8 \
        --tokenizer cc_all.32000/sentencepiece.model --c4 /data/c4/en --num_samples 1000
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from qmoe_jax import bundled
from qmoe_jax.checkpoints import open_t5x_checkpoint
from qmoe_jax.data import SpanCorruptionConfig, Tokenizer, batch_examples, c4_documents, corpus
from qmoe_jax.data import span_corruption_examples
from qmoe_jax.models import SwitchConfig, SwitchTransformer, get_config
from qmoe_jax.training import evaluate_batches, make_eval_step

Example = tuple[np.ndarray, np.ndarray]


def validation_examples(documents, tokenizer: Tokenizer, config: SpanCorruptionConfig,
                        num_samples: int | None = None) -> list[Example]:
    """The first ``num_samples`` span-corruption examples of ``documents`` (all if None)."""
    examples = span_corruption_examples(documents, tokenizer, config)
    return list(itertools.islice(examples, num_samples))


def bundled_validation_examples(tokenizer: Tokenizer, num_samples: int | None = None) -> list[Example]:
    """Examples of the bundled corpus's validation split (seed 0, inputs length 128)."""
    return validation_examples(corpus.documents("validation"), tokenizer, bundled.span_corruption_config(), num_samples)


def padded_batches(examples: list[Example], batch_size: int, encoder_length: int,
                   decoder_length: int) -> list[dict[str, np.ndarray]]:
    """Fixed-size batches in order; the last one is filled with empty examples (zero loss weight)."""
    empty = (np.zeros(0, np.int32), np.zeros(0, np.int32))
    batches = []
    for start in range(0, len(examples), batch_size):
        chunk = examples[start : start + batch_size]
        chunk = chunk + [empty] * (batch_size - len(chunk))
        batches.append(batch_examples(chunk, encoder_length, decoder_length))
    return batches


def mean_cross_entropy(model, params, examples: list[Example], batch_size: int = 32,
                       encoder_length: int | None = None, decoder_length: int | None = None,
                       progress: bool = False) -> float:
    """Length-weighted mean cross-entropy (nats per target token) of ``model`` on ``examples``.

    Lengths default to the longest example, rounded up to a multiple of 8.
    """
    if not examples:
        raise ValueError("no validation examples to evaluate")
    round_up = lambda n: -(-n // 8) * 8  # noqa: E731
    encoder_length = encoder_length or round_up(max(i.size for i, _ in examples))
    decoder_length = decoder_length or round_up(max(t.size for _, t in examples))
    batches = padded_batches(examples, batch_size, encoder_length, decoder_length)
    if progress:
        batches = tqdm(batches, desc="evaluate", unit="batch")
    return evaluate_batches(make_eval_step(model), params, batches)


def load_t5x_params(path: str, config: SwitchConfig, dtype=jnp.float32) -> dict:
    """All parameters of a T5X checkpoint, shape-checked against ``config``, cast to ``dtype``."""
    checkpoint = open_t5x_checkpoint(path)
    checkpoint.check_shapes(expected_param_shapes(config), config_name=config.name)
    params = checkpoint.read_params(checkpoint.keys())
    return jax.tree_util.tree_map(lambda x: jnp.asarray(x, dtype), params)


def expected_param_shapes(config: SwitchConfig) -> dict[str, tuple[int, ...]]:
    """``{'encoder/layers_0/...': shape}`` of the model built from ``config``, without allocating."""
    model = SwitchTransformer(config)
    tokens = jax.ShapeDtypeStruct((1, 8), jnp.int32)
    shapes = jax.eval_shape(lambda t: model.init(jax.random.PRNGKey(0), t, t, t)["params"], tokens)
    flat = jax.tree_util.tree_flatten_with_path(shapes)[0]
    return {"/".join(key.key for key in path): leaf.shape for path, leaf in flat}


def evaluate_checkpoint(path: str, config: SwitchConfig, tokenizer: Tokenizer,
                        examples: list[Example] | None = None, batch_size: int = 32) -> float:
    """Validation loss of a T5X checkpoint (default examples: the bundled validation split)."""
    params = load_t5x_params(path, config)
    if examples is None:
        examples = bundled_validation_examples(tokenizer)
    return mean_cross_entropy(SwitchTransformer(config), params, examples, batch_size,
                              bundled.INPUTS_LENGTH, bundled.DECODER_LENGTH)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", help="T5X checkpoint_<step> directory or URL (default: the bundled model)")
    parser.add_argument("--config", default=bundled.CONFIG_NAME, help="model config name")
    parser.add_argument("--tokenizer", help="SentencePiece model (default: the bundled model's)")
    parser.add_argument("--c4", help="C4 directory or glob (default: the bundled corpus's validation split)")
    parser.add_argument("--num_samples", type=int, default=None, help="validation examples (default: all)")
    parser.add_argument("--inputs_length", type=int, default=bundled.INPUTS_LENGTH)
    parser.add_argument("--batch_size", type=int, default=32)
    args = parser.parse_args(argv)

    config = get_config(args.config)
    tokenizer = Tokenizer(args.tokenizer or bundled.tokenizer_path())
    path = args.checkpoint or bundled.checkpoint_path()
    data_config = SpanCorruptionConfig(inputs_length=args.inputs_length)
    if args.c4:
        data_config = SpanCorruptionConfig(inputs_length=args.inputs_length, packing="document")
        documents = c4_documents(args.c4, split="validation")
    else:
        documents = corpus.documents("validation")
    examples = validation_examples(documents, tokenizer, data_config, args.num_samples)
    params = load_t5x_params(path, config)
    loss = mean_cross_entropy(SwitchTransformer(config), params, examples, args.batch_size,
                              args.inputs_length, data_config.lengths[1] + (-data_config.lengths[1]) % 8,
                              progress=sys.stderr.isatty())
    print(json.dumps({"checkpoint": path, "config": config.name, "examples": len(examples),
                      "validation_loss": round(loss, 6), "uniform_loss": round(float(np.log(tokenizer.vocab_size)), 6)}))


if __name__ == "__main__":
    main()
