"""Expert grouping: time to GPTQ-quantize one sparse layer with |E| experts per call (QMoE Table 1).

One switch-base-like sparse layer (E experts, wi: W[d_ff, d_model], wo: W[d_model, d_ff]
in y = W·x orientation) with synthetic correlated inputs; its Hessians are built once
and every group size quantizes the same layer with `quantize_expert_group`, |E|
experts per call, one call after the other (each call waits for its result, as the
calibration pass does). The paper's figures (base-128, A6000 GPU): 174.1 s at |E| = 1,
28.8 s at |E| = 16, 6.0x.

Each group size runs in two modes (--modes): "sequential", the group's experts one
after another inside the call (lax.map, quantize_expert_group's default on CPU), and
"vmapped", one batched program (the default on accelerators); both give the same bits.
Reported per mode and group size: layer time (best of --repeats, the cases taking
turns so that they see the same load; wall seconds and the process's CPU seconds),
speedups vs the first group size of the same mode, compile time (first call minus a
warm call, for wi and wo; never part of the layer time), the time in the Cholesky
factorizations alone (`hessian_factor`, grouped the same way; the rest is the column
sweep), and the
achieved FLOP rate as a fraction of this machine's dense float32 matmul rate
measured in the same run (jnp.dot, 2048x2048, best of before and after), per wall
second and per CPU second. The machine is shared with other work: wall times swing
with the load, which is recorded with the numbers; the CPU-second figures are the
steadier measure of the work done.

FLOPs counted are those the solver executes per matrix (rows x cols, cols padded to
np, nested block sizes (128, 16, 1)): Cholesky cols^3/3, and the lazy updates of
every block level, 2·rows·np·(np + 128 + 16) with a fori_loop over the outer blocks
(full-width updates: the upper-triangular structure makes about half of the top
level's products zeros), rows·np·(np − 128) + 2·rows·np·(128 + 16) with the default
unrolled outer blocks (GPTQConfig.unroll_blocks: left-looking, each block's
corrections from the columns before it only). The
blockwise Cholesky executes somewhat more than cols^3/3 (11.3 against 9.8 GFLOP at
cols = 3072; benchmarks/gptq_rate.py counts it exactly). The minimal count
(cols^3/3 + rows·cols^2) is reported beside it.

The solver calls no LAPACK (quant/linalg.py's Cholesky is plain lax). OpenBLAS, which
numpy may use for the synthetic data, still runs with OPENBLAS_NUM_THREADS=1 unless the
environment sets it: its own thread pool, next to XLA's, collapsed when the cores were
oversubscribed (docs/measurements.md, gptq_grouping.py, has the measurement).

    python benchmarks/gptq_grouping.py [--quick] [--experts 16] [--d_model 768] [--d_ff 3072] \\
        [--modes sequential,vmapped]
"""

from __future__ import annotations

import argparse
import functools
import os
import time

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import common  # noqa: F401  (first: puts this checkout on sys.path before the import below)

from qmoe_jax import malloc

if __name__ == "__main__":  # time the solver with the malloc settings of the compression CLI
    malloc.reexec_with_huge_pages(__file__)

import jax
import jax.numpy as jnp
import numpy as np
from common import result_path, write_result

from qmoe_jax.quant import (
    GPTQConfig,
    GridConfig,
    expert_hessians,
    hessian_factor,
    quantize_expert_group,
)

PAPER = {"model": "switch-base-128, one sparse layer, A6000", "seconds": {1: 174.1, 16: 28.8}}
MATMUL_SIZE = 2048


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--d_model", type=int, default=768)
    parser.add_argument("--d_ff", type=int, default=3072)
    parser.add_argument(
        "--tokens", type=int, default=1024, help="calibration tokens per expert (synthetic)"
    )
    parser.add_argument("--group_sizes", default="1,4,16")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--modes",
        default="sequential,vmapped",
        help="how a group's experts run in a call: one after another (lax.map, the CPU default) "
        "and/or vmapped (quantize_expert_group's sequential argument)",
    )
    parser.add_argument(
        "--quick", action="store_true", help="d_model 256, d_ff 1024, 8 experts, 256 tokens"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=result_path("gptq_grouping"), help="the JSON result")
    args = parser.parse_args()
    if args.quick:
        args.experts, args.d_model, args.d_ff, args.tokens, args.group_sizes = (
            8,
            256,
            1024,
            256,
            "1,4,8",
        )
    args.group_sizes = [int(size) for size in args.group_sizes.split(",")]
    args.modes = args.modes.split(",")
    if not args.modes or set(args.modes) - {"sequential", "vmapped"}:
        parser.error(
            "--modes takes sequential and/or vmapped, comma-separated; got "
            f"{','.join(args.modes)!r}"
        )
    bad = [size for size in args.group_sizes if args.experts % size]
    if bad:
        parser.error(f"group sizes {bad} do not divide --experts {args.experts}")
    return args


