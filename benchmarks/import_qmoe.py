"""Peak memory and time per GB of `python -m qmoe_jax.import_qmoe` on synthetic switch-c-2048-shaped
layer files.

Builds a directory in the QMoE authors' layout (docs/qmoe_import.md §2) whose
layer files have c-2048's expert shapes (d_model 2080, d_ff 6144: wi 6144×2080,
wo 2080×6144) with --experts experts per layer (c-2048 has 2048; a real layer
file is then about 5.2 GB), two sparse layers (one encoder, one decoder block,
every block sparse as in c-2048) and c-2048's dense shapes for those blocks
(vocabulary 32128, 30 heads × 64, untied output layer). The code streams are
i.i.d. ternary with P(0) = 0.885 (about 0.8 bits per weight, like the
published models), encoded with the authors' dictionary; --patterns distinct
experts are repeated, each saved as its own tensor (torch.save writes every
storage once), so the files have the real size.

The import runs in child processes: one stopped after the dense part (its
peak RSS, VmHWM, is the dense part's), then one that resumes it and
imports the layers (its peak is the layers'); both are compared with a child
that only imports the importer (the baseline: Python, JAX, Orbax). The
files were just written, so they are read from the page cache: time per GB
is the importer's own work (SHA-256, reading, stream checks, Orbax writes),
not the disk. Needs torch to write the files.

    python benchmarks/import_qmoe.py [--experts 128] [--work_dir DIR] [--output PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import ml_dtypes
import numpy as np
from common import result_path, write_result

D_MODEL, D_FF, HEADS, D_KV, VOCAB = 2080, 6144, 30, 64, 32128
P0 = 0.885
CHILD = """
import json, sys, time
from qmoe_jax.interop import qmoe_import
mode, seconds = sys.argv[1], {}
if mode == "dense":  # stop before the first layer: the peak of reading and writing the dense part
    def stop(*args):
        raise KeyboardInterrupt
    qmoe_import.read_layer = stop
if mode != "baseline":
    started = time.perf_counter()
    try:
        report = qmoe_import.import_qmoe(
            sys.argv[2], sys.argv[3], log=lambda line: None, progress=False
        )
        seconds = dict(report["seconds"], wall=time.perf_counter() - started)
    except KeyboardInterrupt:
        seconds = {"wall": time.perf_counter() - started}
# VmHWM: this process's peak RSS (ru_maxrss would count the parent's too)
with open("/proc/self/status") as f:
    peak = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
