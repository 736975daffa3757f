"""Fused CPU kernels vs XLA's dense dot under a model's access pattern: many experts, each used once
per step.

A model never multiplies one matrix back to back. At each decoding step a
sparse layer touches one expert per token, and a model holds far more
experts than any cache. Here every candidate runs over a rotating set of E
distinct expert matrices whose dense float32 total is at least 4x the
machine's last-level cache (read from sysfs), so each matrix comes from
memory, as in a forward pass:

  matvec     one token per expert: ops.matvec(w_e, x) against jnp.dot(W_e, x)
             with W_e float32 and bfloat16; per expert, one call each.
  stacked    the same products in one call: ops.matvec on the stack of the E
             experts with one token each, against one einsum over the dense
             f32 stack. A standalone call pays costs of its own (XLA's
             dispatch, waking the thread pool) that a program of many
             operations, such as a decoding step, pays once: the two figures
             bracket the kernel's cost inside a model.
  matmul16   16 tokens per expert: ops.matmul(w_e, X) against X @ W_eᵀ (f32).
  layer      a whole sparse layer's step with one token routed to each of E
             experts: h = relu(wi · x), y = wo · h for every expert at once
             (one ops.matmul per matrix on the expert stack, against the same
             einsums on the dense f32 and bf16 stacks).
  hot        the same one-token matvec called back to back on one matrix (the
             figure kernels_cpu.py reports), kept for comparison.

Matrices are i.i.d. synthetic ternary (P(0) = 0.885, static dictionary), as in
kernels_cpu.py. Per-expert calls are dispatched asynchronously one expert after
the other and waited for once per round; a trivial jitted call timed the same
way gives the dispatch floor. Candidates take turns in shuffled order each
round; figures are medians over rounds (minimums in the JSON). XLA:CPU's
bfloat16 dots take turns only with the kernel's own bf16 (or f32) call, in
rounds of their own: they are slow and compute-bound, and whatever runs right
after one slows down, even after a sleep (docs/measurements.md, "Where the
kernel's time goes").

Each figure has its physical limit beside it: the machine's memory bandwidth,
measured here (a multi-threaded copy, and XLA's dense dot over a 512 MB
matrix). For the dense dots that is the matrix's bytes over that rate; for the
kernel, codewords per second and the code stream's bytes per second.

--diagnose times the one-token matvec back to back, after a dense dot on
another matrix (as kernels_cpu.py interleaves them), after a plain memory
sweep of 2x the last-level cache (no XLA work), and after a 2 ms sleep (the
thread pool idles), to separate cache state from thread wake-up.

    python benchmarks/kernels_cpu_rotating.py [--quick] [--diagnose]
"""

from __future__ import annotations

import argparse
import math
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from common import cpu_model, last_level_cache, memory_bandwidth, result_path, write_result
from kernels_cpu import P0, dense_weights, encode_matrix, side_by_side, synthetic

from qmoe_jax.codec import CompressedExperts, build_dictionary
from qmoe_jax.kernels import ops

# (d_model, d_ff) of switch-base and switch-c; wi is [d_ff, d_model], wo [d_model, d_ff] (y = W·x).
MODELS = {"switch-base": (768, 3072), "switch-c": (2080, 6144)}
LAYER_EXPERTS = 16
MATMUL_TOKENS = 16


def rotation_size(matrix_bytes: int, cache_bytes: int, minimum: int) -> int:
    """Experts whose dense f32 total is at least 4x the last-level cache (and at least
    ``minimum``)."""
    return max(minimum, math.ceil(4 * max(cache_bytes, 1) / matrix_bytes))


def expert_set(rng, dictionary, experts: int, rows: int, cols: int):
    """E compressed matrices and their dense f32 twins, built one at a time."""
    compressed, dense = [], []
    for _ in range(experts):
        codes, minmax = synthetic(rng, rows, cols)
        compressed.append(encode_matrix(codes, minmax, dictionary))
        dense.append(dense_weights(codes, minmax))
    return compressed, np.stack(dense)


