"""Fused CPU kernels vs XLA's dense dot on the same matrix, side by side in one process.

Each W[rows, cols] is i.i.d. synthetic ternary with P(0) = 0.885 and random
per-row (min, max), encoded with the static dictionary (p0 = 0.885); the
dense baselines multiply the same matrix, decoded, in float32 and bfloat16.

  matvec   ops.matvec(w, x), x f32 (and bf16) [cols], vs jnp.dot(W, x) with
           W f32 and W bf16.
  matmul   ops.matmul(w, X) for N tokens X [N, cols], vs the dense f32
           X @ Wᵀ and vs N separate ops.matvec calls in one jitted program.
  encode   weights per second of ``codec.encode`` on one thread (per core).

Times are medians over --repeats rounds; in each round every candidate of a
group runs once, back to back in shuffled order, so load from other processes
hits all of them alike (minimums are in the JSON too). The bf16 matvecs form
a group of their own (see bench_shape). Weights and inputs are
jit arguments.

    python benchmarks/kernels_cpu.py [--quick]
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from common import result_path, write_result

from qmoe_jax.codec import build_dictionary, encode
from qmoe_jax.kernels import ops

P0 = 0.885
SHAPES = ((768, 3072), (3072, 768), (1024, 4096), (4096, 1024), (2080, 6144), (6144, 2080))
TOKENS = (1, 4, 16, 64)
QUICK_SHAPES = ((768, 3072), (6144, 2080))
QUICK_TOKENS = (1, 16)
TARGET_SHAPES = ((6144, 2080), (2080, 6144))


def encode_matrix(codes: np.ndarray, minmax: np.ndarray, dictionary):
    """The one place that picks the encoder (single-threaded: its speed is per core)."""
    return encode(codes, minmax, dictionary, num_threads=1)


def synthetic(rng: np.random.Generator, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray]:
    """I.i.d. ternary codes with P(0) = P0, and per-row (min, max) in bf16."""
    u = rng.random((rows, cols), dtype=np.float32)
    codes = np.where(u < P0, 0, np.where(u < P0 + (1 - P0) / 2, 1, 2)).astype(np.uint8)
    minmax = np.stack([-rng.random(rows), rng.random(rows)], axis=1).astype(ml_dtypes.bfloat16)
    return codes, minmax


def dense_weights(codes: np.ndarray, minmax: np.ndarray) -> np.ndarray:
    values = minmax.astype(np.float32)
    return np.where(codes == 2, values[:, 1:], np.where(codes == 1, values[:, :1], 0.0)).astype(
        np.float32
    )


def side_by_side(candidates: dict[str, Callable[[], Any]], repeats: int) -> dict[str, dict]:
    """Median and min wall time (ms) per candidate: rounds of one call each, in shuffled order."""
    for run in candidates.values():
        for _ in range(3):
            jax.block_until_ready(run())
    samples: dict[str, list[float]] = {name: [] for name in candidates}
    order = np.random.default_rng(0)
    for _ in range(repeats):
        for name in order.permutation(list(candidates)):
            run = candidates[name]
            start = time.perf_counter()
            jax.block_until_ready(run())
            samples[name].append(1e3 * (time.perf_counter() - start))
    return {
        name: dict(median_ms=float(np.median(t)), min_ms=float(np.min(t)))
        for name, t in samples.items()
    }


def bench_shape(
    rng, dictionary, rows: int, cols: int, tokens: tuple[int, ...], repeats: int
) -> dict:
    codes, minmax = synthetic(rng, rows, cols)
    start = time.perf_counter()
    host_w = encode_matrix(codes, minmax, dictionary)
    encode_s = time.perf_counter() - start
    w = jax.device_put(host_w)
    dense = jnp.asarray(dense_weights(codes, minmax))
    dense_bf16 = dense.astype(jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal(cols), jnp.float32)
    x_bf16 = x.astype(jnp.bfloat16)

    kernel_matvec = jax.jit(ops.matvec, static_argnums=2)
    dense_dot = jax.jit(jnp.dot)
    # The bf16 pair takes turns in rounds of its own: XLA:CPU's bf16 dot is
    # slow and compute-bound, and the call right after one runs up to 1.7x
    # slower (benchmarks/kernels_cpu_rotating.py's docstring).
    matvec = side_by_side(
        {
            "kernel_f32": lambda: kernel_matvec(w, x, dictionary),
            "dense_f32": lambda: dense_dot(dense, x),
        },
        repeats,
    ) | side_by_side(
        {
            "kernel_bf16": lambda: kernel_matvec(w, x_bf16, dictionary),
            "dense_bf16": lambda: dense_dot(dense_bf16, x_bf16),
        },
        repeats,
    )
    error = float(jnp.abs(kernel_matvec(w, x, dictionary) - dense_dot(dense, x)).max())

    kernel_matmul = jax.jit(ops.matmul, static_argnums=2)
    dense_matmul = jax.jit(lambda dense, x: x @ dense.T)
    matmul = {}
    for n in tokens:
        xs = jnp.asarray(rng.standard_normal((n, cols)), jnp.float32)
        one_by_one = jax.jit(
            lambda w, xs: jnp.stack([ops.matvec(w, token, dictionary) for token in xs])
        )
        matmul[n] = side_by_side(
            {
                "kernel": lambda xs=xs: kernel_matmul(w, xs, dictionary),
                "dense_f32": lambda xs=xs: dense_matmul(dense, xs),
                "separate_matvecs": lambda xs=xs, one_by_one=one_by_one: one_by_one(w, xs),
            },
            repeats,
        )
    return dict(
        rows=rows,
        cols=cols,
        bits_per_weight=host_w.bits_per_weight(),
        encode_weights_per_s=rows * cols / encode_s,
        matvec=matvec,
        matvec_max_abs_error=error,
        matmul=matmul,
    )


def ratio(result: dict, numerator: str, denominator: str, statistic: str = "median_ms") -> float:
    return result[numerator][statistic] / result[denominator][statistic]


def print_tables(results: list[dict]) -> None:
    print("== matvec: ms (median); ratios are kernel / dense ==")
    print(
        f"{'shape':>10} | {'kernel f32':>10} {'kernel bf16':>11} | {'dense f32':>9} "
        f"{'dense bf16':>10} | {'vs f32':>6} {'vs bf16':>7} | {'encode Mw/s':>11}"
    )
    for r in results:
        m = r["matvec"]
        times = [
            m[name]["median_ms"]
            for name in ("kernel_f32", "kernel_bf16", "dense_f32", "dense_bf16")
        ]
        vs_f32, vs_bf16 = ratio(m, "kernel_f32", "dense_f32"), ratio(m, "kernel_bf16", "dense_bf16")
        print(
            f"{r['rows']:>5}×{r['cols']:<4} | {times[0]:10.3f} {times[1]:11.3f} | {times[2]:9.3f} "
            f"{times[3]:10.3f} | {vs_f32:6.2f} {vs_bf16:7.3f} | "
            f"{r['encode_weights_per_s'] / 1e6:11.1f}"
        )
    print("== matmul: N tokens, ms (median) ==")
    print(
        f"{'shape':>10} {'N':>3} | {'kernel':>8} {'dense f32':>9} {'N matvecs':>9} | "
        f"{'vs dense':>8} {'vs N matvecs':>12}"
    )
    for r in results:
        for n, m in r["matmul"].items():
            times = [m[name]["median_ms"] for name in ("kernel", "dense_f32", "separate_matvecs")]
            vs_dense, vs_matvecs = (
                ratio(m, "kernel", "dense_f32"),
                ratio(m, "kernel", "separate_matvecs"),
            )
            print(
                f"{r['rows']:>5}×{r['cols']:<4} {n:>3} | {times[0]:8.3f} {times[1]:9.3f} "
                f"{times[2]:9.3f} | {vs_dense:8.2f} {vs_matvecs:12.3f}"
            )


def done_criteria(results: list[dict]) -> dict:
    """Issue #2's targets on the 2080×6144 shapes, from medians; the ratio of
    minimums (least disturbed by other processes) is listed next to each."""
    criteria = {}
    for r in results:
        if (r["rows"], r["cols"]) not in TARGET_SHAPES:
            continue
        name = f"{r['rows']}x{r['cols']}"
        matvec = ratio(r["matvec"], "kernel_f32", "dense_f32")
        criteria[f"{name}_matvec_vs_dense_f32"] = matvec
        criteria[f"{name}_matvec_vs_dense_f32_of_minimums"] = ratio(
            r["matvec"], "kernel_f32", "dense_f32", "min_ms"
        )
        criteria[f"{name}_matvec_ok (<= 0.5)"] = matvec <= 0.5
        if 16 in r["matmul"]:
            m = r["matmul"][16]
            vs_dense = ratio(m, "kernel", "dense_f32")
            vs_matvecs = ratio(m, "kernel", "separate_matvecs")
            criteria[f"{name}_matmul16_vs_dense_f32"] = vs_dense
            criteria[f"{name}_matmul16_vs_16_matvecs"] = vs_matvecs
            criteria[f"{name}_matmul16_vs_16_matvecs_of_minimums"] = ratio(
                m, "kernel", "separate_matvecs", "min_ms"
            )
            criteria[f"{name}_matmul16_ok (<= 1.0, <= 0.25)"] = (
                vs_dense <= 1.0 and vs_matvecs <= 0.25
            )
    return criteria


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--quick", action="store_true", help="two shapes, N in {1, 16}, fewer repeats"
    )
    parser.add_argument(
        "--repeats", type=int, default=None, help="timing rounds (default 50, quick 20)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default=result_path("kernels_cpu"), help="the JSON result")
    args = parser.parse_args(argv)
    shapes, tokens = (QUICK_SHAPES, QUICK_TOKENS) if args.quick else (SHAPES, TOKENS)
    repeats = args.repeats or (20 if args.quick else 50)

    dictionary = build_dictionary(P0)
    isa = os.environ.get("QMOE_CPU_ISA") or ops.cpu_isas()[0]
    load_before = os.getloadavg()
    print(
        f"cores: {os.cpu_count()}, kernels: {isa}, load average before: {load_before[0]:.2f} "
        "(shared machine: other processes add noise)"
    )
    rng = np.random.default_rng(args.seed)
    results = [bench_shape(rng, dictionary, rows, cols, tokens, repeats) for rows, cols in shapes]
    print_tables(results)
    criteria = done_criteria(results)
    print("== done criteria (medians) ==")
    for name, value in criteria.items():
        print(f"{name}: {value:.3f}" if isinstance(value, float) else f"{name}: {value}")

    write_result(
        "kernels_cpu",
        dict(
            kernels=isa,
            repeats=repeats,
            load_average_before=load_before,
            results=results,
            done_criteria=criteria,
        ),
        args.output,
    )


if __name__ == "__main__":
    main()
