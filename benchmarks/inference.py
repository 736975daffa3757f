"""Inference speed and memory: compressed experts (fused kernels) against the dequantized dense
model.

For each model, each form runs in its own process (so that its peak RSS is its
own), on the same checkpoint and the same random tokens:

  compressed     ternary experts through the fused kernels, float32 activations; only the
                 experts that received tokens, and only their slots in use, are computed
  dense f32      the same experts dequantized to float32; a call of up to 16 tokens gathers
                 each token's own expert kernels (the faster dense path when decoding)
  dense f32 t5x  the same in T5X's layout: every expert multiplies every capacity slot
  dense bf16     dequantized to bfloat16, bfloat16 activations (slow on XLA:CPU)

and measures teacher-forced evaluation (target tokens/s, batch 8), greedy
decoding tokens/s at batch 1 and batch 8, and the process's peak RSS. Each
timing is the median of --repeats runs after one compiling run. "experts
share" is the part of a batch-1 decoding step spent in the expert layers: the
same step with an expert layer that does no work (routing, dispatch and
combine still run) is timed beside it.

Models:
  bundled            the main job's output (runs/compressed/switch-mini-8; made if missing)
  base-shaped        synthetic switch-base shape (d 768, f 3072, 12+12 layers, every other
                     one sparse) with --experts experts, small enough for dense float32 to fit
  base128-shaped     the same with 128 experts: 30 GB as dense float32, so compressed only

The synthetic checkpoints are made directly from random ternary codes at QMoE's
zero fraction (P(0) = 0.885, static dictionary) and random dense weights,
without a dense source model: their outputs are meaningless, their cost is
real. They are written once into --work_dir and reused.

    python benchmarks/inference.py                       # all three models
    python benchmarks/inference.py --models bundled --quick
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np
from common import REPO, cpu_model, result_path, work_dir, write_result

MODELS = ("bundled", "base-shaped", "base128-shaped")
FORMS = ("compressed", "dense f32", "dense f32 t5x", "dense bf16")
# Runs argv[1:] and reports its peak RSS; being small, its own size at fork barely counts.
PEAK_WRAPPER = (
    "import resource, subprocess, sys\n"
    "code = subprocess.call(sys.argv[1:])\n"
    "print('qmoe-peak-rss', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024, "
    "flush=True)\n"
    "sys.exit(code)\n"
)


# ---------------------------------------------------------------- synthetic checkpoints


def synthetic_config(experts: int):
    from qmoe_jax.models import get_config

    return dataclasses.replace(
        get_config("switch-base-8"),
        name=f"switch-base-shaped-{experts}",
        num_experts=experts,
        checkpoint_path=None,
        checkpoint_step=None,
    )


def random_dense(config, rng: np.random.Generator) -> dict:
    """Random bfloat16 dense (non-expert) parameters of ``config``: layer-norm scales 1, other
    kernels N(0, 1/fan_in)."""
    import ml_dtypes

    from qmoe_jax.checkpoints import path_shapes
    from qmoe_jax.models import param_shapes

    dense: dict = {}
    for path, shape in path_shapes(param_shapes(config)).items():
        if "/expert/" in path:
            continue
        if path.endswith("scale"):
            value = np.ones(shape, ml_dtypes.bfloat16)
        else:
            fan_in = shape[-2] if len(shape) >= 2 else 1
            value = (rng.standard_normal(shape, dtype=np.float32) / np.sqrt(fan_in)).astype(
                ml_dtypes.bfloat16
            )
        node = dense
        for key in path.split("/")[:-1]:
            node = node.setdefault(key, {})
        node[path.split("/")[-1]] = value
    return dense


def write_synthetic_checkpoint(directory: str, experts: int, seed: int = 0) -> None:
    """A compressed checkpoint of the switch-base shape with ``experts`` experts, from random
    ternary codes."""
    import ml_dtypes

    from qmoe_jax.checkpoints.format_v1 import CompressedCheckpointWriter
    from qmoe_jax.checkpoints.layer_arrays import ternary_arrays
    from qmoe_jax.codec import build_dictionary, encode_experts
    from qmoe_jax.models.mlp import kernel_names

    config = synthetic_config(experts)
    rng = np.random.default_rng(seed)
    dictionary = build_dictionary(0.885)
    writer = CompressedCheckpointWriter(
        directory,
        {
            "model": dataclasses.asdict(config),
            "source": "synthetic: random ternary codes at P(0) = 0.885",
            "grid": {"kind": "ternary", "bits": None},
            "settings": {"synthetic": True},
        },
    )
    writer.write_dense(random_dense(config, rng))
    fingerprint = writer.write_dictionary(dictionary)
    sparse = [
        f"{stack}.layers_{i}.mlp"
        for stack, count in (
            ("encoder", config.num_encoder_layers),
            ("decoder", config.num_decoder_layers),
        )
        for i in range(count)
        if config.is_sparse_layer(i, decoder=stack == "decoder")
    ]
    for number, name in enumerate(sparse, 1):
        arrays = {}
        for kernel in kernel_names(config):
            rows, cols = (
                (config.d_model, config.d_ff) if kernel == "wo" else (config.d_ff, config.d_model)
            )
            draws = rng.random((experts, rows, cols), dtype=np.float32)
            codes = np.where(draws < 0.885, 0, np.where(draws < 0.9425, 1, 2)).astype(np.uint8)
            del draws
            scale = rng.random((experts, rows, 1), dtype=np.float32) * 0.1
            minmax = np.concatenate([-scale, scale], axis=-1).astype(ml_dtypes.bfloat16)
            arrays[kernel] = ternary_arrays([encode_experts(codes, minmax, dictionary)])
            del codes
        writer.write_layer(name, arrays, {"dictionary": fingerprint})
        print(
            f"  synthetic {config.name}: {number}/{len(sparse)} sparse layers written", flush=True
        )
    writer.finalize({})


# ---------------------------------------------------------------- one form, in a child process


def expert_share_module(module):
    """The same model with expert layers that return zeros (routing, dispatch and combine still
    run)."""
    import flax.linen as nn
    import jax.numpy as jnp

    from qmoe_jax.models import SwitchTransformer

    class IdleExperts(nn.Module):
        config: object

        @nn.compact
        def __call__(self, expert_inputs, counts=None, *, enable_dropout: bool = False):
            return jnp.zeros_like(expert_inputs)

    return SwitchTransformer(module.config, experts_cls=IdleExperts)


def measure(
    path: str,
    form: str,
    repeats: int,
    decode_length: int,
    eval_batches: int,
    batch_sizes: list[int],
) -> dict:
    import jax
    import jax.numpy as jnp

    from qmoe_jax.inference import make_eval_step, open_model
    from qmoe_jax.inference.strategies import DecodingConfig, generate
    from qmoe_jax.models import MlpExperts, SwitchTransformer

    dtype = jnp.bfloat16 if form == "dense bf16" else jnp.float32
    started = time.perf_counter()
    model = open_model(
        path,
        experts="compressed" if form == "compressed" else "dense",
        dtype=dtype,
        expert_parallel="off",
    )
    jax.block_until_ready(model.params)
    if form == "dense f32 t5x":
        model = dataclasses.replace(
            model,
            module=SwitchTransformer(
                model.config, experts_cls=functools.partial(MlpExperts, gather_tokens=0)
            ),
        )
    result = {"load_seconds": time.perf_counter() - started}
    vocab = model.config.vocab_size
    rng = np.random.default_rng(0)

    def median_seconds(run) -> float:
        jax.block_until_ready(run())  # compiles
        times = []
        for _ in range(repeats):
            begin = time.perf_counter()
            jax.block_until_ready(run())
            times.append(time.perf_counter() - begin)
        return statistics.median(times)

    batch = {
        "encoder_input_tokens": rng.integers(3, vocab - 100, (8, 128)).astype(np.int32),
        "decoder_target_tokens": rng.integers(3, vocab - 100, (8, 32)).astype(np.int32),
    }
    batch["decoder_input_tokens"] = np.pad(batch["decoder_target_tokens"][:, :-1], ((0, 0), (1, 0)))
    batch["decoder_loss_weights"] = np.ones((8, 32), np.float32)
    eval_step = make_eval_step(model.module)
    seconds = median_seconds(lambda: [eval_step(model.params, batch) for _ in range(eval_batches)])
    result["eval_target_tokens_per_second"] = eval_batches * 8 * 32 / seconds
    config = DecodingConfig(max_decode_length=decode_length, eos_id=-1)
    for size in batch_sizes:
        prompts = rng.integers(3, vocab - 100, (size, 32)).astype(np.int32)
        seconds = median_seconds(
            lambda prompts=prompts: generate(model.module, model.params, prompts, config).tokens
        )
        result[f"greedy_b{size}_tokens_per_second"] = size * decode_length / seconds
        if size == 1:
            idle = expert_share_module(model.module)
            idle_seconds = median_seconds(
                lambda idle=idle, prompts=prompts: (
                    generate(idle, model.params, prompts, config).tokens
                )
            )
            result["greedy_b1_experts_share"] = max(0.0, 1.0 - idle_seconds / seconds)
    return result


def run_child(path: str, form: str, args) -> dict:
    command = [
        sys.executable,
        os.path.abspath(__file__),
        "--child",
        path,
        "--form",
        form,
        "--repeats",
        str(args.repeats),
        "--decode_length",
        str(args.decode_length),
        "--eval_batches",
        str(args.eval_batches),
        "--batch_sizes",
        *map(str, args.batch_sizes),
    ]
    completed = subprocess.run(
        [sys.executable, "-c", PEAK_WRAPPER, *command], capture_output=True, text=True, cwd=REPO
    )
    lines = completed.stdout.splitlines()
    peak = next((int(line.split()[1]) for line in lines if line.startswith("qmoe-peak-rss ")), 0)
    if completed.returncode != 0:
        return {
            "error": (completed.stderr or completed.stdout)[-1500:],
            "peak_rss_gib": peak / 2**30,
        }
    result = json.loads(next(line for line in reversed(lines) if line.startswith("{")))
    return result | {"peak_rss_gib": peak / 2**30}


# ---------------------------------------------------------------- driver


def _manifest_complete(manifest: str) -> bool:
    """Whether `manifest` exists and marks its checkpoint complete."""
    if not os.path.isfile(manifest):
        return False
    with open(manifest) as f:
        return bool(json.load(f).get("complete"))


def checkpoint_for(model: str, args) -> str:
    if model == "bundled":
        path = os.path.join(REPO, "runs", "compressed", "switch-mini-8")
        if not os.path.isfile(os.path.join(path, "manifest.json")):
            print(
                "making the bundled model's compressed checkpoint (python -m qmoe_jax.compress)",
                flush=True,
            )
            subprocess.run(
                [sys.executable, "-m", "qmoe_jax.compress", "--eval_examples", "0"],
                cwd=REPO,
                check=True,
            )
        return path
    experts = args.experts if model == "base-shaped" else 128
    path = os.path.join(os.path.abspath(args.work_dir), f"switch-base-shaped-{experts}")
    if not _manifest_complete(os.path.join(path, "manifest.json")):
        print(f"writing the synthetic {model} checkpoint ({experts} experts) to {path}", flush=True)
        subprocess.run(
            [
                sys.executable,
                os.path.abspath(__file__),
                "--write_synthetic",
                path,
                "--experts",
                str(experts),
            ],
            check=True,
        )
    return path


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--forms", nargs="+", choices=FORMS, default=list(FORMS))
    parser.add_argument("--experts", type=int, default=16, help="experts of the base-shaped model")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--decode_length", type=int, default=16, help="greedy tokens per sequence")
    parser.add_argument(
        "--eval_batches", type=int, default=2, help="teacher-forced batches per timing"
    )
    parser.add_argument(
        "--batch_sizes", type=int, nargs="+", default=[1, 8, 64], help="greedy decoding batch sizes"
    )
    parser.add_argument(
        "--work_dir", default=work_dir("inference"), help="where the synthetic checkpoints are kept"
    )
    parser.add_argument("--output", default=result_path("inference"), help="the JSON result")
    parser.add_argument("--quick", action="store_true", help="bundled model only, fewer repeats")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--form", help=argparse.SUPPRESS)
    parser.add_argument("--write_synthetic", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.write_synthetic:
        write_synthetic_checkpoint(args.write_synthetic, args.experts)
        return
    if args.child:
        print(
            json.dumps(
                measure(
                    args.child,
                    args.form,
                    args.repeats,
                    args.decode_length,
                    args.eval_batches,
                    args.batch_sizes,
                )
            )
        )
        return
    if args.quick:
        args.models, args.repeats, args.decode_length, args.eval_batches = ["bundled"], 2, 8, 1
        args.batch_sizes = [1, 8]

    rows = []
    for model in args.models:
        path = checkpoint_for(model, args)
        forms = [f for f in args.forms if model != "base128-shaped" or f == "compressed"]
        for form in forms:
            print(f"measuring {model} / {form} ...", flush=True)
            rows.append({"model": model, "form": form, **run_child(path, form, args)})

    greedy = [f"greedy b{size}" for size in args.batch_sizes]
    lines = [
        f"{'model':<16}{'form':<15}{'eval tok/s':>11}"
        + "".join(f"{g:>12}" for g in greedy)
        + f"{'experts share b1':>18}{'peak RSS GiB':>14}"
    ]
    for row in rows:
        if "error" in row:
            message = [line for line in row["error"].splitlines() if "Error" in line] or row[
                "error"
            ].splitlines()
            lines.append(f"{row['model']:<16}{row['form']:<15} failed: {message[-1][:100]}")
            continue
        lines.append(
            f"{row['model']:<16}{row['form']:<15}{row['eval_target_tokens_per_second']:>11.1f}"
            + "".join(
                f"{row[f'greedy_b{size}_tokens_per_second']:>12.2f}" for size in args.batch_sizes
            )
            + f"{row['greedy_b1_experts_share']:>18.2f}{row['peak_rss_gib']:>14.2f}"
        )
    ratios = []
    for model in args.models:
        by_form = {r["form"]: r for r in rows if r["model"] == model and "error" not in r}
        for baseline in ("dense f32", "dense f32 t5x"):
            if "compressed" in by_form and baseline in by_form:
                c, d = by_form["compressed"], by_form[baseline]

                def speed(key, c=c, d=d):
                    return f"{c[key] / d[key]:.2f}x"

                ratios.append(
                    f"{model}: compressed / {baseline}: eval "
                    f"{speed('eval_target_tokens_per_second')}, "
                    + "".join(
                        f"greedy b{size} {speed(f'greedy_b{size}_tokens_per_second')}, "
                        for size in args.batch_sizes
                    )
                    + f"peak RSS {c['peak_rss_gib'] / d['peak_rss_gib']:.2f}x"
                )
    print(
        f"\nCPU: {cpu_model()}, {os.cpu_count()} cores; synthetic models: random ternary codes "
        "at P(0) = 0.885, no dense source"
    )
    print("\n".join(lines + [""] + ratios))
    write_result("inference", {"rows": rows}, args.output)


if __name__ == "__main__":
    main()
