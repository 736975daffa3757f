"""Convert a compressed checkpoint to the memory-mapped layout (one time), for larger-than-RAM
inference.

    python -m qmoe_jax.convert --layout mmap --checkpoint runs/compressed/switch-mini-8 \\
        --output_dir runs/mapped/switch-mini-8
    python -m qmoe_jax.generate --checkpoint runs/mapped/switch-mini-8 --experts mapped \\
        --prompt "..."

The output holds the same dense parameters and dictionaries, and each sparse
layer's expert stacks as one raw file of page-aligned arrays that inference
maps instead of loading (docs/format.md §9). Every layer is verified against
its checksums while it is read.
"""

from __future__ import annotations

import argparse
import sys

from tqdm import tqdm

from qmoe_jax.checkpoints.mapped_layout import MAPPED_OUTPUT
from qmoe_jax.checkpoints.output_dir import claimed
from qmoe_jax.checkpoints.to_mapped import convert_to_mapped
from qmoe_jax.cli import add_debug_flag, run_cli

LAYOUTS = ("mmap",)


def convert(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m qmoe_jax.convert",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--checkpoint",
        required=True,
        help="a finished directory written by python -m qmoe_jax.compress",
    )
    parser.add_argument(
        "--output_dir", required=True, help="where the mapped checkpoint goes (new or empty)"
    )
    parser.add_argument(
        "--layout",
        choices=LAYOUTS,
        default="mmap",
        help="the target layout (mmap: raw page-aligned arrays)",
    )
    add_debug_flag(parser)
    args = parser.parse_args(argv)
    with (
        claimed(args.output_dir, MAPPED_OUTPUT) as directory,
        tqdm(desc="convert", unit="B", unit_scale=True, disable=not sys.stderr.isatty()) as bar,
    ):
        convert_to_mapped(
            args.checkpoint,
            directory,
            log=lambda line: tqdm.write(line, file=sys.stderr),
            progress=bar.update,
        )
    print(
        f"wrote {directory}; generate with: python -m qmoe_jax.generate --checkpoint {directory} "
        "--experts mapped --prompt ...",
        file=sys.stderr,
    )


def main(argv=None) -> None:
    run_cli(convert, argv)


if __name__ == "__main__":
    main()
