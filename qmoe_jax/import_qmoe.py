"""Import a published QMoE model (the authors' compressed format) without recompressing it.

    git clone https://huggingface.co/ISTA-DASLab/switch-base-128_qmoe   # needs git-lfs
    python -m qmoe_jax.import_qmoe switch-base-128_qmoe --output_dir runs/imported/switch-base-128
    python -m qmoe_jax.evaluate --checkpoint runs/imported/switch-base-128

The code streams are copied bit for bit (our format v1 uses the authors'
dictionary); one expNN.pt is read at a time. Re-running the same command
after an interruption resumes after the last imported layer.
docs/qmoe_import.md describes the authors' layout and what is checked.
"""

from __future__ import annotations

import argparse
import sys

from qmoe_jax.cli import add_debug_flag, run_cli
from qmoe_jax.interop.qmoe_import import VERIFY_LEVELS, import_qmoe


def _import(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m qmoe_jax.import_qmoe",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "source", help="a downloaded *_qmoe directory (config.json, noexp.pt, sizes.pt, exp*.pt)"
    )
    parser.add_argument(
        "--output_dir", help="compressed checkpoint to write (default: runs/imported/<config>)"
    )
    parser.add_argument(
        "--verify",
        choices=VERIFY_LEVELS,
        default="quick",
        help="on resume, check the imported parts' files and sizes (quick) or also every checksum "
        "and every imported layer's source SHA-256 (full)",
    )
    add_debug_flag(parser)
    args = parser.parse_args(argv)
    print("==== qmoe_jax.import_qmoe " + "=" * 47, flush=True)
    import_qmoe(
        args.source,
        args.output_dir,
        args.verify,
        log=lambda line: print(line, flush=True),
        progress=sys.stderr.isatty(),
    )


def main(argv=None) -> None:
    run_cli(_import, argv)


if __name__ == "__main__":
    main()
