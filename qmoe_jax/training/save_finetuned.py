"""Writing the fine-tuned model in the form it came in.

- Compressed input → a compressed checkpoint (docs/format.md §8): the source's
  expert codes and dictionaries unchanged (same checksums), the new dense
  parameters in float32, the expert LoRA adapters in ``adapters/`` (§8.9), and
  the source's header with a ``finetune`` field added.
- T5X input → a legacy T5X checkpoint ``checkpoint_<step>/`` (float32) of every
  parameter.

Either is written into ``<name>.partial/`` and renamed to ``<name>/`` when whole.
"""

from __future__ import annotations

import os
import shutil

import jax
import numpy as np

from qmoe_jax.checkpoints import write_t5x_checkpoint
from qmoe_jax.checkpoints.format_v1 import CompressedCheckpoint, CompressedCheckpointWriter
from qmoe_jax.codec import CompressedExperts
from qmoe_jax.models.lora import LORA
from qmoe_jax.training.trainable import EXPERT_KERNEL, flatten, unflatten


def _host_float32(tree: dict) -> dict:
    return jax.tree.map(lambda leaf: np.asarray(jax.device_get(leaf), np.float32), tree)


def dense_and_adapters(params: dict) -> tuple[dict, dict]:
    """(every parameter but the expert kernels (compressed or dequantized) and adapters,
    ``{layer: {kernel: adapter}}``) of a compressed model's tree, on the host in float32."""
    dense, adapters = {}, {}
    for path, leaf in flatten(params).items():
        if isinstance(leaf, CompressedExperts) or EXPERT_KERNEL.search(
            path
        ):  # frozen: the source's codes
            continue
        if f"/expert/{LORA}/" in path:
            layer, _, rest = path.partition(f"/expert/{LORA}/")
            adapters[f"{layer.replace('/', '.')}/{rest}"] = leaf
        else:
            dense[path] = leaf
    return _host_float32(unflatten(dense)), _host_float32(unflatten(adapters))


def _fresh(path: str) -> None:
    if os.path.exists(path):
        shutil.rmtree(path)


def write_compressed(
    source: str, target: str, params: dict, finetune: dict, lora_rank: int
) -> None:
    """The fine-tuned compressed checkpoint of ``params`` at ``target`` (experts copied from
    ``source``)."""
    staging = target + ".partial"
    _fresh(staging)
    _fresh(target)
    original = CompressedCheckpoint(source)
    header = dict(original.header, finetune=finetune)
    dense, adapters = dense_and_adapters(params)
    writer = CompressedCheckpointWriter(staging, header)
    writer.write_dense(dense)
    for fingerprint in original.manifest["dictionaries"]:
        writer.write_dictionary(original.dictionary(fingerprint))
    for name in original.layer_names():
        arrays, stats = original.layer(name)
        writer.write_layer(name, arrays, stats)
    if adapters:
        writer.write_adapters(adapters, lora_rank)
    writer.finalize(original.manifest["report"])
    os.replace(staging, target)


def write_t5x(target: str, params: dict, step: int) -> str:
    """A legacy T5X checkpoint of ``params`` under ``target``; returns its ``checkpoint_<step>``
    directory."""
    staging = target + ".partial"
    _fresh(staging)
    _fresh(target)
    written = write_t5x_checkpoint(staging, _host_float32(params), step=step)
    os.replace(staging, target)
    return os.path.join(target, os.path.basename(written.rstrip("/")))
