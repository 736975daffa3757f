"""Peak memory of the main job against the size of the checkpoint it compresses.

Writes a synthetic switch-base-like checkpoint in the legacy T5X format
(random bf16 weights; many experts), compresses it with
``python -m qmoe_jax.compress`` in a child process, and reports the child's
peak resident set size (RSS, not virtual memory, since XLA reserves large
virtual ranges). The child is started by a small wrapper process that reports
its ``getrusage(RUSAGE_CHILDREN).ru_maxrss``: Linux carries a process's RSS at
fork into its child's ``ru_maxrss``, so forking the compression straight from
this process, which holds the synthetic weights it wrote, would report this
process's size instead of the child's. Pass: peak RSS ≤ 1/3
of the checkpoint's size on disk; the full-size run exits with status 1 when
the peak is over it (``--quick``, whose 0.3 GiB checkpoint is far smaller than
the runtime itself, records the ratio and does not judge it).

    python benchmarks/streaming.py          # 5.5 GiB checkpoint, GPTQ, default flags (~12 min)
    python benchmarks/streaming.py --quick  # 0.3 GiB, a smoke test of the harness

The child runs in the work directory and imports whichever qmoe_jax the
environment gives it (the installed package, or the source tree through
PYTHONPATH after an in-tree build).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import threading
import time

import ml_dtypes
import numpy as np
from common import result_path, work_dir, write_result

from qmoe_jax.checkpoints import path_shapes, write_t5x_checkpoint
from qmoe_jax.models import get_config, param_shapes


def synthetic_params(config, seed: int) -> dict:
    """Random bf16 parameters with the config's T5X tree, generated one array at a time."""
    rng = np.random.default_rng(seed)
    params: dict = {}
    for path, shape in path_shapes(param_shapes(config)).items():
        fan_in = shape[-2] if len(shape) >= 2 else 1
        if path.endswith("scale"):
            value = np.ones(shape, ml_dtypes.bfloat16)
        else:
            value = (rng.standard_normal(shape, dtype=np.float32) / np.sqrt(fan_in)).astype(
                ml_dtypes.bfloat16
            )
        node = params
        keys = path.split("/")
        for key in keys[:-1]:
            node = node.setdefault(key, {})
        node[keys[-1]] = value
    return params


# Runs argv[1:] and reports its peak RSS; being small, its own size at fork barely counts.
PEAK_WRAPPER = (
    "import resource, subprocess, sys\n"
    "code = subprocess.call(sys.argv[1:])\n"
    "print('qmoe-peak-rss', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024, "
    "flush=True)\n"
    "sys.exit(code)\n"
)


def _rss_of_child(wrapper_pid: int) -> int | None:
    with open(f"/proc/{wrapper_pid}/task/{wrapper_pid}/children") as f:
        pids = f.read().split()
    if not pids:
        return None
    with open(f"/proc/{pids[0]}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def run_sampled(
    command: list[str], cwd: str
) -> tuple[int, int, list[tuple[float, str]], list[tuple[float, int]]]:
    """Runs the command under the peak wrapper. Returns (exit code, peak RSS in bytes, output
    lines against time, RSS samples against time every 0.2 s, to say at which stage the peak was).
    """
    started = time.time()
    wrapper = subprocess.Popen(
        [sys.executable, "-c", PEAK_WRAPPER, *command],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )
    samples: list[tuple[float, int]] = []

    def sample() -> None:
        while wrapper.poll() is None:
            try:
                rss = _rss_of_child(wrapper.pid)
                if rss is not None:
                    samples.append((time.time() - started, rss))
            except (OSError, StopIteration):
                pass
            time.sleep(0.2)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    log, peak = [], 0
    for line in wrapper.stdout:
        if line.startswith("qmoe-peak-rss "):
            peak = int(line.split()[1])
        else:
            log.append((time.time() - started, line))
    returncode = wrapper.wait()
    sampler.join()
    return returncode, peak, log, samples


def thinned(samples: list[tuple[float, int]], every: float) -> list[tuple[float, int]]:
    """The largest sample of each ``every`` seconds, as (seconds, bytes)."""
    kept: dict[int, tuple[float, int]] = {}
    for t, rss in samples:
        slot = int(t // every)
        if slot not in kept or rss > kept[slot][1]:
            kept[slot] = (round(t, 1), rss)
    return [kept[slot] for slot in sorted(kept)]


def directory_bytes(path: str) -> int:
    return sum(
        os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path) for f in files
    )