def over_experts(fn, weights: list, x) -> callable:
    """Runs fn(w, x) for every w in turn (asynchronous dispatch), then waits for all."""

    def run():
        jax.block_until_ready([fn(w, x) for w in weights])

    return run


def bench_matrix(rng, dictionary, rows, cols, cache, bandwidth, repeats, minimum_experts):
    matrix_bytes = rows * cols * 4
    experts = rotation_size(matrix_bytes, cache["bytes"], minimum_experts)
    compressed, dense = expert_set(rng, dictionary, experts, rows, cols)
    w = [jax.device_put(m) for m in compressed]
    dense_f32 = [jnp.asarray(d) for d in dense]
    dense_bf16 = [d.astype(jnp.bfloat16) for d in dense_f32]
    stack = jax.device_put(CompressedExperts.stack(compressed))
    dense_stack = jnp.asarray(dense)
    del dense
    x = jnp.asarray(rng.standard_normal(cols), jnp.float32)
    xs = jnp.asarray(rng.standard_normal((MATMUL_TOKENS, cols)), jnp.float32)
    kernel_matvec = jax.jit(lambda w, x: ops.matvec(w, x, dictionary))
    kernel_matmul = jax.jit(lambda w, x: ops.matmul(w, x, dictionary))
    dot = jax.jit(jnp.dot)
    dense_matmul = jax.jit(lambda d, x: x @ d.T)
    x_stack = jnp.asarray(rng.standard_normal((experts, cols)), jnp.float32)
    dense_stacked = jax.jit(lambda d, x: jnp.einsum("erc,ec->er", d, x))
    floor = jax.jit(lambda a, x: x + 1.0)
    tiny = [jnp.zeros(1)] * experts
    error = max(float(jnp.abs(kernel_matvec(m, x) - dot(d, x)).max()) for m, d in zip(w, dense_f32))
    stacked = kernel_matvec(stack, x_stack) - dense_stacked(dense_stack, x_stack)
    error = max(error, float(jnp.abs(stacked).max()))

    times = side_by_side(
        {
            "kernel_f32": over_experts(kernel_matvec, w, x),
            "dense_f32": over_experts(dot, dense_f32, x),
            "kernel_16": over_experts(kernel_matmul, w, xs),
            "dense_f32_16": over_experts(dense_matmul, dense_f32, xs),
            "kernel_stacked": lambda: kernel_matvec(stack, x_stack),
            "dense_f32_stacked": lambda: dense_stacked(dense_stack, x_stack),
            "dispatch_floor": over_experts(floor, tiny, jnp.zeros(1)),
        },
        repeats,
    )
    # XLA:CPU's bfloat16 dots are slow and compute-bound; whatever runs right
    # after one measurably slows down (see the module docstring), so they take
    # turns only with the kernel's bf16 call, in rounds of their own.
    times |= side_by_side(
        {
            "kernel_bf16": over_experts(kernel_matvec, w, x.astype(jnp.bfloat16)),
            "dense_bf16": over_experts(dot, dense_bf16, x.astype(jnp.bfloat16)),
        },
        repeats,
    )
    per_expert = {
        name: {key: value / experts for key, value in t.items()} for name, t in times.items()
    }  # ms
    hot = side_by_side(
        {
            "kernel_f32": lambda: kernel_matvec(w[0], x).block_until_ready(),
            "dense_f32": lambda: dot(dense_f32[0], x).block_until_ready(),
        },
        repeats * 4,
    )
    codewords = int(np.asarray(compressed[0].row_offsets)[-1])
    kernel_s = per_expert["kernel_f32"]["median_ms"] / 1e3
    return {
        "rows": rows,
        "cols": cols,
        "experts": experts,
        "rotation_dense_f32_bytes": experts * matrix_bytes,
        "bits_per_weight": compressed[0].bits_per_weight(),
        "codewords": codewords,
        "matvec_max_abs_error": error,
        "per_expert": per_expert,
        "hot": hot,
        "kernel_codewords_per_s": codewords / kernel_s,
        "kernel_code_gb_s": 2 * codewords / kernel_s / 1e9,
        "dense_f32_gb_s": matrix_bytes / per_expert["dense_f32"]["median_ms"] / 1e6,
        "dense_f32_memory_bound_s": matrix_bytes / (bandwidth["dot_read_gb_s"] * 1e9),
    }


