"""Fine-tune a compressed (or T5X) Switch model: frozen sub-1-bit experts, trainable dense parts,
expert LoRA.

    python -m qmoe_jax.finetune --checkpoint runs/compressed/switch-mini-8 --task name_the_work \\
        --output_dir runs/finetune/switch-mini-8
    python -m qmoe_jax.finetune --checkpoint runs/compressed/switch-mini-8 --task span_corruption \\
        --expert_lora_rank 8 --output_dir runs/repair
    python -m qmoe_jax.evaluate --checkpoint runs/finetune/switch-mini-8/model

Tasks: span_corruption[:bundled|c4:<dir>|text:<glob>], jsonl:<train>[,<validation>], name_the_work
(the bundled corpus: given a passage, name the work). Re-running the same command after an
interruption (even kill -9) resumes from the last checkpoint; other settings are refused.
The run directory gets metrics.jsonl, metrics.png, train_state/ and model/: a compressed
checkpoint for a compressed input, a T5X checkpoint for a T5X one (docs/format.md §8.9, §11).
Several processes (one per host) train data-parallel as one run: docs/multihost.md.
"""

from __future__ import annotations

import argparse
import sys

from qmoe_jax.checkpoints import strict_json
from qmoe_jax.cli import add_debug_flag, finite_float, run_cli
from qmoe_jax.distributed import runtime as distributed_runtime
from qmoe_jax.training import FinetuneOptions, finetune
from qmoe_jax.training.finetuning import ACTIVATIONS, OPTIMIZERS

DEFAULTS = FinetuneOptions()


def parse_options(argv: list[str]) -> FinetuneOptions:
    parser = argparse.ArgumentParser(
        prog="python -m qmoe_jax.finetune",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--checkpoint", help="compressed directory or T5X checkpoint (default: the bundled model)"
    )
    parser.add_argument(
        "--config", help="model config name of a T5X checkpoint (default: inferred)"
    )
    parser.add_argument("--tokenizer", help="SentencePiece model (default: the bundled model's)")
    parser.add_argument("--task", default=DEFAULTS.task)
    parser.add_argument("--output_dir", required=True)
    parser.add_argument(
        "--experts",
        choices=["compressed", "dense"],
        default=DEFAULTS.experts,
        help="a compressed checkpoint's frozen experts: fused kernels, "
        "or dequantized (the control)",
    )
    parser.add_argument(
        "--trainable",
        help="comma-separated regular expressions of parameter paths to train "
        "(default: everything but the experts); expert adapters always train",
    )
    parser.add_argument(
        "--expert_lora_rank", type=int, default=0, help="LoRA rank on every expert (0: off)"
    )
    parser.add_argument("--warmup_steps", type=int, help="default: a tenth of --steps")
    for name in (
        "steps",
        "batch_size",
        "accumulate",
        "inputs_length",
        "eval_examples",
        "seed",
        "eval_every",
        "checkpoint_every",
    ):
        parser.add_argument(f"--{name}", type=int, default=getattr(DEFAULTS, name))
    for name in ("learning_rate", "final_learning_rate_fraction", "weight_decay", "clip_norm"):
        parser.add_argument(f"--{name}", type=finite_float, default=getattr(DEFAULTS, name))
    parser.add_argument("--dropout_rate", type=finite_float, help="default: the model config's")
    parser.add_argument("--activations", choices=ACTIVATIONS, default=DEFAULTS.activations)
    parser.add_argument(
        "--optimizer",
        choices=OPTIMIZERS,
        default=DEFAULTS.optimizer,
        help="adamw, or adafactor (T5X's fine-tuning optimizer; a state a small fraction of "
        "adamw's)",
    )
    add_debug_flag(parser)
    distributed_runtime.add_flags(parser)
    args = vars(parser.parse_args(argv))
    args.pop("debug")
    if args["trainable"] is not None:
        args["trainable"] = tuple(p.strip() for p in args["trainable"].split(",") if p.strip())
    return FinetuneOptions(**args)


def main_(argv: list[str]) -> None:
    summary = finetune(
        parse_options(argv),
        log=lambda line: print(line, file=sys.stderr, flush=True),
        progress=sys.stderr.isatty(),
    )
    distributed_runtime.lead_only(print)(strict_json.dumps(summary, what="the fine-tuning summary"))


def main(argv=None) -> None:
    run_cli(main_, argv)


if __name__ == "__main__":
    main()
