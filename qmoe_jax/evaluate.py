"""Span-corruption validation loss of a T5X or compressed checkpoint, the paper's quality metric.

    python -m qmoe_jax.evaluate                     # the bundled model on its held-out plays
    python -m qmoe_jax.evaluate --checkpoint runs/compressed/switch-mini-8  # the main job's output
    python -m qmoe_jax.evaluate --checkpoint gs://.../checkpoint_500100 --config switch-base-8 \\
        --tokenizer cc_all.32000/sentencepiece.model --c4 /data/c4/en --num_samples 1000

With ``--gin_file`` it runs gin-driven, as ``t5x.eval`` does (docs/gin.md):

    python -m qmoe_jax.evaluate --gin_file=runs/eval.gin --gin_file=models/switch_mini_8.gin \\
        --gin.CHECKPOINT_PATH="'runs/compressed/switch-mini-8'" \\
        --gin.EVAL_OUTPUT_DIR="'runs/eval'" --gin.MIXTURE_OR_TASK_NAME="'bundled_span_corruption'"

Without it, it prints one JSON line: the loss (nats per target token, length-weighted), the
number of examples, the uniform predictor's loss for scale, target tokens per
second and wall seconds of the evaluation (compilation included), and the
process's peak resident memory. Across several processes (docs/multihost.md) the
experts are sharded over every process's devices and process 0 prints the line.
"""

from __future__ import annotations

import argparse
import math
import resource
import sys
import time

import numpy as np

from qmoe_jax.checkpoints import strict_json
from qmoe_jax.cli import add_debug_flag, run_cli
from qmoe_jax.data import Tokenizer, bundled
from qmoe_jax.distributed import runtime as distributed_runtime
from qmoe_jax.inference import (
    add_model_arguments,
    mean_cross_entropy,
    open_model_from_args,
    validation_set,
)
from qmoe_jax.interop.gin_flags import uses_gin


def evaluate(argv: list[str]) -> None:
    if uses_gin(argv):
        from qmoe_jax.interop.gin_eval import evaluate_with_gin  # imports gin only in gin mode

        evaluate_with_gin(argv)
        return
    gin_flags = [
        arg for arg in argv if arg.startswith(("--gin.", "--gin_bindings", "--gin_search_paths"))
    ]
    if gin_flags:
        raise ValueError(
            f"{gin_flags[0].split('=')[0]} needs --gin_file (e.g. --gin_file=runs/eval.gin "
            "--gin_file=models/switch_mini_8.gin)"
        )
    parser = argparse.ArgumentParser(
        prog="python -m qmoe_jax.evaluate",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_model_arguments(parser)
    parser.add_argument(
        "--c4", help="C4 directory or glob (default: the bundled corpus's validation split)"
    )
    parser.add_argument(
        "--num_samples", type=int, default=None, help="validation examples (default: all)"
    )
    parser.add_argument("--inputs_length", type=int, default=bundled.INPUTS_LENGTH)
    parser.add_argument("--batch_size", type=int, default=32)
    add_debug_flag(parser)
    distributed_runtime.add_flags(parser)
    args = parser.parse_args(argv)
    for flag in ("num_samples", "batch_size", "inputs_length"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            parser.error(f"--{flag} must be at least 1, got {getattr(args, flag)}")

    tokenizer = Tokenizer(args.tokenizer or bundled.tokenizer_path())
    path = args.checkpoint or bundled.checkpoint_path()
    validation = validation_set(
        f"c4:{args.c4}" if args.c4 else "bundled", tokenizer, args.num_samples, args.inputs_length
    )
    model = open_model_from_args(args)
    started = time.perf_counter()
    loss = mean_cross_entropy(
        model.module,
        model.params,
        validation.examples,
        args.batch_size,
        validation.encoder_length,
        validation.decoder_length,
        progress=sys.stderr.isatty() and distributed_runtime.is_lead(),
    )
    seconds = time.perf_counter() - started
    if not math.isfinite(loss):
        raise ValueError(
            f"the validation loss of {path} is {loss}: the model's parameters hold NaN or infinite "
            "values, or its activations overflow; check the checkpoint (python -m "
            "qmoe_jax.compress "
            "names every non-finite array)"
        )
    target_tokens = sum(len(targets) for _, targets in validation.examples)
    distributed_runtime.lead_only(print)(
        strict_json.dumps(
            {
                "checkpoint": path,
                "config": model.config.name,
                "experts": model.experts,
                "dense_dtype": args.dense_dtype,
                "examples": len(validation.examples),
                "validation_loss": round(loss, 6),
                "uniform_loss": round(float(np.log(tokenizer.vocab_size)), 6),
                "target_tokens_per_second": round(target_tokens / seconds, 1),
                "seconds": round(seconds, 2),
                "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
            }
        )
    )


def main(argv=None) -> None:
    run_cli(evaluate, argv)


if __name__ == "__main__":
    main()
