"""Compress a SwitchTransformer checkpoint to sub-1-bit experts (the main job).

    python -m qmoe_jax.compress                       # the bundled model, bundled calibration text
    python -m qmoe_jax.compress --checkpoint \\
        gs://t5-data/pretrained_models/t5x/moe/switch_classic/base/e128/checkpoint_611800 \\
        --tokenizer sentencepiece.model --calibration c4:/data/c4/en --num_samples 10000 \\
        --inputs_length 512 --output_dir /data/switch-base-128-ternary

Re-running the same command after an interruption resumes at the first
unfinished layer; the result is bit-identical to an uninterrupted run.
docs/recovery.md says what is refused, what resumes and what is repaired.
Several processes (one per host) share a run through JAX's multi-process
runtime, with the same output as one: docs/multihost.md.
"""

from __future__ import annotations

import argparse
import sys

from qmoe_jax import malloc

if __name__ == "__main__":  # before jax is imported: an exec here wastes no start-up work
    malloc.reexec_with_huge_pages("qmoe_jax.compress")  # big XLA buffers without 4 KiB page faults
malloc.limit_arenas()
try:
    malloc.fix_mmap_threshold()  # freed XLA buffers leave the resident set
except ValueError as error:
    raise SystemExit(f"python -m qmoe_jax.compress: {error}") from None

# Imported after the malloc set-up above, which must run before jax loads (E402).
from qmoe_jax.checkpoints.nonfinite import POLICIES  # noqa: E402
from qmoe_jax.cli import add_debug_flag, finite_float, run_cli  # noqa: E402
from qmoe_jax.compression.job import compress_checkpoint  # noqa: E402
from qmoe_jax.compression.options import GRIDS, VERIFY_LEVELS, CompressionOptions  # noqa: E402
from qmoe_jax.data import PREMASKS  # noqa: E402
from qmoe_jax.distributed import runtime as distributed_runtime  # noqa: E402


def parse_options(argv=None) -> CompressionOptions:
    defaults = CompressionOptions()
    parser = argparse.ArgumentParser(
        prog="python -m qmoe_jax.compress",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--checkpoint", help="T5X checkpoint_<step> directory or URL (default: the bundled model)"
    )
    parser.add_argument(
        "--config",
        help="model config name, e.g. switch-base-128, or a JSON file of SwitchConfig fields "
        "(default: inferred from the checkpoint's shapes)",
    )
    parser.add_argument("--tokenizer", help="SentencePiece model (default: the bundled model's)")
    parser.add_argument(
        "--calibration",
        default=defaults.calibration,
        help="'bundled', 'c4:<dir or glob of c4-train.*.json.gz>', or 'text:<glob of .txt files>'",
    )
    parser.add_argument(
        "--num_samples", type=int, default=defaults.num_samples, help="calibration samples"
    )
    parser.add_argument(
        "--inputs_length",
        type=int,
        default=defaults.inputs_length,
        help="encoder tokens per sample after span corruption (T5: 512)",
    )
    parser.add_argument("--grid", choices=list(GRIDS), default=defaults.grid)
    parser.add_argument("--method", choices=["gptq", "rtn"], default=defaults.method)
    parser.add_argument(
        "--group_size", type=int, default=defaults.group_size, help="experts per vmapped GPTQ call"
    )
    parser.add_argument(
        "--dictionary",
        choices=["static", "adaptive"],
        default=defaults.dictionary,
        help="static: QMoE's p0=0.885 dictionary; adaptive: per-layer dictionaries",
    )
    parser.add_argument(
        "--batch_size", type=int, default=defaults.batch_size, help="samples per dense batch"
    )
    parser.add_argument(
        "--true_sequential", action="store_true", help="wo's Hessian from quantized wi activations"
    )
    parser.add_argument(
        "--act_order", action="store_true", help="GPTQ column order by descending Hessian diagonal"
    )
    parser.add_argument(
        "--damping",
        type=finite_float,
        default=defaults.damping,
        help="GPTQ damping, as a fraction of mean diag(H) (QMoE: 0.1; GPTQ: 0.01)",
    )
    parser.add_argument(
        "--premask",
        choices=list(PREMASKS),
        default=defaults.premask,
        help="token positions kept out of the Hessians: encoder sentinels (encoder), also decoder "
        "positions that predict a sentinel (encoder_decoder, QMoE's mask), or none",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=defaults.seed,
        help="span-corruption seed of the calibration data",
    )
    parser.add_argument("--output_dir", help="output directory (default: runs/compressed/<config>)")
    parser.add_argument(
        "--gptq_memory_mb",
        type=int,
        help="memory per vmapped GPTQ call (Hessians, weights, working copies); a group that "
        "needs more is split into several calls (default: 1/4 of accelerator memory, 256 on CPU)",
    )
    parser.add_argument(
        "--eval_examples",
        type=int,
        help="held-out validation examples on which the original and the compressed model are "
        "scored at the end (default: 256 for the bundled model, off for others; 0 = off)",
    )
    parser.add_argument(
        "--eval_data",
        help="validation text: 'bundled' or 'c4:<dir or glob>' (default: follows --calibration)",
    )
    parser.add_argument(
        "--nonfinite",
        choices=POLICIES,
        default=defaults.nonfinite,
        help="NaN or inf in a source array: stop with an error naming it (error), or set those "
        "values to 0 and count them in report.json (zero)",
    )
    parser.add_argument(
        "--verify",
        choices=VERIFY_LEVELS,
        default=defaults.verify,
        help="on resume: check the finished parts' files and sizes, dense/ and the dictionaries by "
        "checksum, and the source's files by size, mtime and inode (quick); or also every layer's "
        "checksums, and read the whole source once, comparing what the finished parts were made "
        "from by SHA-256 (full; resumes from a copy of the source)",
    )
    add_debug_flag(parser)
    distributed_runtime.add_flags(parser)
    args = vars(parser.parse_args(argv))
    del args["debug"]  # run_cli reads it
    try:
        return CompressionOptions(**args)
    except ValueError as error:
        parser.error(str(error))


def compress(argv: list[str]) -> None:
    options = parse_options(argv)
    log = distributed_runtime.lead_only(lambda line: print(line, flush=True))
    log("==== qmoe_jax.compress " + "=" * 50)
    compress_checkpoint(options, log=log, progress=sys.stderr.isatty())


def main(argv=None) -> None:
    run_cli(compress, argv)


if __name__ == "__main__":
    main()
