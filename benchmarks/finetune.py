"""Fine-tuning against its goals: repair, downstream accuracy and cost, compressed against dense,
side by side.

Every fine-tuning run is its own `python -m qmoe_jax.finetune` process (so that its peak RSS is its
own), with the same budget (steps, batch, learning rate, seed) for the compressed models and their
control:

  repair      span_corruption:bundled on the dense parts of the ternary RTN and GPTQ
              checkpoints of the bundled model, and of the original bf16 model (the control: is
              the gain more than more training?). Loss on the held-out plays before (step 0) and
              after, from each run's metrics (the first --eval_examples validation examples, as
              `python -m qmoe_jax.evaluate` makes them).
              gap recovered = (L_compressed - L_compressed_tuned) / (L_compressed - L_original).
  downstream  name_the_work (given a passage, name the work): GPTQ checkpoint, dense parts; the
              same with expert LoRA; the original bf16 model, dense parts. Exact match of greedy
              answers.
  cost        the switch-base-shaped synthetic compressed checkpoint of benchmarks/inference.py,
              fine-tuned with its experts on the fused kernels and, as the control, dequantized to
              float32, with each optimizer of --cost_optimizers (AdamW, Adafactor): median step
              time (compilation excluded) and peak RSS of each process.

    python benchmarks/finetune.py                                # all three goals
    python benchmarks/finetune.py --goals cost --cost_steps 4

The RTN checkpoint is made once with `python -m qmoe_jax.compress --method rtn`; the GPTQ one is the
README main job's output (runs/compressed/switch-mini-8, made if missing).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys

from common import REPO, cpu_model, result_path, work_dir, write_result
from inference import PEAK_WRAPPER, checkpoint_for

GOALS = ("repair", "downstream", "cost")


def _manifest_complete(manifest: str) -> bool:
    with open(manifest) as f:
        return bool(json.load(f).get("complete"))


def compressed_bundled(method: str, work_dir: str) -> str:
    if method == "gptq":
        return checkpoint_for("bundled", None)
    path = os.path.join(work_dir, "switch-mini-8-rtn")
    manifest = os.path.join(path, "manifest.json")
    if not (os.path.isfile(manifest) and _manifest_complete(manifest)):
        print(f"compressing the bundled model with RTN into {path}", flush=True)
        subprocess.run(
            [
                sys.executable,
                "-m",
                "qmoe_jax.compress",
                "--method",
                "rtn",
                "--eval_examples",
                "0",
                "--output_dir",
                path,
            ],
            cwd=REPO,
            check=True,
        )
    return path


def finetune(name: str, checkpoint: str | None, flags: list[str], work_dir: str) -> dict:
    """One fine-tuning run in its own process: its summary, metrics records and peak RSS."""
    output = os.path.join(work_dir, "runs", name)
    if os.path.isdir(
        output
    ):  # this script's own earlier run: start afresh, so that every figure is measured
        shutil.rmtree(output)
    command = [sys.executable, "-m", "qmoe_jax.finetune", "--output_dir", output, *flags]
    if checkpoint:
        command += ["--checkpoint", checkpoint]
    print(f"fine-tuning {name}: {' '.join(command[1:])}", flush=True)
    completed = subprocess.run(
        [sys.executable, "-c", PEAK_WRAPPER, *command], capture_output=True, text=True, cwd=REPO
    )
    lines = completed.stdout.splitlines()
    if completed.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{completed.stderr[-3000:]}")
    peak = next(int(line.split()[1]) for line in lines if line.startswith("qmoe-peak-rss "))
    summary = json.loads(next(line for line in reversed(lines) if line.startswith("{")))
    with open(os.path.join(output, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    return {
        "name": name,
        "command": " ".join(command[1:]),
        "summary": summary,
        "first": records[0],
        "last": records[-1],
        "peak_rss_gib": peak / 2**30,
    }


def repair(args) -> dict:
    budget = [
        "--task",
        "span_corruption:bundled",
        "--steps",
        str(args.repair_steps),
        "--batch_size",
        "32",
        "--learning_rate",
        str(args.repair_learning_rate),
        "--eval_examples",
        str(args.eval_examples),
        "--eval_every",
        str(args.repair_steps),
        "--checkpoint_every",
        str(args.repair_steps),
    ]
    runs = {"original": finetune("repair-original", None, budget, args.work_dir)}
    for method in ("rtn", "gptq"):
        runs[method] = finetune(
            f"repair-{method}", compressed_bundled(method, args.work_dir), budget, args.work_dir
        )

    def loss(run, when):
        return run[when]["validation_loss"]

    original_before, original_after = (
        loss(runs["original"], "first"),
        loss(runs["original"], "last"),
    )
    rows = []
    for method in ("rtn", "gptq"):
        before, after = loss(runs[method], "first"), loss(runs[method], "last")
        gap = before - original_before
        rows.append(
            {
                "method": method,
                "original_loss": original_before,
                "compressed_loss": before,
                "tuned_loss": after,
                "control_tuned_loss": original_after,
                "gap_recovered": (before - after) / gap if gap > 0 else None,
                "gap_after_vs_control": after - original_after,
            }
        )
    return {"rows": rows, "runs": runs}


def downstream(args) -> dict:
    budget = [
        "--task",
        "name_the_work",
        "--steps",
        str(args.downstream_steps),
        "--batch_size",
        "16",
        "--learning_rate",
        str(args.downstream_learning_rate),
        "--eval_examples",
        str(args.eval_examples),
        "--eval_every",
        str(args.downstream_steps),
        "--checkpoint_every",
        str(args.downstream_steps),
    ]
    gptq = compressed_bundled("gptq", args.work_dir)
    runs = {
        "dense (original bf16), dense parts": finetune(
            "downstream-original", None, budget, args.work_dir
        ),
        "compressed, dense parts": finetune("downstream-compressed", gptq, budget, args.work_dir),
        f"compressed, dense parts + expert LoRA r{args.lora_rank}": finetune(
            "downstream-lora",
            gptq,
            budget + ["--expert_lora_rank", str(args.lora_rank)],
            args.work_dir,
        ),
    }
    rows = [
        {
            "model": name,
            "exact_match": run["last"]["validation_exact_match"],
            "token_accuracy": run["last"]["validation_token_accuracy"],
            "validation_loss": run["last"]["validation_loss"],
        }
        for name, run in runs.items()
    ]
    return {"rows": rows, "runs": runs}


def cost(args) -> dict:
    class Paths:
        experts, work_dir = args.experts, args.synthetic_dir

    path = checkpoint_for("base-shaped", Paths)
    budget = [
        "--task",
        "span_corruption:bundled",
        "--steps",
        str(args.cost_steps),
        "--batch_size",
        str(args.cost_batch_size),
        "--eval_examples",
        str(args.cost_batch_size),
        "--eval_every",
        str(args.cost_steps),
        "--checkpoint_every",
        str(args.cost_steps),
    ]
    runs, rows, ratios = {}, [], {}
    for optimizer in args.cost_optimizers:
        pair = {}
        for form in ("compressed", "dense"):
            name = f"cost-{form}-{optimizer}"
            flags = budget + ["--experts", form, "--optimizer", optimizer]
            runs[name] = pair[form] = finetune(name, path, flags, args.work_dir)
            rows.append(
                {
                    "experts": form,
                    "optimizer": optimizer,
                    "step_seconds": pair[form]["summary"]["step_seconds"],
                    "peak_rss_gib": pair[form]["peak_rss_gib"],
                }
            )
        compressed, dense = (pair[f]["summary"]["step_seconds"] for f in ("compressed", "dense"))
        ratios[optimizer] = {
            "step_time_ratio": compressed / dense,
            "peak_rss_ratio": pair["compressed"]["peak_rss_gib"] / pair["dense"]["peak_rss_gib"],
        }
    return {"rows": rows, "runs": runs, "checkpoint": path, "ratios": ratios}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--goals", nargs="+", choices=GOALS, default=list(GOALS))
    parser.add_argument("--work_dir", default=work_dir("finetune"))
    parser.add_argument(
        "--output",
        default=result_path("finetune"),
        help="the JSON result (rewritten after each goal, so that a goal done is kept)",
    )
    parser.add_argument(
        "--synthetic_dir",
        default=work_dir("inference"),
        help="where benchmarks/inference.py keeps (or this script writes) the synthetic checkpoint",
    )
    parser.add_argument("--experts", type=int, default=16, help="experts of the base-shaped model")
    parser.add_argument("--eval_examples", type=int, default=256)
    parser.add_argument("--repair_steps", type=int, default=300)
    parser.add_argument("--repair_learning_rate", type=float, default=1e-4)
    parser.add_argument("--downstream_steps", type=int, default=400)
    parser.add_argument("--downstream_learning_rate", type=float, default=1e-3)
    parser.add_argument("--lora_rank", type=int, default=8)
    parser.add_argument("--cost_steps", type=int, default=4)
    parser.add_argument("--cost_batch_size", type=int, default=4)
    parser.add_argument(
        "--cost_optimizers",
        nargs="+",
        choices=("adamw", "adafactor"),
        default=["adamw", "adafactor"],
        help="the cost goal's optimizers: each runs the compressed model and its control",
    )
    args = parser.parse_args()
    args.work_dir = os.path.abspath(args.work_dir)
    os.makedirs(args.work_dir, exist_ok=True)
    results = {}
    for goal in args.goals:
        results[goal] = {"repair": repair, "downstream": downstream, "cost": cost}[goal](args)
        write_result("finetune", results, args.output)
        print(
            f"{goal}: "
            + json.dumps({k: v for k, v in results[goal].items() if k != "runs"}, indent=1),
            flush=True,
        )
    print(f"\nCPU: {cpu_model()}, {os.cpu_count()} cores")
    if "repair" in results:
        print(
            f"\n{'repair':<8}{'original':>10}{'compressed':>12}{'tuned':>10}"
            f"{'control tuned':>15}{'gap recovered':>15}"
        )
        for row in results["repair"]["rows"]:
            recovered = (
                "n/a" if row["gap_recovered"] is None else f"{100 * row['gap_recovered']:.0f}%"
            )
            print(
                f"{row['method']:<8}{row['original_loss']:>10.4f}{row['compressed_loss']:>12.4f}"
                f"{row['tuned_loss']:>10.4f}{row['control_tuned_loss']:>15.4f}{recovered:>15}"
            )
    if "downstream" in results:
        print(
            f"\n{'downstream (name_the_work)':<48}{'exact match':>12}{'token acc':>11}{'loss':>8}"
        )
        for row in results["downstream"]["rows"]:
            print(
                f"{row['model']:<48}{row['exact_match']:>12.3f}{row['token_accuracy']:>11.3f}"
                f"{row['validation_loss']:>8.3f}"
            )
    if "cost" in results:
        c = results["cost"]
        print(f"\ncost ({c['checkpoint']})")
        for r in c["rows"]:
            print(
                f"  {r['experts']:<11}{r['optimizer']:<10} step {r['step_seconds']:.2f} s, "
                f"peak RSS {r['peak_rss_gib']:.2f} GiB"
            )
        for optimizer, ratio in c["ratios"].items():
            print(
                f"  {optimizer}: compressed/dense step {ratio['step_time_ratio']:.2f}x, "
                f"peak RSS {ratio['peak_rss_ratio']:.2f}x"
            )


if __name__ == "__main__":
    main()
