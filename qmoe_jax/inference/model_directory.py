"""Directories that qmoe_jax writes but that are not a model, named as what they are.

``open_model`` takes a model: a T5X checkpoint, a compressed or a mapped
directory. Handed one of qmoe_jax's other outputs, it says which model that
directory holds instead of failing on its manifest:

- a fine-tuning run (``python -m qmoe_jax.finetune``): its model is
  ``<run>/model``, once the run is complete;
- a T5X export (``python -m qmoe_jax.export``): its checkpoint is
  ``<export>/checkpoint_<step>``;
- a gin evaluation output: it holds results, no model;
- a compressed checkpoint that lost its ``manifest.json``: the compress command
  rebuilds it (``checkpoints.manifest_rebuild``), or the message says why not.
"""

from __future__ import annotations

import os

from qmoe_jax.checkpoints.manifest_rebuild import lost_manifest_advice
from qmoe_jax.checkpoints.output_dir import MANIFEST, read_json_object

# The markers of training.run_directory.FINETUNE_OUTPUT, interop.t5x_export.EXPORT_OUTPUT and
# interop.eval_run.EVAL_OUTPUT, spelled out here because those modules import this package.
FINETUNE_FORMAT = "qmoe_jax.finetune"
EXPORT_FORMAT = "qmoe_jax.t5x_export"
EVALUATION_FORMAT = "qmoe_jax.evaluation"


class NotAModelError(ValueError):
    """The directory is one of qmoe_jax's outputs that holds no model itself."""


def _finetune_run(path: str, manifest: dict) -> str:
    model = manifest.get("model")
    if manifest.get("complete") and isinstance(model, str):
        return (
            f"{path} is a fine-tuning run directory, not a model; its fine-tuned model is "
            f"{os.path.join(path, model)}: pass --checkpoint {os.path.join(path, model)}"
        )
    return (
        f"{path} is a fine-tuning run directory that is not complete, so it holds no model yet; "
        "re-run the same `python -m qmoe_jax.finetune` command to finish it, and then pass "
        f"--checkpoint {os.path.join(path, 'model')}"
    )


def _export(path: str, manifest: dict) -> str:
    step = manifest.get("step")
    inside = os.path.join(path, f"checkpoint_{step}")
    return (
        f"{path} is a T5X export directory; its checkpoint is {inside}: pass --checkpoint {inside}"
    )


def _evaluation(path: str, manifest: dict) -> str:
    return (
        f"{path} is the output directory of a gin evaluation, which holds results, not a model; "
        "pass the checkpoint that was evaluated"
    )


DESCRIBED = {FINETUNE_FORMAT: _finetune_run, EXPORT_FORMAT: _export, EVALUATION_FORMAT: _evaluation}


def refuse_non_model(path: str) -> None:
    """Raises ``NotAModelError`` naming what ``path`` is and where its model is, when it is one of
    qmoe_jax's outputs that is not a model, or a compressed checkpoint that lost its manifest;
    returns otherwise."""
    manifest = read_json_object(os.path.join(path, MANIFEST))
    if manifest is not None and manifest.get("format") in DESCRIBED:
        raise NotAModelError(DESCRIBED[manifest["format"]](os.path.abspath(path), manifest))
    if manifest is None and "://" not in path and os.path.isdir(path):
        advice = lost_manifest_advice(os.path.abspath(path))
        if advice is not None:
            raise NotAModelError(advice)
