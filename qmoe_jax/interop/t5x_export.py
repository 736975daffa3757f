"""Dequantized export of a compressed checkpoint to a T5X checkpoint that stock T5X and flaxformer
restore.

The expert kernels are decoded and dequantized (ternary: each weight is 0, its
row's min or its row's max, exact in bfloat16) into T5X's ``expert/<kernel>/kernel
[E, in, out]``; every parameter is stored in bfloat16. The export is therefore
as large as the uncompressed model in bfloat16 (2 bytes per parameter).

Layout of ``output_dir`` (the output rules of ``checkpoints/output_dir.py``):
``manifest.json`` (marker ``"qmoe_jax.t5x_export"``, the source, the step,
the format) and ``checkpoint_<step>/``, legacy (msgpack + zarr) or Orbax, as
``checkpoints.write_t5x_checkpoint`` writes them. The step is the compressed
checkpoint's (``interop.steps.checkpoint_step``).
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np

from qmoe_jax.checkpoints import strict_json, write_t5x_checkpoint
from qmoe_jax.checkpoints.output_dir import MANIFEST, OutputKind, claimed
from qmoe_jax.checkpoints.writer import FORMATS
from qmoe_jax.inference.compressed_params import load_compressed_model
from qmoe_jax.inference.loading import is_compressed_checkpoint
from qmoe_jax.interop.steps import checkpoint_step

EXPORT_OUTPUT = OutputKind("qmoe_jax.t5x_export", "a qmoe_jax T5X export")


def export_t5x(checkpoint: str, output_dir: str, format: str = "legacy", log=print) -> str:
    """Writes ``output_dir/checkpoint_<step>/`` from the compressed directory ``checkpoint``;
    returns its path."""
    if format not in FORMATS:
        raise ValueError(f"--format must be one of {', '.join(FORMATS)}, got {format!r}")
    if not is_compressed_checkpoint(checkpoint):
        raise ValueError(
            f"{checkpoint} is not a directory written by python -m qmoe_jax.compress (it has no "
            f"{MANIFEST}); a T5X checkpoint needs no export"
        )
    step = checkpoint_step(checkpoint)
    with claimed(output_dir, EXPORT_OUTPUT) as directory:
        target = os.path.join(directory, f"checkpoint_{step}")
        if os.path.exists(target):
            raise ValueError(
                f"{target} already exists; delete it to export again, or choose another "
                "--output_dir"
            )
        log(f"reading and dequantizing {checkpoint} (step {step})")
        model = load_compressed_model(checkpoint, experts="dense", dtype=jnp.bfloat16)
        params = jax.tree.map(np.asarray, model.params)
        manifest = {
            "format": EXPORT_OUTPUT.marker,
            "format_version": 1,
            "source": os.path.abspath(checkpoint),
            "step": step,
            "t5x_format": format,
            "dtype": "bfloat16",
            "config": model.config.to_dict(),
        }
        with open(os.path.join(directory, MANIFEST + ".tmp"), "w") as f:
            strict_json.dump(manifest, f, what=MANIFEST, indent=1, sort_keys=True)
        os.replace(os.path.join(directory, MANIFEST + ".tmp"), os.path.join(directory, MANIFEST))
        log(f"writing {target} ({format}, bfloat16)")
        written = write_t5x_checkpoint(directory, params, step, format=format, dtype="bfloat16")
    return written
