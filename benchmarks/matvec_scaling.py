"""Where the CPU matvec's time goes: codewords per second on the cores it is given.

Times ``ops.matvec`` and XLA's dense f32 dot on the same synthetic ternary
matrices (P(0) = 0.885, static dictionary) back to back, medians of --calls
calls each. Run it once as is and once pinned to one core; the ratio of the
two codeword rates is how well the kernel's row split over XLA's thread pool
scales:

    python benchmarks/matvec_scaling.py
    taskset -c 0 python benchmarks/matvec_scaling.py

With --isas, each instruction set the CPU kernels have here (``ops.cpu_isas()``) is timed on the
same matrices, taking turns in shuffled rounds of one call each (QMOE_CPU_ISA is read at each call),
so that their ratio comes from one stretch of the machine: on an AVX-512 CPU this says whether the
AVX-512 or the AVX2 kernel is the faster (``benchmarks/gpu_check.sh`` runs it on its host):

    python benchmarks/matvec_scaling.py --isas

The compressed matrices are placed on the device once (``jax.device_put``), as a
model's parameters are: a CompressedMatrix of NumPy arrays would be copied to
the device at every call, and that copy would be timed too. Prints a table and
writes JSON to --output (default benchmarks/results/matvec_scaling.json).
"""

from __future__ import annotations

import argparse
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from common import cpu_model, restored_isa, result_path, usable_cores, write_result
from kernels_cpu import P0, dense_weights, encode_matrix, side_by_side, synthetic

from qmoe_jax.codec import build_dictionary
from qmoe_jax.kernels import ops

SHAPES = ((2080, 6144), (6144, 2080), (768, 3072), (3072, 768))


def median_ms(fn, *args, calls: int) -> float:
    fn(*args).block_until_ready()
    times = []
    for _ in range(calls):
        started = time.perf_counter()
        fn(*args).block_until_ready()
        times.append(time.perf_counter() - started)
    return float(np.median(times)) * 1e3


def isa_medians_ms(fn, *args, isas: list[str], calls: int) -> dict[str, float]:
    """Median ms of fn(*args) under each QMOE_CPU_ISA, the ISAs taking turns in shuffled rounds of
    one call each (kernels_cpu.side_by_side; "auto": the kernels' own choice, as when the variable
    is unset)."""

    def under(isa):
        def run():
            os.environ["QMOE_CPU_ISA"] = isa
            return fn(*args)

        return run

    with restored_isa():
        times = side_by_side({isa: under(isa) for isa in isas}, calls)
    return {isa: t["median_ms"] for isa, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument(
        "--isas",
        action="store_true",
        help="time every instruction set the kernels have here, taking turns",
    )
    parser.add_argument("--output", default=result_path("matvec_scaling"), help="the JSON result")
    args = parser.parse_args()
    dictionary = build_dictionary(P0)
    rng = np.random.default_rng(0)
    kernel = jax.jit(lambda w, x: ops.matvec(w, x, dictionary))
    dense = jax.jit(lambda w, x: w @ x)
    isas = ops.cpu_isas() if args.isas else [os.environ.get("QMOE_CPU_ISA") or "auto"]
    print(
        f"CPU {cpu_model()}; cores available: {usable_cores()}, jax "
        f"{jax.__version__}, "
        f"kernels here: {ops.cpu_isas()}, timed: {isas}"
    )
    print(
        f"{'W':>10} {'codewords':>10} {'ISA':>9} {'kernel ms':>10} {'M cw/s':>8} {'dense ms':>9} "
        f"{'ratio':>6}"
    )
    rows_out = []
    for rows, cols in SHAPES:
        codes, minmax = synthetic(rng, rows, cols)
        w = jax.device_put(encode_matrix(codes, minmax, dictionary))
        x = jnp.asarray(rng.standard_normal(cols).astype(np.float32))
        weights = jnp.asarray(dense_weights(codes, minmax))
        codewords = int(np.asarray(w.row_offsets)[-1])
        kernel_ms = isa_medians_ms(kernel, w, x, isas=isas, calls=args.calls)
        d = median_ms(dense, weights, x, calls=args.calls)
        for isa, k in kernel_ms.items():
            print(
                f"{rows:>5}×{cols:<4} {codewords:>10} {isa:>9} {k:>10.3f} "
                f"{codewords / k / 1e3:>8.0f} "
                f"{d:>9.3f} {k / d:>6.2f}"
            )
            rows_out.append(
                dict(
                    rows=rows,
                    cols=cols,
                    codewords=codewords,
                    isa=isa,
                    kernel_ms=k,
                    codewords_per_s=codewords / k * 1e3,
                    dense_ms=d,
                    ratio=k / d,
                )
            )
    write_result(
        "matvec_scaling",
        dict(calls=args.calls, kernels_here=ops.cpu_isas(), timed=isas, rows=rows_out),
        args.output,
    )


if __name__ == "__main__":
    main()
