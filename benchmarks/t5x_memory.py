"""Peak memory and checkpoint bytes read of stock ``t5x.eval``: a switch-base-shaped model with 64
experts, compressed inside T5X (configs/t5x/compressed_eval.gin) against its dequantized bfloat16
export (``python -m qmoe_jax.export``, configs/t5x/switch_base_eval.gin).

1. A synthetic compressed checkpoint of switch-base's shape (12 + 12 blocks, every other MLP
   sparse, d_model 768, d_ff 3072, vocabulary 32128) with ``--num_experts`` experts: random
   bfloat16 non-expert parameters and, for every expert of every sparse layer, its own random
   ternary weights (P(0) = 0.885, QMoE's static dictionary) encoded by the project's encoder. Its
   layout and code lengths are a real compression's; GPTQ would take hours here and change
   neither.
2. Its export, ``python -m qmoe_jax.export`` (T5X's Orbax format).
3. ``python -m t5x.eval`` on each, in its own child process, on ``--examples`` examples of
   qmoe_jax's span-corruption task (the bundled vocabulary; its ids fit switch-base's embedding),
   with flaxformer's switch_base.gin settings (bfloat16 activations) and, for both, the restore
   dtype ``--restore_dtype`` (bfloat16 by default, as T5X's infer.gin restores).

Reported per run: the peak RSS of the t5x.eval process (``ru_maxrss`` of a wrapper's children);
the checkpoint bytes it read: its files are dropped from the page cache before the run
(``posix_fadvise(POSIX_FADV_DONTNEED)``) and their resident bytes counted after it (util-linux
``fincore``); all bytes it read from storage (``ru_inblock`` × 512, which also counts Python
modules and libraries not in the page cache); the checkpoint's size on disk; and the ratios
compressed / export. The goal is a compressed peak RSS of at most 0.35 × the export's, and bytes
read about the compressed directory's size. The export step's own peak RSS is reported too: it
builds the dequantized model in memory.

Needs a T5X environment (docs/gin.md §9) with qmoe_jax installed, about 2 × the export's size of
free memory for the export's run (switch-base-64: about 7 GB in bfloat16), and disk for both
checkpoints. Timings are not reported: they are not the point, and the machine may be shared.

    python benchmarks/t5x_memory.py [--work_dir runs/benchmarks/t5x_memory] [--num_experts 64] \\
        [--examples 8] [--keep]

The figures go to benchmarks/results/t5x_memory.json, with the machine facts of
benchmarks/common.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
P0 = 0.885

sys.path[:0] = [REPO, os.path.join(REPO, "benchmarks")]  # this checkout's qmoe_jax and helpers
from common import work_dir, write_result  # noqa: E402
from inference import random_dense  # noqa: E402  (the inference benchmark's synthetic parameters)


def base_shaped(num_experts: int):
    from qmoe_jax.models import get_config

    return dataclasses.replace(
        get_config("switch-base-64"),
        name=f"switch-base-{num_experts}-shaped",
        num_experts=num_experts,
        checkpoint_path=None,
        checkpoint_step=None,
    )


def write_compressed(directory: str, config, seed: int = 0) -> None:
    """The synthetic compressed checkpoint (step 1), written with the compression job's writer."""
    import ml_dtypes

    from qmoe_jax.checkpoints.format_v1 import CompressedCheckpointWriter
    from qmoe_jax.checkpoints.layer_arrays import ternary_arrays
    from qmoe_jax.checkpoints.output_dir import locked
    from qmoe_jax.codec import build_dictionary, encode_experts

    dictionary = build_dictionary(P0)
    rng = np.random.default_rng(seed)
    zero, low = round(P0 * 65536), round((P0 + (1 - P0) / 2) * 65536)
    sparse = [
        f"{stack}.layers_{i}.mlp"
        for stack, decoder in (("encoder", False), ("decoder", True))
        for i in config.sparse_layers(decoder)
    ]
    os.makedirs(directory, exist_ok=True)
    with locked(directory):
        writer = CompressedCheckpointWriter(
            directory,
            {
                "model": config.to_dict(),
                "source": "synthetic/checkpoint_0",
                "grid": {"kind": "ternary", "bits": None},
                "settings": {"synthetic": f"random ternary experts, P(0) = {P0}"},
            },
        )
        writer.write_dense(random_dense(config, np.random.default_rng(seed + 1)))
        fingerprint = writer.write_dictionary(dictionary)
        for name in sparse:
            arrays, kernels = {}, {}
            for kernel, (rows, cols) in (
                ("wi", (config.d_ff, config.d_model)),
                ("wo", (config.d_model, config.d_ff)),
            ):
                stacks = []
                for _ in range(0, config.num_experts, 8):  # 8 experts per call bounds the memory
                    draws = rng.integers(0, 65536, (8, rows, cols), dtype=np.uint16)
                    codes = np.where(draws < zero, 0, np.where(draws < low, 1, 2)).astype(np.uint8)
                    del draws
                    scale = rng.random((8, rows, 1), dtype=np.float32) * 0.05 + 0.01
                    minmax = np.concatenate([-scale, scale], axis=-1).astype(ml_dtypes.bfloat16)
                    stacks.append(encode_experts(codes, minmax, dictionary))
                arrays[kernel] = ternary_arrays(stacks)
                kernels[kernel] = {"rows": rows, "cols": cols}
            writer.write_layer(name, arrays, {"dictionary": fingerprint, "kernels": kernels})
            print(f"wrote {name}", flush=True)
        writer.finalize({"synthetic": True})


