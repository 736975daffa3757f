"""The compression report: report.json, report.png and the printed summary.

Sizes count bf16 (16 bits) for every uncompressed parameter. A ternary expert
matrix costs ``16·codewords + 64·rows`` bits (codes, row offsets and bf16
min/max, docs/format.md §7); a k-bit matrix costs ``k·rows·cols + 64·rows`` bits
(ideally packed codes plus per-row scale and zero point). Each distinct
dictionary adds 512 KiB to the whole-model size.

Each layer's ``output_error`` is ``Σ‖y_q − y‖² / Σ‖y‖²`` of its gated expert
outputs on the calibration tokens (quantized vs original experts, the same
inputs), for the positions that may feed the Hessians and for the premasked
ones (``--premask``). GPTQ fits the first; a much larger second figure means
the premasked positions are reconstructed poorly.
"""

from __future__ import annotations

import os

import numpy as np

from qmoe_jax.checkpoints import strict_json
from qmoe_jax.checkpoints.format_v1 import layer_order

DICTIONARY_BYTES = 65536 * 2 * 4


def _kernel_bits(stats: dict, experts: int, grid: dict) -> float:
    rows, cols = stats["rows"], stats["cols"]
    if grid["kind"] == "ternary":
        return 16.0 * stats["codewords"] + 64.0 * rows * experts
    return float(grid["bits"]) * rows * cols * experts + 64.0 * rows * experts


def build_report(
    manifest: dict, total_parameters: int, expert_parameters: int, seconds: dict
) -> dict:
    """Summarizes a finished compressed checkpoint's manifest.

    The layers are listed in the order the calibration pass visits them (encoder first, by index),
    whatever the manifest's order: a manifest read back from disk has its layers in key order
    (``write_json_atomic`` sorts them), so a resumed run's would otherwise differ from a clean
    run's.

    Args:
      total_parameters: parameters of the whole model; expert_parameters: of its expert kernels.
      seconds: wall time per stage of the run.
    """
    header = manifest["header"]
    grid = header["grid"]
    experts = header["model"]["num_experts"]
    layers, expert_bits = [], 0.0
    for name, record in sorted(manifest["layers"].items(), key=lambda item: layer_order(item[0])):
        stats = record["stats"]
        kernels = stats["kernels"]
        bits = sum(_kernel_bits(k, experts, grid) for k in kernels.values())
        weights = sum(k["rows"] * k["cols"] * experts for k in kernels.values())
        zeros = sum(k["zero_fraction"] * k["rows"] * k["cols"] * experts for k in kernels.values())
        expert_bits += bits
        layers.append(
            {
                "name": name,
                "zero_fraction": zeros / weights,
                "bits_per_weight": bits / weights,
                "compression_rate": 16.0 * weights / bits,
                "kernels": kernels,
                # Imported layers (python -m qmoe_jax.import_qmoe) have no calibration stats: null.
                "fallback_experts": stats.get("fallback_experts"),
                "output_error": stats.get("output_error"),
                "tokens_per_expert": stats.get("tokens_per_expert"),
                "dropped_tokens": stats.get("dropped_tokens"),
                "dictionary": stats["dictionary"],
                "seconds": stats["seconds"],
            }
        )
    dense_bits = 16.0 * (total_parameters - expert_parameters)
    dictionary_bits = 8.0 * DICTIONARY_BYTES * len(manifest["dictionaries"])
    compressed_bits = dense_bits + expert_bits + dictionary_bits
    stage_seconds: dict[str, float] = dict(seconds)
    for layer in layers:
        for stage, value in layer["seconds"].items():
            stage_seconds[stage] = stage_seconds.get(stage, 0.0) + value
    return {
        "config": header["model"]["name"],
        "source": header["source"],
        "grid": header["grid"],
        "settings": header["settings"],
        "layers": layers,
        "moe": {
            "parameters": expert_parameters,
            "bf16_bytes": 2 * expert_parameters,
            "compressed_bytes": expert_bits / 8,
            "bits_per_weight": expert_bits / max(expert_parameters, 1),
            "compression_rate": 16.0 * expert_parameters / max(expert_bits, 1.0),
        },
        "model": {
            "parameters": total_parameters,
            "bf16_bytes": 2 * total_parameters,
            "compressed_bytes": compressed_bits / 8,
            "dictionary_bytes": dictionary_bits / 8,
            "compression_rate": 16.0 * total_parameters / compressed_bits,
        },
        "fallback_experts": sum(layer["fallback_experts"] or 0 for layer in layers),
        "nonfinite_zeroed": manifest["nonfinite_zeroed"],
        "seconds": stage_seconds,
    }


