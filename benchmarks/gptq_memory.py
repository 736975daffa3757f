"""Peak memory of one GPTQ call over a group of experts, measured, against the estimate that sizes
the calls.

The calibration pass splits a group into calls of at most ``--gptq_memory_mb``
(``ExpertCompressionConfig.experts_per_call``, calibration/expert_groups.py), by
``gptq_call_bytes``:
  vmapped     E × 4·cols·(HESSIAN_COPIES·cols + WEIGHT_COPIES·rows) bytes (inputs included);
  sequential  E × (4·cols·(cols + rows) + rows·cols) for every expert's Hessian, weights and codes,
              + 4·cols·(SEQUENTIAL_HESSIAN_COPIES·cols + SEQUENTIAL_WEIGHT_COPIES·rows) for the one
              expert being solved.
This script measures what a call really takes. Each case runs in a fresh child process: it places
E experts' weights W[rows, cols] and a positive definite Hessian each on the device, compiles
``quantize_expert_group``'s program ahead of time, resets the process's peak RSS
(``/proc/self/clear_refs``, Linux), runs the call once and reads the peak (VmHWM). Reported: the
peak above the RSS just before the call (the working memory), that plus the inputs (what the
estimate counts), and the estimate; the estimate should be at or above the measured total.

CPU only (RSS is host memory); Linux only (/proc). The children run with the compression CLI's
malloc settings (huge pages where they help, two arenas: qmoe_jax/malloc.py). Shapes: switch-base's
wi (W[3072, 768]) and wo (W[768, 3072]) unless --shapes says otherwise.

    python benchmarks/gptq_memory.py [--experts 1,2,4,8] [--modes sequential,vmapped] \\
        [--shapes 3072x768,768x3072]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import common  # noqa: F401  (first: puts this checkout on sys.path before the import below)

from qmoe_jax import malloc

if (
    __name__ == "__main__" and "--child" in sys.argv
):  # each child measures with the compression CLI's malloc
    malloc.reexec_with_huge_pages(__file__)
    malloc.limit_arenas()


def parse_args():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--experts", default="1,2,4,8", help="group sizes E (comma-separated)")
    parser.add_argument("--modes", default="sequential,vmapped")
    parser.add_argument(
        "--shapes", default="3072x768,768x3072", help="W rows x cols (comma-separated)"
    )
    parser.add_argument(
        "--out", default=None, help="the JSON result (default benchmarks/results/gptq_memory.json)"
    )
    parser.add_argument(
        "--child", nargs=4, metavar=("E", "ROWS", "COLS", "MODE"), help=argparse.SUPPRESS
    )
    return parser.parse_args()


def _status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))


def child(experts: int, rows: int, cols: int, mode: str) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from qmoe_jax.quant import GPTQConfig, GridConfig, group

    rng = np.random.default_rng(0)
    weights = jnp.asarray(rng.standard_normal((experts, rows, cols), np.float32))
    inputs = rng.standard_normal((2 * cols, cols), np.float32)
    hessians = jnp.asarray(np.broadcast_to(inputs.T @ inputs, (experts, cols, cols)))
    del inputs
    tokens = jnp.full((experts,), 2 * cols, jnp.int32)
    compiled = group._gptq_experts_jit.lower(
        weights,
        hessians,
        tokens,
        grid=GridConfig(),
        config=GPTQConfig(),
        sequential=mode == "sequential",
    ).compile()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    before = _status_bytes("VmRSS")
    jax.block_until_ready(compiled(weights, hessians, tokens))
    return dict(
        working_bytes=_status_bytes("VmHWM") - before,
        input_bytes=4 * experts * cols * (cols + rows),
    )


def main():
    args = parse_args()
    if args.child:
        experts, rows, cols, mode = args.child
        print(json.dumps(child(int(experts), int(rows), int(cols), mode)))
        return
    from common import cpu_model, write_result  # the parent's only: children import no more

    from qmoe_jax.calibration.expert_groups import gptq_call_bytes

    mib = 1 << 20
    rows_out = []
    print(f"CPU: {cpu_model()}")
    print(
        f"{'W':>10} {'mode':>10} {'E':>3} {'working MiB':>12} {'+ inputs MiB':>13} "
        f"{'estimate MiB':>13} {'est/meas':>9}"
    )
    for shape in args.shapes.split(","):
        rows, cols = (int(n) for n in shape.split("x"))
        for mode in args.modes.split(","):
            for experts in (int(n) for n in args.experts.split(",")):
                done = subprocess.run(
                    [sys.executable, __file__, "--child", str(experts), str(rows), str(cols), mode],
                    capture_output=True,
                    text=True,
                    check=True,
                )
                measured = json.loads(done.stdout.strip().splitlines()[-1])
                total = measured["working_bytes"] + measured["input_bytes"]
                guess = gptq_call_bytes(rows, cols, experts, sequential=mode == "sequential")
                row = dict(
                    rows=rows,
                    cols=cols,
                    mode=mode,
                    experts=experts,
                    **measured,
                    total_bytes=total,
                    estimate_bytes=guess,
                )
                rows_out.append(row)
                print(
                    f"{shape:>10} {mode:>10} {experts:>3} {measured['working_bytes'] / mib:12.1f} "
                    f"{total / mib:13.1f} {guess / mib:13.1f} {guess / total:9.2f}",
                    flush=True,
                )
    write_result("gptq_memory", dict(rows=rows_out), args.out)


if __name__ == "__main__":
    main()
