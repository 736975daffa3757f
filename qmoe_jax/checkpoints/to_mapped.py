"""One-time conversion of a compressed checkpoint (format v1) to the mapped layout (docs/format.md
§9)."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable

from qmoe_jax.checkpoints.format_v1 import (
    ADAPTERS,
    CompressedCheckpoint,
    CompressedCheckpointError,
    layer_order,
)
from qmoe_jax.checkpoints.layer_arrays import check_kernel_arrays, kernel_cols
from qmoe_jax.checkpoints.mapped_layout import MappedCheckpointWriter
from qmoe_jax.checkpoints.output_dir import MANIFEST


def convert_to_mapped(
    source: str,
    output_dir: str,
    log: Callable[[str], None] = lambda line: None,
    progress: Callable[[int], None] = lambda n: None,
) -> None:
    """Writes the mapped layout of the finished ternary checkpoint ``source`` into ``output_dir``.

    Every layer of ``source`` is read with its checksums verified, then written
    expert by expert; ``dense/`` and the dictionaries are copied as they are.
    The caller holds ``output_dir``'s lock (``output_dir.claimed``).
    """
    checkpoint = CompressedCheckpoint(source)
    if not checkpoint.complete:
        raise CompressedCheckpointError(
            f"{source} is unfinished", "finish it with the compress command first"
        )
    grid = checkpoint.header.get("grid") or checkpoint.header["settings"]["grid"]
    if grid["kind"] != "ternary":
        raise CompressedCheckpointError(
            f"{source} holds {grid['bits']}-bit experts; only ternary experts (the "
            "fused kernels' form) have a mapped layout"
        )
    if checkpoint.manifest.get(ADAPTERS) is not None:
        raise CompressedCheckpointError(
            f"{source} is fine-tuned with expert LoRA adapters (docs/format.md §8.9), which the "
            "mapped layout "
            "does not carry",
            "run it as it is (`--experts compressed`), or fine-tune without --expert_lora_rank "
            "to convert it",
        )
    model = checkpoint.header["model"]
    with open(os.path.join(checkpoint.directory, MANIFEST), "rb") as f:
        source_record = {
            "directory": checkpoint.directory,
            "manifest_sha256": hashlib.sha256(f.read()).hexdigest(),
        }
    writer = MappedCheckpointWriter(output_dir, checkpoint.header, source_record)
    checkpoint.dense_params()  # verifies the checksums before copying
    writer.copy_dense(checkpoint.directory, checkpoint.manifest["dense"])
    for fingerprint, record in checkpoint.manifest["dictionaries"].items():
        checkpoint.dictionary(fingerprint)  # verifies the fingerprint
        writer.copy_dictionary(checkpoint.directory, fingerprint, record)
    for name in sorted(checkpoint.layer_names(), key=layer_order):
        arrays, stats = checkpoint.layer(name)
        kernels, codewords = [], {}
        for kernel in sorted(arrays):
            check_kernel_arrays(arrays[kernel], True, f"{source}/layers/{name}/{kernel}")
            codes, offsets = arrays[kernel]["codes"], arrays[kernel]["row_offsets"]
            kernels.append(
                (
                    kernel,
                    offsets.shape[1] - 1,
                    kernel_cols(kernel, model["d_model"], model["d_ff"]),
                    codes.shape[1],
                )
            )
            codewords[kernel] = offsets[:, -1].tolist()
        experts = (
            {
                k: (arrays[k]["codes"][e], arrays[k]["row_offsets"][e], arrays[k]["minmax"][e])
                for k in arrays
            }
            for e in range(len(next(iter(codewords.values()))))
        )
        stats = {**stats, "source_checksums": checkpoint.manifest["layers"][name]["checksums"]}
        writer.write_layer(name, kernels, codewords, experts, stats, progress)
        log(f"{name}: {writer.manifest['layers'][name]['bytes'] / 2**20:.1f} MiB")
    writer.finalize(checkpoint.manifest.get("report"))
