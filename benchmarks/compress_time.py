"""Compression wall time, end to end, on switch-base-shaped sparse layers: the CLI's own breakdown,
and a projected wall time for switch-base-128 and switch-c-2048 on this machine (a computed
estimate).

A synthetic T5X checkpoint (random bf16 weights, streaming.py's writer) of a switch-base-shaped
model cut to one sparse layer per stack: d_model 768, d_ff 3072, --experts experts; encoder and
decoder 2 layers each, the second sparse. `python -m qmoe_jax.compress` runs on it once, in a fresh
process, with the bundled calibration text. Every figure is the CLI's own timing (report.json
"seconds" for the run, and each layer's; docs/format.md §8.6):

  read      checkpoint reads (expert stacks, and the non-expert weights)
  forward   the calibration forward: attention and dense MLPs ("dense") + the experts' outputs
    ("forward")
  hessian   the Hessians (and wo's inputs through wi)
  gptq      the GPTQ solver
  encode    dictionary entropy coding
  write     the output checkpoint (dense parameters, each layer, the manifest)
  other     total − the above (start-up checks, calibration data, report)

The encoder's sparse layer comes first and pays the compiles (the unrolled GPTQ programs
take seconds to trace and compile); the decoder's has the same shapes, so its seconds are
the steady cost of a layer, and the difference is the one-time compile.

Projection (an ESTIMATE, computed, not measured), from the decoder (steady) layer:
  gptq    its seconds per expert × experts × sparse layers, scaled for switch-c by the solver's
          useful FLOPs (cols^3/3 + rows·cols^2 for wi and wo), i.e. at the same FLOP rate;
  hessian, expert forward   per calibration token × (d_model^2 + d_ff^2) resp. × d_model·d_ff,
          times each stack's tokens (a layer's tokens do not depend on the number of experts);
  dense forward   per token and layer × d_model·(d_model + d_ff);
  encode  per expert weight;
  read    (expert bytes + 2 × dense bytes: the non-expert weights are read twice) at the run's
          read rate; the synthetic checkpoint was just written, so that rate is the page cache's:
          a checkpoint larger than RAM (switch-c-2048: 3.2 TB in bf16) reads at the disk's rate;
  write   ∝ expert weights;
  first_layer once: the encoder layer's gptq + hessian + encode seconds minus the decoder layer's
          (compiles, the dictionary).
The measured run is small, so the per-shape compiles that every layer pays (Hessians and the
dense forward are jitted per padded token count) weigh more in its per-token rates than in a
full run: the token-proportional phases are upper bounds.
Tokens: --project_samples samples at the run's tokens per sample (encoder and decoder apart).
Model facts (layers, sparse layers, experts, shapes) come from qmoe_jax.models' configs.

    python benchmarks/compress_time.py [--experts 16] [--num_samples 256] [--project_samples 1024]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys
import time

from common import cpu_model, result_path, work_dir, write_result
from gptq_grouping import minimal_flops
from streaming import directory_bytes, fresh_work_dir, synthetic_params

from qmoe_jax import malloc
from qmoe_jax.checkpoints import path_shapes, write_t5x_checkpoint
from qmoe_jax.models import get_config, param_shapes

PHASES = ("read", "forward", "hessian", "gptq", "encode", "write", "other")
TARGETS = ("switch-base-128", "switch-c-2048")
BF16_BYTES = 2


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument(
        "--num_samples", type=int, default=256, help="calibration samples of the measured runs"
    )
    parser.add_argument(
        "--project_samples",
        type=int,
        default=1024,
        help="calibration samples of the projected runs (the CLI's default)",
    )
    parser.add_argument("--work_dir", default=work_dir("compress_time"))
    parser.add_argument("--out", default=result_path("compress_time"), help="the JSON result")
    parser.add_argument(
        "--keep", action="store_true", help="keep the synthetic checkpoint and the outputs"
    )
    return parser.parse_args()


def measured_config(experts: int):
    return dataclasses.replace(
        get_config("switch-base-8"),
        name=f"switch-base-shaped-2-sparse-layers-{experts}",
        num_experts=experts,
        num_encoder_layers=2,
        num_decoder_layers=2,
        num_encoder_sparse_layers=1,
        num_decoder_sparse_layers=1,
        checkpoint_path=None,
        checkpoint_step=None,
    )


def parameter_counts(config) -> tuple[int, int]:
    """(dense, expert) parameter counts of a config."""
    counts = {True: 0, False: 0}
    for path, shape in path_shapes(param_shapes(config)).items():
        counts["/expert/" in path] += math.prod(shape)
    return counts[False], counts[True]


def breakdown(seconds: dict) -> dict:
    """The report's stages as the phases of the issue: read, forward, Hessian, GPTQ, encode, write,
    other."""
    phases = {
        "read": seconds["read"],
        "forward": seconds["dense"] + seconds["forward"] + seconds["replay"],
        "hessian": seconds["hessian"],
        "gptq": seconds["gptq"],
        "encode": seconds["encode"],
        "write": seconds["write"],
    }
    phases["other"] = seconds["total"] - sum(phases.values())
    phases["total"] = seconds["total"]
    return phases


def run_cli(args, checkpoint: str, config_path: str, output_dir: str) -> dict:
    command = [
        sys.executable,
        "-m",
        "qmoe_jax.compress",
        "--checkpoint",
        checkpoint,
        "--config",
        config_path,
        "--num_samples",
        str(args.num_samples),
        "--output_dir",
        output_dir,
        "--eval_examples",
        "0",
    ]
    started = time.perf_counter()
    completed = subprocess.run(command, cwd=args.work_dir, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if completed.returncode != 0:
        print(completed.stdout[-4000:], completed.stderr[-4000:])
        raise SystemExit(f"compression failed with exit code {completed.returncode}")
    printed = [line for line in completed.stdout.splitlines() if line.startswith("time: ")]
    with open(os.path.join(output_dir, "report.json")) as f:
        report = json.load(f)
    layers = {
        layer["name"]: dict(
            seconds=layer["seconds"],
            dropped_tokens=layer["dropped_tokens"],
            tokens_per_expert=layer["tokens_per_expert"],
            # routed tokens: kept (the mean × experts) + dropped over capacity
            tokens=round(layer["tokens_per_expert"]["mean"] * args.experts)
            + layer["dropped_tokens"],
        )
        for layer in report["layers"]
    }
    return dict(
        command=" ".join(command[1:]),
        process_wall_seconds=wall,
        printed=printed,
        seconds=report["seconds"],
        phases=breakdown(report["seconds"]),
        layers=layers,
    )


def gptq_useful_flops(config) -> float:
    return minimal_flops(config.d_ff, config.d_model) + minimal_flops(
        config.d_model, config.d_ff
    )  # wi, wo


def project(run: dict, config, target_name: str, project_samples: int, num_samples: int) -> dict:
    """Estimated seconds per phase of compressing ``target_name`` on this machine (see the module
    docstring)."""
    target = get_config(target_name)
    first, steady = run["layers"]["encoder.layers_1.mlp"], run["layers"]["decoder.layers_1.mlp"]
    per = steady["seconds"]
    d, f, dt, ft = config.d_model, config.d_ff, target.d_model, target.d_ff
    samples = project_samples / num_samples
    stacks = {
        "encoder": (
            target.num_encoder_layers,
            len(target.sparse_layers(decoder=False)),
            first["tokens"],
        ),
        "decoder": (
            target.num_decoder_layers,
            len(target.sparse_layers(decoder=True)),
            steady["tokens"],
        ),
    }
    dense_token_layers = (
        config.num_encoder_layers * first["tokens"] + config.num_decoder_layers * steady["tokens"]
    )
    target_token_layers = sum(layers * tokens * samples for layers, _, tokens in stacks.values())
    target_sparse_tokens = sum(sparse * tokens * samples for _, sparse, tokens in stacks.values())
    sparse = sum(sparse for _, sparse, _ in stacks.values())
    dense_params, expert_params = parameter_counts(config)
    target_dense, target_experts = parameter_counts(target)
    read_rate = (expert_params + 2 * dense_params) * BF16_BYTES / run["seconds"]["read"]
    per_expert_gptq = (
        per["gptq"] / config.num_experts * gptq_useful_flops(target) / gptq_useful_flops(config)
    )
    phases = {
        "read": (target_experts + 2 * target_dense) * BF16_BYTES / read_rate,
        "forward": (
            run["seconds"]["dense"]
            / dense_token_layers
            * target_token_layers
            * dt
            * (dt + ft)
            / (d * (d + f))
            + per["forward"] / steady["tokens"] * target_sparse_tokens * dt * ft / (d * f)
        ),
        "hessian": per["hessian"]
        / steady["tokens"]
        * target_sparse_tokens
        * (dt**2 + ft**2)
        / (d**2 + f**2),
        "gptq": per_expert_gptq * target.num_experts * sparse,
        "encode": per["encode"] / (expert_params / 2) * target_experts,
        "write": run["seconds"]["write"] / expert_params * target_experts,
        "first_layer": max(
            sum(first["seconds"][stage] - per[stage] for stage in ("gptq", "hessian", "encode")),
            0.0,
        ),
    }
    phases["total"] = sum(phases.values())
    return dict(
        model=target_name,
        sparse_layers=sparse,
        experts=target.num_experts,
        d_model=dt,
        d_ff=ft,
        calibration_samples=project_samples,
        expert_bytes_bf16=target_experts * BF16_BYTES,
        read_rate_gb_per_s=read_rate / 1e9,
        per_expert_gptq_seconds=per_expert_gptq,
        estimated_seconds=phases,
    )


def main():
    args = parse_args()
    config = measured_config(args.experts)
    args.work_dir = fresh_work_dir(args.work_dir, ".qmoe_compress_time_benchmark")
    load_before = os.getloadavg()
    huge_pages = malloc.huge_pages_status()
    checkpoint = write_t5x_checkpoint(
        os.path.join(args.work_dir, "t5x"), synthetic_params(config, 0), step=1
    )
    config_path = os.path.join(args.work_dir, "config.json")
    with open(config_path, "w") as f:
        json.dump(dataclasses.asdict(config), f)
    print(f"compressing {config.name} ...", flush=True)
    run = run_cli(args, checkpoint, config_path, os.path.join(args.work_dir, "compressed"))
    projections = [
        project(run, config, target, args.project_samples, args.num_samples) for target in TARGETS
    ]

    print(
        f"\ncompression of switch-base-shaped sparse layers (d_model {config.d_model}, d_ff "
        f"{config.d_ff}, "
        f"{args.experts} experts; one per stack), {args.num_samples} calibration samples; "
        f"{cpu_model()}, "
        f"{os.cpu_count()} CPUs, load average {load_before[0]:.1f} (shared machine); the CLI's "
        "malloc huge pages "
        f"{huge_pages}"
    )
    print("the CLI printed: " + " ".join(run["printed"]))
    print(f"{'':>22} " + " ".join(f"{phase:>8}" for phase in PHASES + ("total",)))
    print(
        f"{'whole run':>22} "
        + " ".join(f"{run['phases'][phase]:>7.1f}s" for phase in PHASES + ("total",))
    )
    for name, layer in run["layers"].items():
        cells = [layer["seconds"].get(phase) for phase in PHASES]
        print(
            f"{name:>22} "
            + " ".join(f"{cell:>7.1f}s" if cell is not None else f"{'':>8}" for cell in cells)
            + f"   ({layer['tokens']} tokens, {layer['tokens_per_expert']['mean']:.0f} per expert)"
        )
    steady = run["layers"]["decoder.layers_1.mlp"]["seconds"]
    print(
        f"steady layer per expert: GPTQ {steady['gptq'] / args.experts:.2f} s, Hessians "
        f"{steady['hessian'] / args.experts:.2f} s, encode {steady['encode'] / args.experts:.3f} s"
    )
    print(
        f"\nPROJECTED wall time on this machine (a computed ESTIMATE, not a run; assumptions in "
        f"benchmarks/compress_time.py's docstring), {args.project_samples} calibration samples:"
    )
    columns = ("read", "forward", "hessian", "gptq", "encode", "write", "first_layer", "total")
    print(f"{'model':>16} " + " ".join(f"{column:>11}" for column in columns))
    for projection in projections:
        estimate = projection["estimated_seconds"]
        print(
            f"{projection['model']:>16} "
            + " ".join(f"{estimate[column] / 3600:>10.2f}h" for column in columns)
        )
    print(
        f"reads at the run's rate, {projections[0]['read_rate_gb_per_s']:.2f} GB/s from the page "
        "cache; "
        "a checkpoint larger than RAM reads at the disk's rate"
    )

    result = dict(
        config=dataclasses.asdict(config),
        args=vars(args),
        malloc_huge_pages=huge_pages,
        checkpoint_bytes=directory_bytes(checkpoint),
        run=run,
        projections=projections,
        projection_is_an_estimate=True,
        load_average_before=load_before,
    )
    write_result("compress_time", result, args.out)
    if not args.keep:
        shutil.rmtree(args.work_dir)


if __name__ == "__main__":
    main()
