"""Where the CPU matvec's time goes: codewords per second on the cores it is given.

Times ``ops.matvec`` and XLA's dense f32 dot on the same synthetic ternary
matrices (P(0) = 0.885, static dictionary) back to back, medians of --calls
calls each. Run it once as is and once pinned to one core; the ratio of the
two codeword rates is how well the kernel's row split over XLA's thread pool
scales:

    python benchmarks/matvec_scaling.py
    taskset -c 0 python benchmarks/matvec_scaling.py
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

import compressed_data  # noqa: E402

from qmoe_jax import ops  # noqa: E402
from qmoe_jax.codec import build_dictionary  # noqa: E402

SHAPES = ((2080, 6144), (6144, 2080), (768, 3072), (3072, 768))


def median_ms(fn, *args, calls: int) -> float:
    fn(*args).block_until_ready()
    times = []
    for _ in range(calls):
        started = time.perf_counter()
        fn(*args).block_until_ready()
        times.append(time.perf_counter() - started)
    return float(np.median(times)) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=300)
    args = parser.parse_args()
    dictionary = build_dictionary(0.885)
    rng = np.random.default_rng(0)
    kernel = jax.jit(lambda w, x: ops.matvec(w, x, dictionary))
    dense = jax.jit(lambda w, x: w @ x)
    print(f"cores available: {len(os.sched_getaffinity(0))}, jax {jax.__version__}, kernels: {ops.cpu_isas()}")
    print(f"{'W':>10} {'codewords':>10} {'kernel ms':>10} {'M cw/s':>8} {'dense ms':>9} {'ratio':>6}")
    for rows, cols in SHAPES:
        w, weights = compressed_data.matrix(rng, dictionary, rows, cols)
        x = jnp.asarray(rng.standard_normal(cols).astype(np.float32))
        weights = jnp.asarray(weights)
        codewords = int(np.asarray(w.row_offsets)[-1])
        k = median_ms(kernel, w, x, calls=args.calls)
        d = median_ms(dense, weights, x, calls=args.calls)
        print(f"{rows:>5}×{cols:<4} {codewords:>10} {k:>10.3f} {codewords / k / 1e3:>8.0f} {d:>9.3f} {k / d:>6.2f}")


if __name__ == "__main__":
    main()
