"""Export a compressed checkpoint as a dequantized bfloat16 T5X checkpoint, for stock T5X and
flaxformer.

    python -m qmoe_jax.export --checkpoint runs/compressed/switch-mini-8 \\
        --output_dir runs/t5x/switch-mini-8
    python -m qmoe_jax.export --checkpoint ... --output_dir ... --format orbax

The export is full bfloat16 size (2 bytes per parameter, experts included):
it suits quality evaluation with t5x.eval, not switch-c-2048 on one machine;
evaluate compressed models on the fused kernels with python -m qmoe_jax.evaluate.
qmoe_jax/configs/t5x/ holds gin files for t5x.eval on an export.
"""

from __future__ import annotations

import argparse
import sys

from qmoe_jax.checkpoints.writer import FORMATS
from qmoe_jax.cli import add_debug_flag, run_cli
from qmoe_jax.interop.t5x_export import export_t5x


def export(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m qmoe_jax.export",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--checkpoint", required=True, help="a directory written by python -m qmoe_jax.compress"
    )
    parser.add_argument(
        "--output_dir",
        required=True,
        help="new or empty directory (or one this command exported to); gets checkpoint_<step>/",
    )
    parser.add_argument(
        "--format",
        choices=FORMATS,
        default="legacy",
        help="legacy (msgpack + zarr, what released Switch checkpoints use) or orbax (OCDBT)",
    )
    add_debug_flag(parser)
    args = parser.parse_args(argv)
    written = export_t5x(
        args.checkpoint, args.output_dir, args.format, log=lambda m: print(m, file=sys.stderr)
    )
    print(written)


def main(argv=None) -> None:
    run_cli(export, argv)


if __name__ == "__main__":
    main()
