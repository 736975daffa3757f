"""GPTQ on one switch-base expert with and without huge pages for malloc (qmoe_jax/malloc.py), side
by side.

glibc reads its tunables when a process starts, so the two settings cannot share one process:
this script runs child processes, alternately with ``QMOE_JAX_HUGE_PAGES=0`` (4 KiB pages) and with
``glibc.malloc.hugetlb=1`` (what ``python -m qmoe_jax.compress`` re-executes itself with), --rounds
times, swapping which goes first every round so that drift on a shared machine hits both alike.
Each child quantizes one expert the way the calibration pass does (``quantize_expert_group``, the
default unrolled solver, ternary; wi W[3072, 768] and wo W[768, 3072], Hessians from --tokens
synthetic correlated tokens, gptq_grouping.py's layer with one expert), and reports the best of
--repeats calls per matrix and the minor page faults of one call (getrusage). The parent prints
every child's figures, the median expert seconds per setting and their ratio, and writes the JSON.

Where the host does not qualify (not glibc >= 2.35, or transparent huge pages not in madvise mode),
the "on" children run like the "off" ones and say so in the table.

    python benchmarks/malloc_pages.py [--rounds 3] [--repeats 5] [--tokens 8192]
"""

from __future__ import annotations

import os
import sys

import common  # noqa: F401  (first: puts this checkout on sys.path before the import below)

from qmoe_jax import malloc

if (
    __name__ == "__main__" and "--child" in sys.argv
):  # a child measuring with huge pages re-executes first
    malloc.reexec_with_huge_pages(__file__)

import argparse
import json
import pathlib
import resource
import statistics
import subprocess
import time

SETTINGS = {"off": {malloc.OPT_OUT: "0"}, "on": {malloc.OPT_OUT: "1"}}


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--rounds", type=int, default=3, help="pairs of child processes (off and on)"
    )
    parser.add_argument(
        "--repeats", type=int, default=5, help="calls per matrix in each child (best is kept)"
    )
    parser.add_argument(
        "--tokens", type=int, default=8192, help="calibration tokens behind the Hessians"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--out", default=None, help="the JSON result (default benchmarks/results/malloc_pages.json)"
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    for name in ("rounds", "repeats", "tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    return args


def child(args) -> None:
    """One process's measurement, printed as one JSON line."""
    import jax
    import jax.numpy as jnp
    from gptq_grouping import synthetic_layer

    from qmoe_jax.quant import GPTQConfig, GridConfig, quantize_expert_group

    layer = argparse.Namespace(
        seed=args.seed, experts=1, d_model=768, d_ff=3072, tokens=args.tokens
    )
    weights_wi, hessians_wi, weights_wo, hessians_wo = synthetic_layer(layer)
    count = jnp.ones((1,), jnp.int32)
    grid, config = GridConfig(), GPTQConfig()
    result = dict(huge_pages=malloc.huge_pages_status(), jax_version=jax.__version__)
    for name, weights, hessians in (
        ("wi", weights_wi, hessians_wi),
        ("wo", weights_wo, hessians_wo),
    ):

        def call(weights=weights, hessians=hessians):
            return jax.block_until_ready(
                quantize_expert_group(weights, hessians, count, grid, config)
            )

        call()  # compile
        seconds, faults = [], []
        for _ in range(args.repeats):
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            start = time.perf_counter()
            call()
            seconds.append(time.perf_counter() - start)
            faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
        result[f"{name}_seconds"] = min(seconds)
        result[f"{name}_page_faults"] = int(statistics.median(faults))
    result["expert_seconds"] = result["wi_seconds"] + result["wo_seconds"]
    print(json.dumps(result), flush=True)


def run_child(args, setting: str) -> dict:
    here = pathlib.Path(__file__).resolve()
    command = [
        sys.executable,
        str(here),
        "--child",
        "--repeats",
        str(args.repeats),
        "--tokens",
        str(args.tokens),
        "--seed",
        str(args.seed),
    ]
    env = {key: value for key, value in os.environ.items() if key != malloc.TUNABLES}
    env.update(SETTINGS[setting])
    env["PYTHONPATH"] = os.pathsep.join(
        [str(here.parent)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    )
    completed = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if completed.returncode != 0:
        raise SystemExit(
            f"the {setting!r} child failed (exit "
            f"{completed.returncode}):\n{completed.stderr[-2000:]}"
        )
    return dict(json.loads(completed.stdout.strip().splitlines()[-1]), setting=setting)


def main():
    args = parse_args()
    if args.child:
        return child(args)
    from common import cpu_model, write_result  # the parent's only

    load_before = os.getloadavg()
    runs = []
    print(
        f"GPTQ on one switch-base expert ({args.tokens} tokens), malloc huge pages off and on in "
        "alternate child "
        f"processes; {cpu_model()}, {os.cpu_count()} CPUs, load average {load_before[0]:.1f} "
        "(shared machine)"
    )
    print(
        f"{'round':>5} {'pages':>5} {'wi s':>7} {'wo s':>7} {'expert s':>9} {'faults/call wi':>15} "
        f"{'wo':>7}  malloc huge pages"
    )
    for round_index in range(args.rounds):
        order = ("off", "on") if round_index % 2 == 0 else ("on", "off")
        for setting in order:
            run = dict(run_child(args, setting), round=round_index)
            runs.append(run)
            print(
                f"{round_index:>5} {setting:>5} {run['wi_seconds']:>7.3f} "
                f"{run['wo_seconds']:>7.3f} "
                f"{run['expert_seconds']:>9.3f} {run['wi_page_faults']:>15} "
                f"{run['wo_page_faults']:>7}  "
                f"{run['huge_pages']}",
                flush=True,
            )
    medians = {
        setting: statistics.median(
            run["expert_seconds"] for run in runs if run["setting"] == setting
        )
        for setting in SETTINGS
    }
    ratio = medians["on"] / medians["off"]
    print(
        f"median expert seconds: off {medians['off']:.3f}, on {medians['on']:.3f}; on/off "
        f"{ratio:.2f}"
    )
    report = dict(
        args=vars(args),
        runs=runs,
        median_expert_seconds=medians,
        ratio_on_over_off=ratio,
        load_average_before=load_before,
    )
    write_result("malloc_pages", report, args.out)


if __name__ == "__main__":
    main()
