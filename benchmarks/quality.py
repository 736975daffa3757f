"""Validation loss of the bundled model: bf16 vs RTN vs GPTQ, ternary and 2-bit, over calibration
amounts.

The paper's Table 5 layout (method × grid rows, calibration-amount columns),
with the paper's Switch figures quoted beside ours. The metric is the
bundled corpus's validation span-corruption loss (nats/token), computed by
``qmoe_jax.evaluate`` on the dequantized experts.

    python benchmarks/quality.py            # 1× = 1024 calibration samples
    python benchmarks/quality.py --quick    # 1× = 128 samples, 256 validation examples
    python benchmarks/quality.py --methods rtn,gptq --amounts 1   # a subset of the rows/columns,
                                            # e.g. to compare two revisions of the solver
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

from common import result_path, write_result

from qmoe_jax.compression.job import compress_checkpoint
from qmoe_jax.compression.options import CompressionOptions
from qmoe_jax.data import Tokenizer, bundled
from qmoe_jax.inference import (
    bundled_validation_examples,
    evaluate_batches,
    load_t5x_params,
    make_eval_step,
    mean_cross_entropy,
    padded_batches,
)
from qmoe_jax.inference.compressed_params import load_compressed_model
from qmoe_jax.models import SwitchTransformer, get_config

# The paper's C4 validation losses (QMoE, Frantar & Alistarh 2023, arXiv:2310.16795).
PAPER = {
    "switch-base-128": {"bf16": 1.73, "ternary rtn": 4.54, "ternary gptq": 1.99},
    "switch-c-2048": {"bf16": 1.18, "ternary rtn": 2.15, "ternary gptq": 1.26},
}
AMOUNTS = (0.5, 1.0, 2.0)
# "gptq" is the default: QMoE's settings (damping 0.1, no act-order, no
# true-sequential), encoder-only premask; "gptq qmoe-mask" adds QMoE's decoder
# premask; "gptq+" uses GPTQ's own damping (0.01) and act-order, plus true-sequential.
METHODS = {
    "rtn": dict(method="rtn"),
    "gptq": dict(method="gptq"),
    "gptq qmoe-mask": dict(method="gptq", premask="encoder_decoder"),
    "gptq+": dict(method="gptq", damping=0.01, act_order=True, true_sequential=True),
}
GPTQ_METHODS = [m for m in METHODS if m != "rtn"]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--num_samples", type=int, default=1024, help="calibration samples at 1×")
    parser.add_argument(
        "--validation_samples", type=int, default=None, help="default: the whole validation split"
    )
    parser.add_argument(
        "--work_dir",
        default=None,
        help="keep the compressed checkpoints here (a fresh directory per run; "
        "default: a temporary directory, removed at the end)",
    )
    parser.add_argument("--quick", action="store_true")
    parser.add_argument(
        "--methods", default=",".join(METHODS), help=f"comma-separated subset of {list(METHODS)}"
    )
    parser.add_argument(
        "--grids", default="ternary,2bit", help="comma-separated subset of ternary,2bit"
    )
    parser.add_argument(
        "--amounts",
        default=",".join(map(str, AMOUNTS)),
        help="calibration amounts (multiples of --num_samples) for the GPTQ methods",
    )
    parser.add_argument("--out", default=result_path("quality"), help="the JSON result")
    args = parser.parse_args()
    args.methods, args.grids = args.methods.split(","), args.grids.split(",")
    try:
        args.amounts = tuple(float(amount) for amount in args.amounts.split(","))
    except ValueError:
        parser.error(
            "--amounts takes comma-separated numbers (multiples of --num_samples), got "
            f"{args.amounts!r}"
        )
    if any(amount <= 0 for amount in args.amounts):
        parser.error(f"--amounts must be positive, got {args.amounts}")
    unknown = [m for m in args.methods if m not in METHODS] + [
        g for g in args.grids if g not in ("ternary", "2bit")
    ]
    if unknown:
        parser.error(
            f"unknown --methods/--grids entries {unknown}; methods are {list(METHODS)}, grids "
            "ternary, 2bit"
        )
    if args.quick:
        args.num_samples, args.validation_samples = 128, 256

    work_dir = args.work_dir or tempfile.mkdtemp(prefix="qmoe_quality_")
    try:
        run_all(args, work_dir)
    finally:
        if args.work_dir is None:
            shutil.rmtree(work_dir, ignore_errors=True)


def run_all(args, work_dir: str) -> None:
    config = get_config(bundled.CONFIG_NAME)
    tokenizer = Tokenizer(bundled.tokenizer_path())
    examples = bundled_validation_examples(tokenizer, args.validation_samples)
    model = SwitchTransformer(config)

    def loss_of(params) -> float:
        return mean_cross_entropy(
            model, params, examples, 32, bundled.INPUTS_LENGTH, bundled.DECODER_LENGTH
        )

    # The same loss split by target: positions that predict a sentinel (a quarter
    # of them, and the ones QMoE's decoder premask keeps out of the Hessians) and the rest.
    batches = padded_batches(examples, 32, bundled.INPUTS_LENGTH, bundled.DECODER_LENGTH)
    eval_step = make_eval_step(model)

    def split_losses(params) -> dict[str, float]:
        split = {}
        for part, keep in (("sentinel_targets", True), ("other_targets", False)):
            weighted = [
                dict(
                    batch,
                    decoder_loss_weights=batch["decoder_loss_weights"]
                    * (tokenizer.is_sentinel(batch["decoder_target_tokens"]) == keep),
                )
                for batch in batches
            ]
            split[part] = evaluate_batches(eval_step, params, weighted)
        return split

    bf16_params = load_t5x_params(bundled.checkpoint_path(), config)
    results: dict = {
        "bf16": loss_of(bf16_params),
        "bf16_split": split_losses(bf16_params),
        "runs": [],
    }
    del bf16_params
    print(f"bf16: {results['bf16']:.4f} on {len(examples)} validation examples", flush=True)
    runs = [("rtn", grid, None) for grid in args.grids if "rtn" in args.methods]
    runs += [
        (method, grid, amount)
        for method in GPTQ_METHODS
        if method in args.methods
        for grid in args.grids
        for amount in args.amounts
    ]
    for method, grid, amount in runs:
        samples = args.num_samples if amount is None else round(amount * args.num_samples)
        name = f"{grid}-{method.replace(' ', '-')}" + ("" if amount is None else f"-{amount}x")
        output_dir = os.path.join(work_dir, name)
        if os.path.exists(output_dir):
            raise SystemExit(
                f"{output_dir} exists; give an empty --work_dir so runs do not resume each other"
            )
        started = time.time()
        report = compress_checkpoint(
            CompressionOptions(
                grid=grid, num_samples=samples, output_dir=output_dir, **METHODS[method]
            ),
            log=lambda line: None,
            progress=False,
        )
        compressed = load_compressed_model(output_dir)
        loss = loss_of(compressed.params)
        split = split_losses(compressed.params)
        run = {
            "method": method,
            "settings": METHODS[method],
            "grid": grid,
            "amount": amount,
            "num_samples": samples,
            "loss": loss,
            "increase": loss - results["bf16"],
            "split_increase": {
                part: value - results["bf16_split"][part] for part, value in split.items()
            },
            "bits_per_weight": report["moe"]["bits_per_weight"],
            "fallback_experts": report["fallback_experts"],
            "seconds": time.time() - started,
        }
        results["runs"].append(run)
        increases = run["split_increase"]
        print(
            f"{name}: {loss:.4f} (+{run['increase']:.4f}; sentinel targets "
            f"{increases['sentinel_targets']:+.4f}, "
            f"others {increases['other_targets']:+.4f}), {run['bits_per_weight']:.3f} bits/weight, "
            f"{run['seconds']:.0f}s",
            flush=True,
        )

    def cell(method, grid, amount):
        for run in results["runs"]:
            if (
                run["method"] == method
                and run["grid"] == grid
                and (method == "rtn" or run["amount"] == amount)
            ):
                return f"{run['loss']:.4f}"
        return "-"

    header = f"{'':<24}" + "".join(
        f"{f'{a}x ({int(a * args.num_samples)})':>16}" for a in args.amounts
    )
    lines = [header, f"{'bf16':<24}" + f"{results['bf16']:>16.4f}" * len(args.amounts)]
    for grid in args.grids:
        for method in args.methods:
            lines.append(
                f"{grid + ' ' + method:<24}"
                + "".join(f"{cell(method, grid, a):>16}" for a in args.amounts)
            )
    lines.append("paper (C4 loss, full calibration):")
    for model_name, rows in PAPER.items():
        lines.append("  " + model_name + ": " + ", ".join(f"{k} {v:.2f}" for k, v in rows.items()))
    ternary_rtn = next(
        (r for r in results["runs"] if r["method"] == "rtn" and r["grid"] == "ternary"), None
    )
    for method in GPTQ_METHODS:
        ternary = next(
            (
                r
                for r in results["runs"]
                if r["method"] == method and r["grid"] == "ternary" and r["amount"] == 1.0
            ),
            None,
        )
        if ternary is None or ternary_rtn is None:
            continue  # the ratio needs both rows
        ratio = ternary["increase"] / ternary_rtn["increase"]
        results[f"ternary_{method.replace(' ', '_')}_over_rtn_increase"] = ratio
        lines.append(f"ternary {method} increase / RTN increase at 1x: {ratio:.3f} (goal <= 0.25)")
    print("\n".join(lines))
    write_result("quality", results, args.out)


if __name__ == "__main__":
    main()