def _error_cell(error: dict | None) -> str:
    """``hessian / premasked`` relative output errors, '-' where a side had no tokens (or an old
    manifest)."""
    if not error:
        return "-"
    return " / ".join(
        "-" if error[side] is None else f"{error[side]:.4f}"
        for side in ("hessian_positions", "premasked_positions")
    )


def summary_table(report: dict) -> str:
    lines = [
        f"{'layer':<24}{'zeros':>8}{'bits/w':>9}{'rate':>8}{'fallback':>10}"
        f"{'tokens/expert min/mean/max':>31}"
        f"{'output error (hessian / premasked)':>38}"
    ]
    for layer in report["layers"]:
        tpe, fallback = layer["tokens_per_expert"], layer["fallback_experts"]
        tokens = (
            f"{tpe['min']:>12d} / {tpe['mean']:>7.1f} / {tpe['max']:<6d}"
            if tpe
            else f"{'-':>12}{'':>18}"
        )
        lines.append(
            f"{layer['name']:<24}{layer['zero_fraction']:>8.3f}{layer['bits_per_weight']:>9.3f}"
            f"{layer['compression_rate']:>7.1f}x{'-' if fallback is None else fallback:>10}"
            f"{tokens}{_error_cell(layer.get('output_error')):>38}"
        )
    moe, model = report["moe"], report["model"]
    lines.append(
        f"experts: {moe['bits_per_weight']:.3f} bits/weight, {moe['compression_rate']:.2f}x vs "
        "bf16 "
        f"({moe['bf16_bytes'] / 2**20:.1f} MiB -> {moe['compressed_bytes'] / 2**20:.2f} MiB)"
    )
    lines.append(
        f"whole model: {model['compression_rate']:.2f}x vs bf16 "
        f"({model['bf16_bytes'] / 2**20:.1f} MiB -> {model['compressed_bytes'] / 2**20:.2f} MiB, "
        f"dictionaries {model['dictionary_bytes'] / 2**10:.0f} KiB)"
    )
    zeroed = report["nonfinite_zeroed"]
    if zeroed:
        lines.append(
            f"non-finite source values set to 0 (--nonfinite zero): {sum(zeroed.values())} in "
            f"{len(zeroed)} arrays or experts (report.json, nonfinite_zeroed)"
        )
    lines.append(
        "time: " + ", ".join(f"{stage} {value:.1f}s" for stage, value in report["seconds"].items())
    )
    return "\n".join(lines)


def write_report(report: dict, directory: str) -> None:
    """Writes report.json and report.png (per-layer zero fraction and bits per weight)."""
    with open(os.path.join(directory, "report.json"), "w") as f:
        strict_json.dump(report, f, what="report.json", indent=1)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [layer["name"].replace(".mlp", "") for layer in report["layers"]]
    positions = np.arange(len(names))
    figure, (top, bottom) = plt.subplots(
        2, 1, figsize=(max(6, 0.5 * len(names) + 2), 6), sharex=True
    )
    top.bar(positions, [layer["zero_fraction"] for layer in report["layers"]], color="tab:blue")
    top.set_ylabel("zero fraction")
    top.set_ylim(0, 1)
    top.set_title(
        f"{report['config']}: {report['moe']['bits_per_weight']:.3f} bits/weight on experts, "
        f"{report['model']['compression_rate']:.1f}x whole model"
    )
    bottom.bar(
        positions, [layer["bits_per_weight"] for layer in report["layers"]], color="tab:orange"
    )
    bottom.set_ylabel("bits per weight")
    bottom.set_xticks(positions, names, rotation=60, ha="right", fontsize=8)
    figure.tight_layout()
    figure.savefig(os.path.join(directory, "report.png"), dpi=110)
    plt.close(figure)