print(json.dumps({"peak_rss_bytes": peak, "seconds": seconds}))
"""


def _linear(rng, rows: int, cols: int, dictionary) -> dict:
    from qmoe_jax.codec import encode

    codes = rng.choice(
        np.array([0, 1, 2], np.uint8), size=(rows, cols), p=[P0, (1 - P0) / 2, (1 - P0) / 2]
    )
    low = -np.abs(rng.normal(0.05, 0.01, rows))
    minmax = np.stack([low, -low * rng.uniform(0.8, 1.2, rows)], 1).astype(ml_dtypes.bfloat16)
    matrix = encode(codes, minmax, dictionary)
    return {
        "w_comp": np.asarray(matrix.codes).view(np.int16),
        "row_off": np.asarray(matrix.row_offsets),
        "ter_minmax": np.asarray(minmax).reshape(-1),
    }


def _tensor(torch, array: np.ndarray):
    if array.dtype == ml_dtypes.bfloat16:
        return (
            torch.from_numpy(np.ascontiguousarray(array).view(np.int16))
            .view(torch.bfloat16)
            .clone()
        )
    return torch.from_numpy(np.ascontiguousarray(array)).clone()


def write_directory(path: str, experts: int, patterns: int, seed: int) -> None:
    import torch

    from qmoe_jax.codec import build_dictionary

    os.makedirs(path, exist_ok=True)
    config = {
        "model_type": "switch_transformers",
        "_name_or_path": "synthetic-c-2048-shape",
        "vocab_size": VOCAB,
        "d_model": D_MODEL,
        "d_kv": D_KV,
        "d_ff": D_FF,
        "num_heads": HEADS,
        "num_layers": 1,
        "num_decoder_layers": 1,
        "num_experts": experts,
        "num_sparse_encoder_layers": 1,
        "num_sparse_decoder_layers": 1,
        "tie_word_embeddings": False,
        "is_full_sparse": True,
        "dense_act_fn": "relu",
        "torch_dtype": "bfloat16",
    }
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    rng = np.random.default_rng(seed)
    inner = HEADS * D_KV
    dense = {
        "shared.weight": (VOCAB, D_MODEL),
        "lm_head.weight": (VOCAB, D_MODEL),
        "encoder.final_layer_norm.weight": (D_MODEL,),
        "decoder.final_layer_norm.weight": (D_MODEL,),
    }
    for stack, attentions in (
        ("encoder", ("0.SelfAttention",)),
        ("decoder", ("0.SelfAttention", "1.EncDecAttention")),
    ):
        dense[f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight"] = (32, HEADS)
        for attention in attentions:
            for p in "qkv":
                dense[f"{stack}.block.0.layer.{attention}.{p}.weight"] = (inner, D_MODEL)
            dense[f"{stack}.block.0.layer.{attention}.o.weight"] = (D_MODEL, inner)
        mlp = 1 if stack == "encoder" else 2
        for sub in range(mlp + 1):
            dense[f"{stack}.block.0.layer.{sub}.layer_norm.weight"] = (D_MODEL,)
        dense[f"{stack}.block.0.layer.{mlp}.mlp.router.classifier.weight"] = (experts, D_MODEL)
    torch.save(
        {k: torch.randn(*shape).bfloat16() * 0.02 for k, shape in dense.items()},
        os.path.join(path, "noexp.pt"),
    )
    dictionary = build_dictionary()
    made = [
        {
            "wi": _linear(rng, D_FF, D_MODEL, dictionary),
            "wo": _linear(rng, D_MODEL, D_FF, dictionary),
        }
        for _ in range(patterns)
    ]
    sizes = {}
    for number, (stack, mlp) in enumerate((("encoder", 1), ("decoder", 2))):
        layer = {}
        for e in range(experts):
            for kernel, parts in made[e % patterns].items():
                name = f"{stack}.block.0.layer.{mlp}.mlp.experts.expert_{e}.{kernel}"
                layer.update(
                    {f"{name}.{part}": _tensor(torch, value) for part, value in parts.items()}
                )
                layer[f"{name}.weight"] = torch.zeros(0, dtype=torch.bfloat16)
                sizes[name] = int(parts["w_comp"].size)
        torch.save(layer, os.path.join(path, f"exp{number:02d}.pt"))
        del layer
    torch.save(sizes, os.path.join(path, "sizes.pt"))


def _child(*args: str) -> dict:
    result = subprocess.run(
        [sys.executable, "-c", CHILD, *args], capture_output=True, text=True, check=False
    )
    if result.returncode:
        raise SystemExit(f"child failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def measure(work: str, experts: int, patterns: int, seed: int) -> dict:
    """Builds the synthetic directory with ``experts`` experts per layer, imports it, deletes
    both."""
    source, output = os.path.join(work, "synthetic_qmoe"), os.path.join(work, "imported")
    try:
        tick = time.perf_counter()
        write_directory(source, experts, patterns, seed)
        made = time.perf_counter() - tick
        layer_bytes = [os.path.getsize(os.path.join(source, f"exp{n:02d}.pt")) for n in range(2)]
        dense = _child("dense", source, output)  # interrupted after the dense part ...
        run = _child("resume", source, output)  # ... and resumed: the layers only
    finally:
        shutil.rmtree(source, ignore_errors=True)
        shutil.rmtree(output, ignore_errors=True)
    seconds = run["seconds"]
    gb = sum(layer_bytes) / 1e9
    return {
        "experts_per_layer": experts,
        "layer_file_bytes": max(layer_bytes),
        "dense_peak_rss_bytes": dense["peak_rss_bytes"],
        "dense_seconds": dense["seconds"]["wall"],
        "layers_peak_rss_bytes": run["peak_rss_bytes"],
        "layer_seconds": seconds,
        "layer_seconds_per_gb": (seconds["hash"] + seconds["read"] + seconds["write"]) / gb,
        **{f"{stage}_seconds_per_gb": seconds[stage] / gb for stage in ("hash", "read", "write")},
        "synthetic_write_seconds": made,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--experts",
        type=int,
        nargs="+",
        default=[256, 512],
        help="experts per layer, one run each (c-2048: 2048); the first and last give the slope",
    )
    parser.add_argument(
        "--patterns", type=int, default=8, help="distinct synthetic experts, repeated"
    )
    parser.add_argument(
        "--work_dir", help="where the synthetic directory and the output go (deleted afterwards)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default=result_path("import_qmoe"), help="the JSON result")
    args = parser.parse_args()
    work = args.work_dir or tempfile.mkdtemp(prefix="qmoe_import_bench_")
    try:
        baseline = _child("baseline")
        runs = [measure(work, experts, args.patterns, args.seed) for experts in args.experts]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(
        "baseline (Python + qmoe_jax imported): peak RSS "
        f"{baseline['peak_rss_bytes'] / 2**30:.2f} GiB"
    )
    print(
        f"{'experts':>8}{'layer file GB':>15}{'dense peak GiB':>16}{'layers peak GiB':>17}"
        f"{'s/GB':>7}"
        f"{'SHA-256':>9}{'read+check':>12}{'write':>7}"
    )
    for run in runs:
        print(
            f"{run['experts_per_layer']:>8}{run['layer_file_bytes'] / 1e9:>15.3f}"
            f"{run['dense_peak_rss_bytes'] / 2**30:>16.2f}"
            f"{run['layers_peak_rss_bytes'] / 2**30:>17.2f}"
            f"{run['layer_seconds_per_gb']:>7.1f}{run['hash_seconds_per_gb']:>9.1f}"
            f"{run['read_seconds_per_gb']:>12.1f}"
            f"{run['write_seconds_per_gb']:>7.1f}"
        )
    result = {"baseline_peak_rss_bytes": baseline["peak_rss_bytes"], "runs": runs}
    if len(runs) > 1:
        first, last = runs[0], runs[-1]
        slope = (last["layers_peak_rss_bytes"] - first["layers_peak_rss_bytes"]) / (
            last["layer_file_bytes"] - first["layer_file_bytes"]
        )
        result["peak_rss_per_layer_file_byte"] = slope
        result["peak_rss_intercept_bytes"] = (
            last["layers_peak_rss_bytes"] - slope * last["layer_file_bytes"]
        )
        print(
            f"layers' peak RSS = {result['peak_rss_intercept_bytes'] / 2**30:.2f} GiB + "
            f"{slope:.2f} x one layer "
            f"file; c-2048 (5.2 GB layer files): about "
            f"{(result['peak_rss_intercept_bytes'] + slope * 5.2e9) / 2**30:.1f} GiB"
        )
    write_result("import_qmoe", result, args.output)


if __name__ == "__main__":
    main()