def synthetic_layer(args):
    """Weights and Hessians of one sparse layer: (W_wi [E, f, d], H_wi [E, d, d], W_wo [E, d, f],
    H_wo [E, f, f])."""
    rng = np.random.default_rng(args.seed)
    experts, d_model, d_ff, tokens = args.experts, args.d_model, args.d_ff, args.tokens
    kernel_wi = (
        rng.standard_normal((experts, d_model, d_ff), np.float32) / np.sqrt(d_model)
    ).astype(np.float32)
    kernel_wo = (rng.standard_normal((experts, d_ff, d_model), np.float32) / np.sqrt(d_ff)).astype(
        np.float32
    )
    mixing = rng.standard_normal((d_model // 8, d_model), np.float32)
    latent = rng.standard_normal((experts, tokens, d_model // 8), np.float32)
    inputs = latent @ mixing + 0.5 * rng.standard_normal((experts, tokens, d_model), np.float32)
    hidden = np.maximum(inputs @ kernel_wi, 0.0)
    mask = jnp.ones((experts, tokens), bool)
    hessians_wi, _ = jax.jit(expert_hessians)(inputs, mask)
    hessians_wo, _ = jax.jit(expert_hessians)(hidden, mask)
    return (
        jnp.asarray(kernel_wi.transpose(0, 2, 1)),
        hessians_wi,
        jnp.asarray(kernel_wo.transpose(0, 2, 1)),
        hessians_wo,
    )


def executed_flops(rows: int, cols: int, config: GPTQConfig) -> float:
    """Cholesky cols^3/3 plus the lazy updates the sweep executes: every level full width, except
    the outer one when unrolled (``config.unroll_blocks``: block b reads only the columns before it)
    and the inside of each outer block when the native CPU kernel runs it (``config.native_block``:
    each column updates only the block's later columns, rows·m·(m − 1) per block of m)."""
    block_sizes = config.block_sizes
    padded = -(-cols // block_sizes[0]) * block_sizes[0]
    blocks = padded // block_sizes[0]
    outer = (
        float(rows) * block_sizes[0] ** 2 * blocks * (blocks - 1)
        if config.unroll_blocks
        else 2.0 * rows * padded * padded
    )
    if config.native_block and len(block_sizes) > 1:
        inner = float(rows) * padded * (block_sizes[0] - 1)
    else:
        inner = sum(2.0 * rows * padded * parent for parent in block_sizes[:-1])
    return cols**3 / 3 + outer + inner


def minimal_flops(rows: int, cols: int) -> float:
    return cols**3 / 3 + float(rows) * cols**2


def matmul_rate() -> tuple[float, float]:
    """Dense float32 matmul rate of this machine (jnp.dot 2048x2048, best of 5): (FLOP/s, FLOP per
    CPU second)."""
    a = jnp.asarray(
        np.random.default_rng(1).standard_normal((MATMUL_SIZE, MATMUL_SIZE), np.float32)
    )
    dot = jax.jit(jnp.dot)
    dot(a, a).block_until_ready()
    wall, cpu, _ = min(timed(lambda: dot(a, a).block_until_ready()) for _ in range(5))
    return 2.0 * MATMUL_SIZE**3 / wall, 2.0 * MATMUL_SIZE**3 / cpu


def timed(fn):
    wall, cpu = time.perf_counter(), time.process_time()
    result = fn()
    return time.perf_counter() - wall, time.process_time() - cpu, result


def run_layer(matrices, tokens, group_size, grid, config, sequential: bool):
    """Quantize every matrix of the layer in groups of group_size experts; returns (wall s, CPU s,
    fallbacks)."""

    def layer():
        fallbacks = 0
        for weights, hessians in matrices:
            for start in range(0, weights.shape[0], group_size):
                group = slice(start, start + group_size)
                result = quantize_expert_group(
                    weights[group],
                    hessians[group],
                    tokens[group],
                    grid,
                    config,
                    sequential=sequential,
                )
                fallbacks += int(jax.block_until_ready(result).fallback.sum())
        return fallbacks

    wall, cpu, fallbacks = timed(layer)
    return wall, cpu, fallbacks


def compile_seconds(matrices, tokens, group_size, grid, config, sequential: bool) -> float:
    """First call (compile + run) minus a warm call, summed over wi and wo."""
    total = 0.0
    for weights, hessians in matrices:
        group = slice(0, group_size)
        call = functools.partial(
            quantize_expert_group,
            weights[group],
            hessians[group],
            tokens[group],
            grid,
            config,
            sequential=sequential,
        )
        first, _, _ = timed(lambda call=call: jax.block_until_ready(call()))
        warm, _, _ = timed(lambda call=call: jax.block_until_ready(call()))
        total += max(first - warm, 0.0)
    return total


def factor_seconds(
    matrices, group_size, damping, native: bool = True, sequential: bool = False
) -> tuple[float, float]:
    """(wall, CPU) seconds of the Cholesky factorizations alone, for the whole layer, a group per
    call as the solver runs them (``sequential``: one after another, else vmapped; ``native``: the
    diagonal blocks in the CPU kernel, as GPTQConfig.native_cholesky)."""
    one = functools.partial(hessian_factor, native=native)
    factor = jax.jit((lambda group: jax.lax.map(one, group)) if sequential else jax.vmap(one))
    wall = cpu = 0.0
    for _, hessians in matrices:
        diagonal_mean = jnp.mean(jnp.diagonal(hessians, axis1=1, axis2=2), axis=1)
        damped = hessians + damping * diagonal_mean[:, None, None] * jnp.eye(hessians.shape[-1])
        factor(damped[:group_size]).block_until_ready()
        for start in range(0, hessians.shape[0], group_size):
            group = damped[start : start + group_size]
            group_wall, group_cpu, _ = timed(lambda group=group: factor(group).block_until_ready())
            wall, cpu = wall + group_wall, cpu + group_cpu
    return wall, cpu


def main():
    args = parse_args()
    grid, config = GridConfig(), GPTQConfig()
    load_before = os.getloadavg()
    huge_pages = malloc.huge_pages_status()
    weights_wi, hessians_wi, weights_wo, hessians_wo = synthetic_layer(args)
    matrices = [(weights_wi, hessians_wi), (weights_wo, hessians_wo)]
    tokens = jnp.full((args.experts,), args.tokens, jnp.int32)
    flops = args.experts * sum(executed_flops(w.shape[1], w.shape[2], config) for w, _ in matrices)
    flops_min = args.experts * sum(minimal_flops(w.shape[1], w.shape[2]) for w, _ in matrices)
    rate, rate_per_cpu = matmul_rate()

    cases = [(mode, size) for mode in args.modes for size in args.group_sizes]
    compile_s = {
        case: compile_seconds(matrices, tokens, case[1], grid, config, case[0] == "sequential")
        for case in cases
    }
    layer_runs = {case: [] for case in cases}
    factor_runs = {case: [] for case in cases}
    for _ in range(args.repeats):
        for mode, size in cases:
            sequential = mode == "sequential"
            layer_runs[mode, size].append(
                run_layer(matrices, tokens, size, grid, config, sequential)
            )
            factor_runs[mode, size].append(
                factor_seconds(matrices, size, config.damping, sequential=sequential)
            )
    rate, rate_per_cpu = np.maximum((rate, rate_per_cpu), matmul_rate())

    rows = []
    for case in cases:
        wall, cpu = min(run[0] for run in layer_runs[case]), min(run[1] for run in layer_runs[case])
        rows.append(
            dict(
                mode=case[0],
                group_size=case[1],
                seconds=wall,
                cpu_seconds=cpu,
                compile_seconds=compile_s[case],
                factor_seconds=min(run[0] for run in factor_runs[case]),
                factor_cpu_seconds=min(run[1] for run in factor_runs[case]),
                gflops_per_s=flops / wall / 1e9,
                fraction_of_matmul=flops / wall / rate,
                fraction_of_matmul_cpu=flops / cpu / rate_per_cpu,
                fallbacks=layer_runs[case][0][2],
            )
        )
    for row in rows:  # against |E| = the first group size, same mode
        first = next(other for other in rows if other["mode"] == row["mode"])
        row["speedup"] = first["seconds"] / row["seconds"]
        row["speedup_cpu"] = first["cpu_seconds"] / row["cpu_seconds"]

    print(
        f"GPTQ one sparse layer: {args.experts} experts, d_model {args.d_model}, d_ff {args.d_ff}, "
        f"{args.tokens} tokens/expert, ternary, block sizes {config.block_sizes}"
    )
    print(
        f"dense f32 matmul ({MATMUL_SIZE}^2): {rate / 1e9:.1f} GFLOP/s, {rate_per_cpu / 1e9:.1f} "
        "GFLOP per CPU s; "
        f"GPTQ FLOPs executed {flops / 1e9:.1f} G (minimal {flops_min / 1e9:.1f} G); jax "
        f"{jax.__version__}, "
        f"{jax.device_count()} device(s), {os.cpu_count()} CPUs, "
        f"OPENBLAS_NUM_THREADS={os.environ['OPENBLAS_NUM_THREADS']}, "
        f"load average {load_before[0]:.1f} (shared machine); malloc huge pages {huge_pages}"
    )
    print(
        f"{'mode':>10} {'|E|':>4} {'layer s':>8} {'speedup':>8} {'cpu s':>7} {'speedup':>8} "
        f"{'Cholesky s':>11} {'(cpu s)':>8} "
        f"{'GFLOP/s':>8} {'of matmul':>10} {'(per cpu s)':>12} {'compile s':>10}"
    )
    for row in rows:
        print(
            f"{row['mode']:>10} {row['group_size']:>4} {row['seconds']:>8.2f} "
            f"{row['speedup']:>7.2f}x {row['cpu_seconds']:>7.2f} "
            f"{row['speedup_cpu']:>7.2f}x {row['factor_seconds']:>11.2f} "
            f"{row['factor_cpu_seconds']:>8.2f} "
            f"{row['gflops_per_s']:>8.1f} {row['fraction_of_matmul']:>10.1%} "
            f"{row['fraction_of_matmul_cpu']:>12.1%} "
            f"{row['compile_seconds']:>10.1f}"
        )
    largest = rows[-1]
    sweep_share = 1 - largest["factor_cpu_seconds"] / largest["cpu_seconds"]
    print(
        f"where the time goes at |E|={largest['group_size']}, {largest['mode']}: Cholesky "
        f"{1 - sweep_share:.0%} of the CPU seconds, "
        f"column sweep (lazy block updates and per-column loops) {sweep_share:.0%}"
    )
    print(
        f"paper ({PAPER['model']}): |E|=1 {PAPER['seconds'][1]} s, |E|=16 {PAPER['seconds'][16]} "
        "s, "
        f"{PAPER['seconds'][1] / PAPER['seconds'][16]:.1f}x"
    )

    report = dict(
        args=vars(args),
        malloc_huge_pages=huge_pages,
        block_sizes=config.block_sizes,
        matmul_gflops_per_s=rate / 1e9,
        matmul_gflops_per_cpu_s=rate_per_cpu / 1e9,
        gflops_executed=flops / 1e9,
        gflops_minimal=flops_min / 1e9,
        rows=rows,
        paper=PAPER,
        load_average_before=load_before,
        devices=jax.device_count(),
        openblas_num_threads=os.environ["OPENBLAS_NUM_THREADS"],
    )
    write_result("gptq_grouping", report, args.out)


if __name__ == "__main__":
    main()