def directory_bytes(directory: str) -> int:
    return sum(
        os.path.getsize(os.path.join(folder, name))
        for folder, _, files in os.walk(directory)
        for name in files
    )


def drop_from_page_cache(directory: str) -> None:
    for folder, _, files in os.walk(directory):
        for name in files:
            fd = os.open(os.path.join(folder, name), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def resident_bytes(directory: str) -> int:
    """Bytes of the files under ``directory`` now in the page cache (util-linux ``fincore``)."""
    files = [
        os.path.join(folder, name) for folder, _, names in os.walk(directory) for name in names
    ]
    result = subprocess.run(
        ["fincore", "--bytes", "--noheadings", "--output", "RES", *files],
        capture_output=True,
        text=True,
        check=True,
    )
    return sum(int(line) for line in result.stdout.split())


def measured(command: list[str], env: dict, log: str) -> dict:
    """Runs ``command`` in a wrapper process and returns its peak RSS and storage reads."""
    wrapper = (
        "import json, resource, subprocess, sys\n"
        f"with open({log!r}, 'w') as log:\n"
        f"    code = subprocess.call({command!r}, stdout=log, stderr=subprocess.STDOUT)\n"
        "usage = resource.getrusage(resource.RUSAGE_CHILDREN)\n"
        "print(json.dumps({'returncode': code, 'peak_rss_kib': usage.ru_maxrss,\n"
        "                  'read_bytes': usage.ru_inblock * 512}))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", wrapper], env=env, capture_output=True, text=True, check=False
    )
    if result.returncode != 0:
        raise RuntimeError(f"the measuring wrapper failed: {result.stderr[-3000:]}")
    record = json.loads(result.stdout.strip().splitlines()[-1])
    if record["returncode"] != 0:
        with open(log) as f:
            raise RuntimeError(
                f"{' '.join(command[:3])} failed; the end of {log}:\n" + f.read()[-4000:]
            )
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work_dir", default=work_dir("t5x_memory"))
    parser.add_argument("--num_experts", type=int, default=64)
    parser.add_argument("--examples", type=int, default=8)
    parser.add_argument(
        "--restore_dtype",
        default="bfloat16",
        choices=["bfloat16", "float32", "none"],
        help="RestoreCheckpointConfig.dtype of both runs (default bfloat16, as T5X's infer.gin; "
        "none: each parameter's own dtype, float32 for flaxformer)",
    )
    parser.add_argument(
        "--compressed_only",
        action="store_true",
        help="measure the compressed run only (no export: where the export's run would not fit "
        "in memory)",
    )
    parser.add_argument("--keep", action="store_true", help="keep both checkpoints")
    args = parser.parse_args()

    import flaxformer
    import t5x

    from qmoe_jax.data import bundled
    from qmoe_jax.interop.gin_flags import CONFIGS_DIR

    config = base_shaped(args.num_experts)
    work = os.path.abspath(args.work_dir)
    compressed = os.path.join(work, "compressed")
    export = os.path.join(work, "export")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
    from qmoe_jax.checkpoints.output_dir import read_json_object

    manifest = read_json_object(os.path.join(compressed, "manifest.json")) or {}
    stored_model = manifest.get("header", {}).get("model", {})
    if not manifest.get("complete") or stored_model.get("num_experts") != args.num_experts:
        shutil.rmtree(compressed, ignore_errors=True)
        write_compressed(compressed, config)
    report = {
        "model": config.name,
        "examples": args.examples,
        "restore_dtype": args.restore_dtype,
        "compressed_bytes": directory_bytes(compressed),
    }
    if not args.compressed_only and not os.path.isdir(export):
        report["export_step"] = measured(
            [
                sys.executable,
                "-m",
                "qmoe_jax.export",
                "--checkpoint",
                compressed,
                "--output_dir",
                export,
                "--format",
                "orbax",
            ],
            env,
            os.path.join(work, "export.log"),
        )
    step = os.path.join(export, "checkpoint_0")
    # (name, gin file, CHECKPOINT_PATH, the directory it reads). T5X's eval reads the step from the
    # end of CHECKPOINT_PATH, so the compressed directory is named <compressed>/checkpoint_0.
    runs = [
        (
            "compressed",
            "t5x/switch_base_compressed_eval.gin",
            os.path.join(compressed, "checkpoint_0"),
            compressed,
        )
    ]
    if not args.compressed_only:
        report["export_bytes"] = directory_bytes(step)
        runs.append(("export", "t5x/switch_base_eval.gin", step, step))

    roots = [
        os.path.dirname(os.path.dirname(os.path.abspath(module.__file__)))
        for module in (flaxformer, t5x)
    ]
    flags = [
        f"--gin_search_paths={','.join(roots)},{CONFIGS_DIR}",
        f"--gin.NUM_EXPERTS={args.num_experts}",
        f"--gin.VOCABULARY_FILE='{bundled.tokenizer_path()}'",
        "--gin.MIXTURE_OR_TASK_NAME='qmoe_span_corruption'",
        f"--gin.QMOE_NUM_EXAMPLES={args.examples}",
        "--gin.TASK_FEATURE_LENGTHS={'inputs': 128, 'targets': 32}",
        f"--gin.BATCH_SIZE={args.examples}",
    ]
    if args.restore_dtype != "none":
        flags.append(f"--gin.t5x.utils.RestoreCheckpointConfig.dtype='{args.restore_dtype}'")
    for name, gin_file, checkpoint, directory in runs:
        out = os.path.join(work, f"eval_{name}")
        shutil.rmtree(out, ignore_errors=True)
        drop_from_page_cache(directory)
        report[f"eval_{name}"] = measured(
            [
                sys.executable,
                "-m",
                "t5x.eval",
                f"--gin_file={gin_file}",
                f"--gin.CHECKPOINT_PATH='{checkpoint}'",
                f"--gin.EVAL_OUTPUT_DIR='{out}'",
                *flags,
            ],
            env,
            os.path.join(work, f"eval_{name}.log"),
        )
        report[f"eval_{name}"]["checkpoint_bytes_read"] = resident_bytes(directory)
    if args.compressed_only:
        print(json.dumps(report, indent=1))
        write_result("t5x_memory", report)
        return
    ours, theirs = report["eval_compressed"], report["eval_export"]
    report["rss_ratio"] = round(ours["peak_rss_kib"] / theirs["peak_rss_kib"], 3)
    # Resident pages are counted after the run: a run that needed the memory may have evicted
    # its own checkpoint's pages, and then the count says nothing (null, not a ratio over 0).
    report["checkpoint_read_ratio"] = (
        round(ours["checkpoint_bytes_read"] / theirs["checkpoint_bytes_read"], 3)
        if theirs["checkpoint_bytes_read"] > 0
        else None
    )
    report["storage_read_ratio"] = round(ours["read_bytes"] / max(theirs["read_bytes"], 1), 3)
    report["rss_goal_met"] = report["rss_ratio"] <= 0.35
    print(json.dumps(report, indent=1))
    write_result("t5x_memory", report)
    if not args.keep:
        shutil.rmtree(compressed)
        shutil.rmtree(export, ignore_errors=True)


if __name__ == "__main__":
    main()