def fresh_work_dir(path: str, marker_name: str) -> str:
    """Empties ``path`` for a benchmark, refusing a non-empty directory this benchmark did not make.

    The benchmark's own directories carry the file ``marker_name``; returns the absolute path.
    """
    path = os.path.abspath(path)
    marker = os.path.join(path, marker_name)
    if os.path.isdir(path) and os.listdir(path) and not os.path.exists(marker):
        raise SystemExit(
            f"--work_dir {path} holds files this benchmark did not make; "
            "give a new or empty directory (it is deleted at the end)"
        )
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)
    open(marker, "w").close()
    return path


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument(
        "--layers", type=int, default=6, help="encoder and decoder layers (every other one sparse)"
    )
    parser.add_argument("--num_samples", type=int, default=64)
    parser.add_argument("--method", default="gptq")
    parser.add_argument("--work_dir", default=work_dir("streaming"))
    parser.add_argument("--output", default=result_path("streaming"), help="the JSON result")
    parser.add_argument(
        "--tokenizer",
        help="SentencePiece model for the calibration text (default: the bundled one)",
    )
    parser.add_argument(
        "--keep", action="store_true", help="keep the synthetic checkpoint and the output"
    )
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.experts, args.layers, args.num_samples = 16, 2, 16

    base = get_config("switch-base-8")
    config = dataclasses.replace(
        base,
        name=f"switch-base-synthetic-{args.experts}",
        num_experts=args.experts,
        num_encoder_layers=args.layers,
        num_decoder_layers=args.layers,
        num_encoder_sparse_layers=args.layers // 2,
        num_decoder_sparse_layers=args.layers // 2,
        checkpoint_path=None,
        checkpoint_step=None,
    )
    args.work_dir = fresh_work_dir(args.work_dir, ".qmoe_streaming_benchmark")
    started = time.time()
    checkpoint = write_t5x_checkpoint(
        os.path.join(args.work_dir, "t5x"), synthetic_params(config, 0), step=1
    )
    checkpoint_bytes = directory_bytes(checkpoint)
    write_seconds = time.time() - started
    config_path = os.path.join(args.work_dir, "config.json")
    with open(config_path, "w") as f:
        json.dump(dataclasses.asdict(config), f)
    print(
        f"synthetic checkpoint: {checkpoint_bytes / 2**30:.2f} GiB in {write_seconds:.0f}s "
        f"({checkpoint})",
        flush=True,
    )

    output_dir = os.path.join(args.work_dir, "compressed")
    command = [
        sys.executable,
        "-m",
        "qmoe_jax.compress",
        "--checkpoint",
        checkpoint,
        "--config",
        config_path,
        "--num_samples",
        str(args.num_samples),
        "--method",
        args.method,
        "--output_dir",
        output_dir,
    ]
    if args.tokenizer:
        command += ["--tokenizer", args.tokenizer]
    started = time.time()
    returncode, peak, log, samples = run_sampled(command, cwd=args.work_dir)
    compress_seconds = time.time() - started
    if returncode != 0:
        print("".join(line for _, line in log)[-6000:])
        raise SystemExit(f"compression failed with exit code {returncode}")
    peak_time, peak_sampled = max(samples, key=lambda sample: sample[1], default=(0.0, 0))
    peak_stage = next((line.strip() for t, line in reversed(log) if t <= peak_time), "(start-up)")
    print(
        f"sampled RSS peak {peak_sampled / 2**30:.2f} GiB at {peak_time:.0f}s, after: "
        f"{peak_stage[:160]}"
    )
    with open(os.path.join(output_dir, "report.json")) as f:
        report = json.load(f)
    result = {
        "config": dataclasses.asdict(config),
        "checkpoint_bytes": checkpoint_bytes,
        "peak_rss_bytes": peak,
        "peak_over_checkpoint": peak / checkpoint_bytes,
        "limit": 1 / 3,
        "passed": peak <= checkpoint_bytes / 3,
        "peak_stage": peak_stage,
        "compress_seconds": compress_seconds,
        "compressed_bytes": report["model"]["compressed_bytes"],
        "compress_command": " ".join(command[1:]),
        # RSS once a second, and the job's output lines, both against seconds since its start:
        # where the memory goes, stage by stage.
        "rss_samples": thinned(samples, 1.0),
        "log": [(round(t, 1), line.rstrip()) for t, line in log],
    }
    print(f"{'checkpoint':>14} {'peak RSS':>10} {'ratio':>7} {'limit':>7} {'time':>8}  pass")
    print(
        f"{checkpoint_bytes / 2**30:>12.2f}Gi {peak / 2**30:>8.2f}Gi "
        f"{peak / checkpoint_bytes:>7.3f} "
        f"{1 / 3:>7.3f} {compress_seconds:>7.0f}s  {result['passed']}"
    )
    write_result("streaming", result, args.output)
    if not args.keep:
        shutil.rmtree(args.work_dir)
    if not result["passed"] and not args.quick:
        raise SystemExit(
            f"peak RSS {peak / 2**30:.2f} GiB is {peak / checkpoint_bytes:.3f}x the checkpoint, "
            f"over the goal of 1/3 ({checkpoint_bytes / 3 / 2**30:.2f} GiB); rss_samples and log "
            f"in {args.output} show the stage"
        )


if __name__ == "__main__":
    main()
