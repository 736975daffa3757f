"""Routing-aware expert execution on CPU: a switch-base-128 expert layer at batch 1.

One decoding step of one token sends it to one of E = 128 experts. The layer
is the Switch MLP on the dispatch buffer x [E, 1, d_model] (the token in its
expert's slot 0, zeros elsewhere): wo · relu(wi · x), with wi [E, d_ff, d_model]
and wo [E, d_model, d_ff] (d_model 768, d_ff 3072) compressed from i.i.d.
ternary codes at P(0) = 0.885 with the static dictionary. Side by side in one
process (kernels_cpu.side_by_side: shuffled rounds, medians):

  all experts    ops.matmul without counts: every expert decoded
  one-hot        the same calls with counts = one_hot(e): one expert decoded
  one matrix     ops.matmul on expert e's CompressedMatrix alone (the floor)

for wi, wo and the whole layer; the goal is one-hot <= 2/E of all experts.

    python benchmarks/expert_skipping.py [--experts 128] [--repeats 20]
"""

from __future__ import annotations

import argparse
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from common import cpu_model, result_path, write_result
from kernels_cpu import P0, encode_matrix, side_by_side, synthetic

from qmoe_jax.codec import CompressedExperts, build_dictionary
from qmoe_jax.kernels import ops

D_MODEL, D_FF = 768, 3072


def expert_stack(rng, dictionary, experts: int, rows: int, cols: int) -> CompressedExperts:
    return CompressedExperts.stack(
        [encode_matrix(*synthetic(rng, rows, cols), dictionary) for _ in range(experts)]
    )


def bench(experts: int, repeats: int, seed: int) -> dict:
    dictionary = build_dictionary(P0)
    rng = np.random.default_rng(seed)
    start = time.perf_counter()
    wi = jax.device_put(expert_stack(rng, dictionary, experts, D_FF, D_MODEL))
    wo = jax.device_put(expert_stack(rng, dictionary, experts, D_MODEL, D_FF))
    print(f"encoded 2 × {experts} experts in {time.perf_counter() - start:.1f} s")
    chosen = int(rng.integers(experts))
    x = jnp.zeros((experts, 1, D_MODEL), jnp.float32)
    x = x.at[chosen, 0].set(jnp.asarray(rng.standard_normal(D_MODEL), jnp.float32))
    one_hot = jnp.asarray(np.arange(experts) == chosen, jnp.int32)
    wi_one, wo_one = wi[chosen], wo[chosen]

    def layer(wi, wo, x, counts=None):
        hidden = jax.nn.relu(ops.matmul(wi, x, dictionary, counts))
        return ops.matmul(wo, hidden, dictionary, counts)

    matmul = jax.jit(lambda w, x, counts=None: ops.matmul(w, x, dictionary, counts))
    layer_jit = jax.jit(layer)
    hidden = jax.nn.relu(matmul(wi, x))
    candidates = {
        "wi": {
            "all_experts": lambda: matmul(wi, x),
            "one_hot": lambda: matmul(wi, x, one_hot),
            "one_matrix": lambda: matmul(wi_one, x[chosen]),
        },
        "wo": {
            "all_experts": lambda: matmul(wo, hidden),
            "one_hot": lambda: matmul(wo, hidden, one_hot),
            "one_matrix": lambda: matmul(wo_one, hidden[chosen]),
        },
        "layer": {
            "all_experts": lambda: layer_jit(wi, wo, x),
            "one_hot": lambda: layer_jit(wi, wo, x, one_hot),
            "one_matrix": lambda: layer_jit(wi_one, wo_one, x[chosen]),
        },
    }
    full, skipped = np.asarray(layer_jit(wi, wo, x)), np.asarray(layer_jit(wi, wo, x, one_hot))
    max_abs_error = float(np.abs(full - skipped).max())
    results = {}
    for name, calls in candidates.items():
        timings = side_by_side(calls, repeats)
        all_ms = timings["all_experts"]["median_ms"]
        timings["one_hot_vs_all"] = timings["one_hot"]["median_ms"] / all_ms
        timings["one_hot_vs_all_of_minimums"] = (
            timings["one_hot"]["min_ms"] / timings["all_experts"]["min_ms"]
        )
        timings["one_matrix_vs_all"] = timings["one_matrix"]["median_ms"] / all_ms
        results[name] = timings
    return dict(
        chosen_expert=chosen, one_hot_vs_all_experts_max_abs_error=max_abs_error, results=results
    )


def print_table(experts: int, results: dict) -> None:
    goal = 2 / experts
    print(f"== E = {experts} experts, 1 token (ms, medians); goal: one-hot <= 2/E = {goal:.4f} ==")
    print(
        f"{'call':>6} | {'all experts':>11} {'one-hot':>8} {'one matrix':>10} | "
        f"{'one-hot / all':>13} {'(minimums)':>10} {'one matrix / all':>16} | ok"
    )
    for name, r in results.items():
        print(
            f"{name:>6} | {r['all_experts']['median_ms']:11.3f} {r['one_hot']['median_ms']:8.3f} "
            f"{r['one_matrix']['median_ms']:10.3f} | {r['one_hot_vs_all']:13.4f} "
            f"{r['one_hot_vs_all_of_minimums']:10.4f} {r['one_matrix_vs_all']:16.4f} | "
            f"{r['one_hot_vs_all'] <= goal}"
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=20, help="timing rounds")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default=result_path("expert_skipping"), help="the JSON result")
    args = parser.parse_args(argv)
    isa = os.environ.get("QMOE_CPU_ISA") or ops.cpu_isas()[0]
    model = cpu_model()
    load_before = os.getloadavg()
    print(
        f"cpu: {model}, cores: {os.cpu_count()}, kernels: {isa}, "
        f"load average before: {load_before[0]:.2f}"
    )
    measured = bench(args.experts, args.repeats, args.seed)
    print_table(args.experts, measured["results"])
    print(
        f"one-hot vs all experts, max |difference| of the layer output: "
        f"{measured['one_hot_vs_all_experts_max_abs_error']:.2e}"
    )
    write_result(
        "expert_skipping",
        dict(
            kernels=isa,
            experts=args.experts,
            d_model=D_MODEL,
            d_ff=D_FF,
            p0=P0,
            repeats=args.repeats,
            goal_one_hot_vs_all=2 / args.experts,
            load_average_before=load_before,
            **measured,
        ),
        args.output,
    )


if __name__ == "__main__":
    main()
