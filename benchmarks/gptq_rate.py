"""GPTQ's FLOP rate on ONE switch-base expert against this machine's dense float32 matmul rate.

Both matrices of one expert in y = W·x orientation (wi: W[3072, 768], H[768, 768];
wo: W[768, 3072], H[3072, 3072]), with Hessians from 1024 and 8192 synthetic
correlated calibration tokens (gptq_grouping.py's layer with one expert). Each
matrix is quantized the way the calibration pass does it (`quantize_expert_group`,
one expert per call), in four variants taking turns in one run: "unrolled" (the
default: outer block loop unrolled and left-looking, each block's corrections from all
earlier blocks in one matmul; the columns inside each block in the native CPU kernel,
GPTQConfig.native_block, and the Cholesky's diagonal blocks in theirs,
GPTQConfig.native_cholesky), "fori_loop" (a fori_loop over blocks, right-looking, the
same kernels), "jnp_block" (unrolled, the jnp levels inside each block) and
"jnp_cholesky" (unrolled, the Cholesky's diagonal blocks in its jnp loop). The others
differ from unrolled by float rounding only, and the fraction of codes equal to
unrolled's is printed.

Reported per token count, matrix and variant: seconds (best of --repeats), GFLOP/s and
the fraction of the dense matmul rate (jnp.dot 2048x2048 f32, best of before and
after), on two FLOP counts:
  - "useful": cols^3/3 (Cholesky) + rows·cols^2 (the sweep's updates), the work any
    GPTQ must do; the same for both variants, so its rate is a speed;
  - "executed": what the solver runs (gptq_grouping.executed_flops: Cholesky cols^3/3,
    lazy updates at every block level); the issue's 33-34% was measured on this count
    with the fori_loop variant.
The time split: the Cholesky (`hessian_factor` alone, jitted the same way) and the
column sweep (the rest); the sweep's parts are also timed alone at the first token count
(outer corrections, the left-looking matmuls; inner levels, native and jnp: 16-column sub-blocks and
single columns). The
Cholesky (quant/linalg.py, blockwise left-looking) executes a little more than
cols^3/3 (full matmuls on its diagonal blocks, their inverses for the solves); its
executed count is printed beside it.

The token count changes only the Hessian H = XᵀX, not the solver's work. Accumulating
it (2·tokens·cols^2 FLOPs, one matmul, `quant.hessian`) is timed and reported on its
own line, never inside the solver's seconds: in the compression CLI it is part of the
calibration pass ("hessian" in the report's seconds), not of "gptq".

--isas adds "unrolled <isa>" for each other instruction set the CPU kernels have here (AVX-512
on a CPU that has it, since AVX2 comes first), forced with QMOE_CPU_ISA around each of its calls
and taking turns with the other variants: its codes should equal unrolled's (every build rounds
the same way), and its seconds say which build is the faster here.

    python benchmarks/gptq_rate.py [--tokens 1024,8192] [--repeats 3] [--isas]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import common  # noqa: F401  (first: puts this checkout on sys.path before the import below)

from qmoe_jax import malloc

if __name__ == "__main__":  # time the solver with the malloc settings of the compression CLI
    malloc.reexec_with_huge_pages(__file__)

import jax
import jax.numpy as jnp
import numpy as np
from common import cpu_model, restored_isa, result_path, write_result
from gptq_grouping import (
    executed_flops,
    factor_seconds,
    matmul_rate,
    minimal_flops,
    synthetic_layer,
    timed,
)

from qmoe_jax.quant import GPTQConfig, GridConfig, grid_params, hessian, quantize_expert_group
from qmoe_jax.quant.linalg import BASE_SIZE

GOAL = 0.60
gptq_module = importlib.import_module(
    "qmoe_jax.quant.gptq"
)  # the module (qmoe_jax.quant.gptq is the function)
VARIANTS = {
    "unrolled": GPTQConfig(),
    "fori_loop": GPTQConfig(unroll_blocks=False),
    "jnp_block": GPTQConfig(native_block=False),
    "jnp_cholesky": GPTQConfig(native_cholesky=False),
}
Variants = dict[str, tuple[GPTQConfig, "str | None"]]


def timed_variants(isas: bool) -> Variants:
    """name -> (config, instruction set forced or None): VARIANTS, and with ``isas`` "unrolled
    <isa>" for each instruction set the CPU kernels have here besides the first (which "unrolled"
    runs), forced with QMOE_CPU_ISA around each call."""
    variants = {name: (config, None) for name, config in VARIANTS.items()}
    if isas:
        from qmoe_jax.kernels import ops

        for isa in ops.cpu_isas()[1:]:
            if isa != "portable":
                variants[f"unrolled {isa}"] = (VARIANTS["unrolled"], isa)
    return variants


def solve(config: GPTQConfig, isa: str | None, weights, hessians, count, grid: GridConfig):
    """One quantize_expert_group call, waited for, with QMOE_CPU_ISA=isa unless None (the
    kernels read it at each call, so a compiled program runs the forced set)."""
    with restored_isa():
        if isa is not None:
            os.environ["QMOE_CPU_ISA"] = isa
        return jax.block_until_ready(quantize_expert_group(weights, hessians, count, grid, config))


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--d_model", type=int, default=768)
    parser.add_argument("--d_ff", type=int, default=3072)
    parser.add_argument(
        "--tokens", default="1024,8192", help="calibration token counts (comma-separated)"
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--isas",
        action="store_true",
        help="also run the unrolled variant with each other instruction set the CPU kernels have "
        "here (AVX-512 where AVX2 comes first), taking turns with the others",
    )
    parser.add_argument("--out", default=result_path("gptq_rate"), help="the JSON result")
    args = parser.parse_args()
    args.tokens = [int(count) for count in args.tokens.split(",")]
    return args


def cholesky_executed_flops(size: int, native: bool = True) -> float:
    """FLOPs quant/linalg.py's blockwise left-looking Cholesky executes on [size, size]: per block
    of columns s:e, the update of rows s: from columns :s, the diagonal block's factor and inverse
    (``native``: in the CPU kernel, which skips the zeros of both triangles), the solve below it."""
    flops = 0.0
    for start in range(0, size, BASE_SIZE):
        width = min(BASE_SIZE, size - start)
        flops += 2.0 * (size - start) * start * width  # P = A[s:, s:e] − L[s:, :s]·L[s:e, :s]ᵀ
        # the jnp loop: per column a matvec with L and one with L⁻¹, both full width; the kernel:
        # triangles only
        flops += (2.0 / 3.0 if native else 4.0) * width**3
        flops += 2.0 * (size - start - width) * width * width  # P[e−s:]·L[s:e, s:e]⁻ᵀ
    return flops


def hessian_seconds(tokens: int, cols: int, repeats: int, seed: int) -> float:
    """Best time to accumulate H = XᵀX from [tokens, cols] float32 inputs (the cost does not depend
    on the values)."""
    inputs = jnp.asarray(np.random.default_rng(seed).standard_normal((tokens, cols), np.float32))
    mask = jnp.ones((tokens,), bool)
    accumulate = jax.jit(hessian)
    accumulate(inputs, mask).block_until_ready()
    return min(
        timed(lambda: accumulate(inputs, mask).block_until_ready())[0] for _ in range(repeats)
    )


def sweep_split(weights: jax.Array, repeats: int, grid: GridConfig, config: GPTQConfig) -> dict:
    """Seconds of the unrolled sweep's parts for one W[rows, cols], each jitted alone on a synthetic
    upper-triangular factor (the work does not depend on the values): the outer corrections
    (left-looking matmuls), the inner levels (sub-blocks and columns) of every outer block, and the
    column level alone (every sub-block's per-column loop)."""
    cols = weights.shape[1]
    if cols % config.block_size:
        return {}
    factor = jnp.asarray(
        np.triu(np.random.default_rng(0).standard_normal((cols, cols), np.float32)) * 0.01
        + np.eye(cols, dtype=np.float32)
    )
    factor_diag = jnp.diagonal(factor)
    scaled = factor * (1 / factor_diag)[None, :]
    params = grid_params(weights, grid)
    outer, inner = config.block_size, config.block_sizes[1:]

    def inner_levels(weights, scaled, factor_diag, params, sizes, step, native):
        return [
            gptq_module._block_levels(
                weights[:, s : s + step],
                jnp.zeros_like(weights[:, s : s + step]),
                scaled[s : s + step, s : s + step],
                factor_diag[s : s + step],
                params,
                grid,
                sizes,
                native,
            )[1]
            for s in range(0, cols, step)
        ]

    def outer_corrections(
        weights, scaled, factor_diag, params
    ):  # the weights stand in for the residuals
        return [
            gptq_module.left_looking_corrections(weights, scaled, start, start + outer)
            for start in range(outer, cols, outer)
        ]

    def best(fn, **static):
        # the arrays are arguments, not closed-over constants that XLA could fold at compile time
        jitted = jax.jit(functools.partial(fn, **static))
        operands = (weights, scaled, factor_diag, params)
        jax.block_until_ready(jitted(*operands))
        return min(
            timed(lambda: jax.block_until_ready(jitted(*operands)))[0] for _ in range(repeats)
        )

    return dict(
        outer_corrections_seconds=best(outer_corrections),
        inner_levels_seconds=best(inner_levels, sizes=inner, step=outer, native=True),
        inner_levels_jnp_seconds=best(inner_levels, sizes=inner, step=outer, native=False),
        column_level_jnp_seconds=best(
            inner_levels, sizes=(1,), step=config.block_sizes[-2], native=False
        ),
    )


def measure_tokens(args, tokens: int, grid: GridConfig, variants: Variants) -> list[dict]:
    layer_args = argparse.Namespace(
        seed=args.seed, experts=1, d_model=args.d_model, d_ff=args.d_ff, tokens=tokens
    )
    weights_wi, hessians_wi, weights_wo, hessians_wo = synthetic_layer(layer_args)
    count = jnp.ones((1,), jnp.int32)
    rows = []
    for name, weights, hessians in (
        ("wi", weights_wi, hessians_wi),
        ("wo", weights_wo, hessians_wo),
    ):
        out_rows, cols = weights.shape[1:]
        results, compile_s, runs = {}, {}, {name: [] for name in variants}
        for variant, (config, isa) in variants.items():
            first, _, results[variant] = timed(
                lambda weights=weights, hessians=hessians, config=config, isa=isa: solve(
                    config, isa, weights, hessians, count, grid
                )
            )
            compile_s[variant] = first
        for _ in range(args.repeats):
            for variant, (config, isa) in variants.items():
                runs[variant].append(
                    timed(
                        lambda weights=weights, hessians=hessians, config=config, isa=isa: solve(
                            config, isa, weights, hessians, count, grid
                        )
                    )[:2]
                )
        factor_s = {
            native: min(
                factor_seconds([(weights, hessians)], 1, VARIANTS["unrolled"].damping, native)[0]
                for _ in range(args.repeats)
            )
            for native in {config.native_cholesky for config, _ in variants.values()}
        }
        hessian_s = hessian_seconds(tokens, cols, args.repeats, args.seed)
        split = (
            sweep_split(weights[0], args.repeats, grid, VARIANTS["unrolled"])
            if tokens == args.tokens[0]
            else {}
        )
        for variant, (config, _) in variants.items():
            seconds = min(run[0] for run in runs[variant])
            rows.append(
                dict(
                    tokens=tokens,
                    matrix=name,
                    rows=out_rows,
                    cols=cols,
                    variant=variant,
                    seconds=seconds,
                    cpu_seconds=min(run[1] for run in runs[variant]),
                    # first call minus the best; ~0 where a preceding token count compiled the same
                    # shapes
                    compile_seconds=compile_s[variant] - seconds,
                    cholesky_seconds=factor_s[config.native_cholesky],
                    sweep_seconds=max(seconds - factor_s[config.native_cholesky], 0.0),
                    gflop_useful=minimal_flops(out_rows, cols) / 1e9,
                    gflop_executed=executed_flops(out_rows, cols, config) / 1e9,
                    gflop_cholesky_executed=cholesky_executed_flops(cols, config.native_cholesky)
                    / 1e9,
                    fallback=bool(results[variant].fallback[0]),
                    codes_equal_to_unrolled=float(
                        np.mean(
                            np.asarray(results[variant].codes)
                            == np.asarray(results["unrolled"].codes)
                        )
                    ),
                    hessian_seconds=hessian_s,
                    hessian_gflop=2.0 * tokens * cols**2 / 1e9,
                    sweep_split=split if variant == "unrolled" else {},
                )
            )
    return rows


def codes_column(row: dict) -> str:
    """The fraction of the variant's codes equal to unrolled's."""
    return f"{row['codes_equal_to_unrolled']:.4%} equal"


def with_rates(row: dict, rate: float, rate_per_cpu: float) -> dict:
    for count in ("useful", "executed"):
        row[f"gflops_per_s_{count}"] = row[f"gflop_{count}"] / row["seconds"]
        row[f"fraction_of_matmul_{count}"] = row[f"gflops_per_s_{count}"] * 1e9 / rate
        row[f"fraction_of_matmul_{count}_cpu"] = (
            row[f"gflop_{count}"] / row["cpu_seconds"] * 1e9 / rate_per_cpu
        )
    row["hessian_fraction_of_matmul"] = row["hessian_gflop"] / row["hessian_seconds"] * 1e9 / rate
    return row


def expert_totals(
    rows: list[dict], rate: float, rate_per_cpu: float, variants: Variants
) -> list[dict]:
    """Both matrices of the expert together, per token count and variant."""
    totals = []
    for tokens in dict.fromkeys(row["tokens"] for row in rows):
        for variant in variants:
            mine = [row for row in rows if row["tokens"] == tokens and row["variant"] == variant]
            total = dict(
                tokens=tokens,
                matrix="expert (wi+wo)",
                variant=variant,
                codes_equal_to_unrolled=float(
                    np.mean([row["codes_equal_to_unrolled"] for row in mine])
                ),
            )
            for key in (
                "seconds",
                "cpu_seconds",
                "compile_seconds",
                "cholesky_seconds",
                "sweep_seconds",
                "gflop_useful",
                "gflop_executed",
                "gflop_cholesky_executed",
                "hessian_seconds",
                "hessian_gflop",
            ):
                total[key] = sum(row[key] for row in mine)
            totals.append(with_rates(total, rate, rate_per_cpu))
    return totals


def main():
    args = parse_args()
    variants = timed_variants(args.isas)
    grid = GridConfig()
    load_before = os.getloadavg()
    huge_pages = malloc.huge_pages_status()
    rate_before = matmul_rate()
    rows = [row for tokens in args.tokens for row in measure_tokens(args, tokens, grid, variants)]
    rate, rate_per_cpu = np.maximum(rate_before, matmul_rate())
    rows = [with_rates(row, rate, rate_per_cpu) for row in rows]
    totals = expert_totals(rows, rate, rate_per_cpu, variants)

    print(
        f"GPTQ on one expert (d_model {args.d_model}, d_ff {args.d_ff}), ternary, block sizes "
        f"{GPTQConfig().block_sizes}; {cpu_model()}, {os.cpu_count()} CPUs, jax {jax.__version__}, "
        f"load average {load_before[0]:.1f} (shared machine); malloc huge pages {huge_pages}"
    )
    print(
        f"dense f32 matmul (2048^2): {rate / 1e9:.1f} GFLOP/s, {rate_per_cpu / 1e9:.1f} GFLOP per "
        "CPU second; "
        "'of mm': the fraction of the matmul rate per wall second (per CPU second in brackets, "
        "steadier "
        f"when other work shares the cores)"
    )
    print(
        f"{'tokens':>6} {'matrix':>15} {'variant':>15} {'s':>7} {'useful GF/s':>11} {'of mm':>14} "
        f"{'exec GF/s':>9} {'of mm':>14} {'Cholesky s':>10} {'sweep s':>8} {'compile s':>9} "
        f"{'codes':>14}"
    )
    for row in rows + totals:
        print(
            f"{row['tokens']:>6} {row['matrix']:>15} {row['variant']:>15} {row['seconds']:>7.3f} "
            f"{row['gflops_per_s_useful']:>11.1f} {row['fraction_of_matmul_useful']:>6.1%} "
            f"({row['fraction_of_matmul_useful_cpu']:>5.1%}) {row['gflops_per_s_executed']:>9.1f} "
            f"{row['fraction_of_matmul_executed']:>6.1%} "
            f"({row['fraction_of_matmul_executed_cpu']:>5.1%}) "
            f"{row['cholesky_seconds']:>10.3f} {row['sweep_seconds']:>8.3f} "
            f"{row['compile_seconds']:>9.1f} "
            f"{codes_column(row):>14}"
        )
    for total in totals:
        if total["variant"] == "unrolled":
            print(
                f"{total['tokens']} tokens: Hessian accumulation (2·tokens·cols^2 = "
                f"{total['hessian_gflop']:.1f} "
                f"GFLOP for wi+wo, not in the solver's seconds) {total['hessian_seconds']:.3f} s, "
                f"{total['hessian_fraction_of_matmul']:.0%} of the matmul rate; Cholesky "
                f"{total['cholesky_seconds'] / total['seconds']:.0%} of the solver, sweep "
                f"{total['sweep_seconds'] / total['seconds']:.0%}; the Cholesky executes "
                f"{total['gflop_cholesky_executed']:.1f} GFLOP for its "
                f"{sum(c**3 / 3 for c in (args.d_model, args.d_ff)) / 1e9:.1f} useful, at "
                f"{total['gflop_cholesky_executed'] / total['cholesky_seconds'] * 1e9 / rate:.0%} "
                "of the matmul rate"
            )
    for row in rows:
        if row["sweep_split"]:
            split = row["sweep_split"]
            print(
                f"{row['matrix']} sweep, parts timed alone: outer corrections "
                f"{split['outer_corrections_seconds']:.3f} s, "
                f"inner levels {split['inner_levels_seconds']:.3f} s in the native kernel, "
                f"{split['inner_levels_jnp_seconds']:.3f} s as jnp levels (of which the "
                "per-column loops "
                f"{split['column_level_jnp_seconds']:.3f} s)"
            )
    largest = max(args.tokens)
    final = next(t for t in totals if t["tokens"] == largest and t["variant"] == "unrolled")
    print(
        f"goal: solver >= {GOAL:.0%} of the matmul rate at {largest} tokens: useful count "
        f"{final['fraction_of_matmul_useful']:.0%} (per CPU second "
        f"{final['fraction_of_matmul_useful_cpu']:.0%}), "
        f"executed count {final['fraction_of_matmul_executed']:.0%} "
        f"({final['fraction_of_matmul_executed_cpu']:.0%}): "
        f"{'met' if final['fraction_of_matmul_executed'] >= GOAL else 'not met'}"
    )

    report = dict(
        args=vars(args),
        malloc_huge_pages=huge_pages,
        block_sizes=GPTQConfig().block_sizes,
        matmul_gflops_per_s=rate / 1e9,
        matmul_gflops_per_cpu_s=rate_per_cpu / 1e9,
        rows=rows,
        expert_totals=totals,
        goal=GOAL,
        variants={
            name: {**dataclasses.asdict(config), "isa": isa}
            for name, (config, isa) in variants.items()
        },
        load_average_before=load_before,
    )
    write_result("gptq_rate", report, args.out)


if __name__ == "__main__":
    main()