def bench_layer(rng, dictionary, d_model, d_ff, repeats):
    """One sparse layer's step: LAYER_EXPERTS experts, one token each."""
    wi, wi_dense = expert_set(rng, dictionary, LAYER_EXPERTS, d_ff, d_model)
    wo, wo_dense = expert_set(rng, dictionary, LAYER_EXPERTS, d_model, d_ff)
    wi, wo = (
        jax.device_put(CompressedExperts.stack(wi)),
        jax.device_put(CompressedExperts.stack(wo)),
    )
    dense = {"f32": (jnp.asarray(wi_dense), jnp.asarray(wo_dense))}
    dense["bf16"] = tuple(a.astype(jnp.bfloat16) for a in dense["f32"])
    del wi_dense, wo_dense
    x = jnp.asarray(rng.standard_normal((LAYER_EXPERTS, 1, d_model)), jnp.float32)

    @jax.jit
    def kernel_step(wi, wo, x):
        return ops.matmul(wo, jax.nn.relu(ops.matmul(wi, x, dictionary)), dictionary)

    @jax.jit
    def dense_step(wi, wo, x):
        h = jax.nn.relu(jnp.einsum("ecj,erj->ecr", x.astype(wi.dtype), wi))
        return jnp.einsum("ecj,erj->ecr", h, wo)

    error = float(jnp.abs(kernel_step(wi, wo, x) - dense_step(*dense["f32"], x)).max())
    times = side_by_side(
        {
            "kernel_f32": lambda: kernel_step(wi, wo, x).block_until_ready(),
            "dense_f32": lambda: dense_step(*dense["f32"], x).block_until_ready(),
        },
        repeats,
    )
    bf16 = side_by_side(
        {  # rounds of their own, as in bench_matrix
            "kernel_f32": lambda: kernel_step(wi, wo, x).block_until_ready(),
            "dense_bf16": lambda: dense_step(*dense["bf16"], x).block_until_ready(),
        },
        max(3, repeats // 3),
    )
    times["dense_bf16"] = bf16["dense_bf16"]
    times["kernel_f32_in_bf16_rounds"] = bf16["kernel_f32"]
    return {
        "d_model": d_model,
        "d_ff": d_ff,
        "experts": LAYER_EXPERTS,
        "tokens": LAYER_EXPERTS,
        "dense_f32_bytes": 2 * LAYER_EXPERTS * d_model * d_ff * 4,
        "max_abs_error": error,
        "times": times,
    }


def diagnose(rng, dictionary, rows, cols, cache, repeats):
    """The one-token matvec after different things ran just before it."""
    (m,), _ = expert_set(rng, dictionary, 1, rows, cols)
    w = jax.device_put(m)
    other = jnp.asarray(rng.standard_normal((rows, cols)), jnp.float32)
    x = jnp.asarray(rng.standard_normal(cols), jnp.float32)
    kernel = jax.jit(lambda w, x: ops.matvec(w, x, dictionary))
    dot = jax.jit(jnp.dot)
    sweep = np.ones(2 * max(cache["bytes"], 1 << 20) // 4, np.float32)

    def kernel_time():
        started = time.perf_counter()
        kernel(w, x).block_until_ready()
        return time.perf_counter() - started

    befores = {
        "back_to_back": lambda: None,
        "after_dense_dot": lambda: dot(other, x).block_until_ready(),
        "after_memory_sweep": lambda: sweep.sum(),
        "after_2ms_sleep": lambda: time.sleep(0.002),
    }
    kernel_time()
    samples = {name: [] for name in befores}
    order = np.random.default_rng(1)
    for _ in range(repeats):
        for name in order.permutation(list(befores)):
            befores[name]()
            samples[name].append(kernel_time())
    return {
        "rows": rows,
        "cols": cols,
        "kernel_s": {
            name: {"median_s": float(np.median(t)), "min_s": float(np.min(t))}
            for name, t in samples.items()
        },
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="switch-base shapes only, fewer rounds"
    )
    parser.add_argument("--repeats", type=int, default=None, help="rounds (default 30, quick 10)")
    parser.add_argument("--diagnose", action="store_true", help="also the interleaving diagnosis")
    parser.add_argument(
        "--diagnose_only",
        action="store_true",
        help="only the interleaving diagnosis (e.g. to compare two builds)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--output", default=result_path("kernels_cpu_rotating"), help="the JSON result"
    )
    args = parser.parse_args(argv)
    repeats = args.repeats or (10 if args.quick else 30)
    models = {"switch-base": MODELS["switch-base"]} if args.quick else MODELS
    dictionary = build_dictionary(P0)
    rng = np.random.default_rng(args.seed)
    cache = last_level_cache()
    isa = os.environ.get("QMOE_CPU_ISA") or ops.cpu_isas()[0]
    load_before = os.getloadavg()
    bandwidth = memory_bandwidth()
    print(
        f"CPU: {cpu_model()}, {os.cpu_count()} cores, kernels {isa}; last-level cache "
        f"L{cache['level']} "
        f"{cache['bytes'] / 2**20:.0f} MiB; memory: copy {bandwidth['copy_gb_s']:.1f} GB/s, XLA "
        "dense dot "
        f"reads {bandwidth['dot_read_gb_s']:.1f} GB/s; load average {load_before[0]:.2f}"
    )

    matrices, layers, criteria = [], {}, {}
    for model, (d_model, d_ff) in ({} if args.diagnose_only else models).items():
        for rows, cols in ((d_ff, d_model), (d_model, d_ff)):
            matrices.append(
                dict(
                    model=model,
                    **bench_matrix(
                        rng,
                        dictionary,
                        rows,
                        cols,
                        cache,
                        bandwidth,
                        repeats,
                        minimum_experts=LAYER_EXPERTS if model == "switch-base" else 4,
                    ),
                )
            )
        layers[model] = bench_layer(rng, dictionary, d_model, d_ff, repeats)

    if matrices:
        criteria = print_tables(matrices, layers)
    diagnosis = None
    if args.diagnose or args.diagnose_only:
        diagnosis = [
            diagnose(rng, dictionary, rows, cols, cache, repeats * 4)
            for rows, cols in ((3072, 768), (2080, 6144))
        ]
        print("== one-token matvec after ...: ms, medians (min) ==")
        for d in diagnosis:
            cells = ", ".join(
                f"{name} {v['median_s'] * 1e3:.3f} ({v['min_s'] * 1e3:.3f})"
                for name, v in d["kernel_s"].items()
            )
            print(f"{d['rows']:>5}×{d['cols']:<4} {cells}")

    write_result(
        "kernels_cpu_rotating",
        {
            "kernels": isa,
            "last_level_cache": cache,
            "memory_bandwidth": bandwidth,
            "repeats": repeats,
            "load_average_before": load_before,
            "matrices": matrices,
            "layers": layers,
            "diagnosis": diagnosis,
            "goals": criteria,
        },
        args.output,
    )


def print_tables(matrices: list, layers: dict) -> dict:
    """Prints the per-expert and layer tables; returns the goals' ratios."""
    print(
        "== per expert, rotating over E experts (dense f32 total >= 4x LLC), one call each "
        "(stacked: one call for all E); ms, medians =="
    )
    print(
        f"{'W':>10} {'E':>3} | {'kernel':>7} {'dense f32':>9} {'bf16':>7} {'ratio':>6} "
        f"{'vs bf16':>7} | "
        f"{'16 tok':>7} {'dense':>7} {'ratio':>6} | {'stacked':>7} {'dense':>7} {'ratio':>6} | "
        f"{'hot ratio':>9} | {'M cw/s':>7} "
        f"{'dense GB/s':>10} "
        f"{'mem-bound ms':>12} | {'dispatch':>8}"
    )
    criteria = {}
    for r in matrices:
        t = {name: v["median_ms"] for name, v in r["per_expert"].items()}
        hot = r["hot"]["kernel_f32"]["median_ms"] / r["hot"]["dense_f32"]["median_ms"]
        ratio = t["kernel_f32"] / t["dense_f32"]
        name = f"{r['rows']}x{r['cols']}"
        criteria[f"{name}_matvec_rotating_vs_dense_f32"] = ratio
        criteria[f"{name}_matvec_hot_vs_dense_f32"] = hot
        criteria[f"{name}_matmul16_rotating_vs_dense_f32"] = t["kernel_16"] / t["dense_f32_16"]
        stacked = t["kernel_stacked"] / t["dense_f32_stacked"]
        criteria[f"{name}_matvec_stacked_vs_dense_f32"] = stacked
        print(
            f"{r['rows']:>5}×{r['cols']:<4} {r['experts']:>3} | {t['kernel_f32']:7.3f} "
            f"{t['dense_f32']:9.3f} "
            f"{t['dense_bf16']:7.3f} {ratio:6.2f} {t['kernel_bf16'] / t['dense_bf16']:7.3f} | "
            f"{t['kernel_16']:7.3f} {t['dense_f32_16']:7.3f} "
            f"{t['kernel_16'] / t['dense_f32_16']:6.2f} | "
            f"{t['kernel_stacked']:7.3f} {t['dense_f32_stacked']:7.3f} {stacked:6.2f} | "
            f"{hot:9.2f} | {r['kernel_codewords_per_s'] / 1e6:7.0f} {r['dense_f32_gb_s']:10.1f} "
            f"{r['dense_f32_memory_bound_s'] * 1e3:12.3f} | {t['dispatch_floor']:8.3f}"
        )
    print(
        f"== sparse layer step: {LAYER_EXPERTS} experts, one token each (wi, relu, wo); ms, "
        "medians =="
    )
    for model, layer in layers.items():
        t = {name: v["median_ms"] for name, v in layer["times"].items()}
        ratio = t["kernel_f32"] / t["dense_f32"]
        criteria[f"{model}_layer_step_vs_dense_f32"] = ratio
        print(
            f"{model:>12} (d_model {layer['d_model']}, d_ff {layer['d_ff']}): kernel "
            f"{t['kernel_f32']:.3f}, "
            f"dense f32 {t['dense_f32']:.3f}, dense bf16 {t['dense_bf16']:.3f}; ratio vs f32 "
            f"{ratio:.2f}, "
            f"vs bf16 {t['kernel_f32_in_bf16_rounds'] / t['dense_bf16']:.3f}"
        )
    matvec = [v for k, v in criteria.items() if k.endswith("_matvec_rotating_vs_dense_f32")]
    criteria["matvec_rotating_ok (<= 0.5)"] = max(matvec) <= 0.5
    criteria["matvec_rotating_stretch (<= 0.3)"] = max(matvec) <= 0.3
    stacked = [v for k, v in criteria.items() if k.endswith("_matvec_stacked_vs_dense_f32")]
    criteria["matvec_stacked_ok (<= 0.5)"] = max(stacked) <= 0.5
    criteria["switch-base_layer_step_ok (<= 0.5)"] = (
        criteria["switch-base_layer_step_vs_dense_f32"] <= 0.5
    )
    print("== goals (medians) ==")
    for name, value in criteria.items():
        print(f"{name}: {value:.3f}" if isinstance(value, float) else f"{name}: {value}")

    return criteria


if __name__ == "__main__":
    main()
