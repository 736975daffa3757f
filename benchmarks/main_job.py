"""The main job as README command 1 runs it: `python -m qmoe_jax.compress` on the bundled model,
each run a fresh process from the repository root into its own output directory.

Per run: the process's wall time (interpreter start, imports and compiles included), its peak RSS
(the child's ru_maxrss), the CLI's own phase seconds (report.json "seconds"), the validation loss
of the original and the compressed model, and the content checksums of every array written
(manifest.json's dense and per-layer "checksums"), which must be the same in every run.

Three kinds of run, interleaved round by round so that their ratios hold on a noisy machine:
  cold       no persistent compilation cache (README command 1 as a newcomer runs it)
  cache_fill JAX's persistent compilation cache in a fresh directory, every program cached
             (JAX_COMPILATION_CACHE_DIR, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0)
  cache_warm the same cache directory again: compiles are read back

    python benchmarks/main_job.py [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time

from common import REPO, cpu_model, result_path, work_dir, write_result

KINDS = ("cold", "cache_fill", "cache_warm")
# Runs argv[1:] and prints its peak RSS in bytes; being small, its own size barely counts.
PEAK_WRAPPER = (
    "import resource, subprocess, sys\n"
    "code = subprocess.call(sys.argv[1:])\n"
    "print('qmoe-peak-rss', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024, "
    "flush=True)\n"
    "sys.exit(code)\n"
)


def run_once(kind: str, output_dir: str, cache_dir: str) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    for name in ("JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"):
        env.pop(name, None)
    if kind != "cold":
        env["JAX_COMPILATION_CACHE_DIR"] = cache_dir
        env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    command = [sys.executable, "-m", "qmoe_jax.compress", "--output_dir", output_dir]
    started = time.perf_counter()
    completed = subprocess.run(
        [sys.executable, "-c", PEAK_WRAPPER, *command],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
    )
    wall = time.perf_counter() - started
    if completed.returncode != 0:
        print(completed.stdout[-4000:], completed.stderr[-4000:])
        raise SystemExit(f"{kind}: the main job failed with exit code {completed.returncode}")
    peak = next(
        int(line.split()[1])
        for line in completed.stdout.splitlines()
        if line.startswith("qmoe-peak-rss ")
    )
    with open(os.path.join(output_dir, "report.json")) as f:
        report = json.load(f)
    with open(os.path.join(output_dir, "manifest.json")) as f:
        manifest = json.load(f)
    # the content checksums of every array written (the dense parameters and each layer's codes)
    checksums = {
        "dense": manifest["dense"]["checksums"],
        **{name: layer["checksums"] for name, layer in manifest["layers"].items()},
    }
    return {
        "kind": kind,
        "wall_seconds": wall,
        "peak_rss_gib": peak / 2**30,
        "seconds": report["seconds"],
        "evaluation": report.get("evaluation"),
        "checksums": checksums,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=2, help="rounds of the three kinds")
    parser.add_argument("--work_dir", default=work_dir("main_job"))
    parser.add_argument("--output", default=result_path("main_job"), help="the JSON result")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    shutil.rmtree(args.work_dir, ignore_errors=True)
    os.makedirs(args.work_dir)
    self_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    runs = []
    for round_index in range(args.rounds):
        cache_dir = os.path.join(args.work_dir, f"jax_cache_{round_index}")
        for kind in KINDS:
            output_dir = os.path.join(args.work_dir, f"{kind}_{round_index}")
            run = run_once(kind, output_dir, cache_dir)
            shutil.rmtree(output_dir)
            runs.append(run)
            print(
                f"round {round_index + 1} {kind:<10} {run['wall_seconds']:7.1f} s, peak RSS "
                f"{run['peak_rss_gib']:.2f} GiB",
                flush=True,
            )
    identical = all(run["checksums"] == runs[0]["checksums"] for run in runs)
    summary = {}
    for kind in KINDS:
        walls = [run["wall_seconds"] for run in runs if run["kind"] == kind]
        summary[kind] = {
            "median_wall_seconds": statistics.median(walls),
            "wall_seconds": walls,
            "peak_rss_gib": max(run["peak_rss_gib"] for run in runs if run["kind"] == kind),
        }
    ratio = summary["cache_warm"]["median_wall_seconds"] / summary["cold"]["median_wall_seconds"]
    evaluation = runs[0]["evaluation"]
    result = {
        "runs": [{k: v for k, v in run.items() if k != "checksums"} for run in runs],
        "summary": summary,
        "warm_over_cold": ratio,
        "identical_outputs": identical,
        "checksums": runs[0]["checksums"],
        "evaluation": evaluation,
        "benchmark_process_rss_bytes": self_rss,
    }
    print(f"\nCPU: {cpu_model()}, {os.cpu_count()} cores; {args.rounds} rounds, interleaved")
    print(f"{'run':<12}{'median s':>10}{'runs (s)':>24}{'peak RSS GiB':>14}")
    for kind in KINDS:
        row = summary[kind]
        walls = ", ".join(f"{w:.1f}" for w in row["wall_seconds"])
        print(
            f"{kind:<12}{row['median_wall_seconds']:>10.1f}{walls:>24}{row['peak_rss_gib']:>14.2f}"
        )
    print(f"warm cache / cold: {ratio:.2f}x; identical outputs in every run: {identical}")
    if evaluation:
        print(f"evaluation: {json.dumps(evaluation)}")
    path = write_result("main_job", result, args.output)
    print(f"wrote {path}")
    if not identical:
        raise SystemExit("the runs wrote different models: the main job is not deterministic")


if __name__ == "__main__":
    main()
