"""The training step of a checkpoint, which T5X's evaluation output is keyed by."""

from __future__ import annotations

import re

from qmoe_jax.checkpoints import open_t5x_checkpoint
from qmoe_jax.checkpoints.format_v1 import CompressedCheckpoint
from qmoe_jax.inference.loading import is_compressed_checkpoint

_STEP_DIR = re.compile(r"checkpoint_(\d+)/*$")


def checkpoint_step(path: str) -> int:
    """The training step an evaluation is logged at.

    Compressed directories: the ``checkpoint_<step>`` their source was (the
    manifest's ``header.source``), else the config's ``checkpoint_step``, else
    0. T5X checkpoints: the stored ``state/step``, else the directory name, else 0.
    """
    if is_compressed_checkpoint(path):
        header = CompressedCheckpoint(path).header
        match = _STEP_DIR.search(str(header.get("source", "")))
        if match:
            return int(match.group(1))
        step = header.get("model", {}).get("checkpoint_step")
        return int(step) if step is not None else 0
    step = open_t5x_checkpoint(path).step
    if step is not None:
        return int(step)
    match = _STEP_DIR.search(path)
    return int(match.group(1)) if match else 0
