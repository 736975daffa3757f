"""Inference speed as llama-bench measures it: prefill and decode tokens/s, bytes per decoded
token, and the memory-bandwidth bound, for each form of each model.

Forms ("<experts> <dense storage>"):

  compressed f32    ternary experts through the fused kernels; dense parameters float32
  compressed bf16   the same, dense matrices and embedding stored bfloat16 (--dense_dtype)
  compressed int8   the same, dense matrices and embedding stored int8 with per-channel scales
  dense f32         the experts dequantized to float32 (a decoding step gathers each token's
                    own expert), dense parameters float32: the uncompressed baseline
  dense bf16, dense int8   dequantized experts with packed dense parameters (not by default)

Measures, greedy decoding at batch 1 from a random prompt of --prompt_length tokens:

  prefill tok/s     encoder tokens per second over one --prefill_length prompt (batch 1)
  decode tok/s      1 / (time per decoded token), where time per decoded token =
                    (time to generate 33 tokens - time to generate 1) / 32, so that the
                    encoder, the cache set-up and dispatch are not in it
  MB/token          the bytes a decoded token reads, from the loaded parameter tree in its
                    stored dtypes: the decoder's parameters except the cross-attention key and
                    value kernels (applied once per sequence, to the encoder outputs), the
                    output embedding (tied logits; or logits_dense), one routed expert per
                    sparse decoder layer (compressed: the mean expert's codes, row offsets and
                    row grid), and the KV cache at its mean length
  bound ms          MB/token / the copy bandwidth measured right before the form's round
                    (benchmarks/common.py: every core copying, read + write bytes)
  of bound          bound ms / measured ms per token, per round

The copy bandwidth is measured again before every form's round, not once per round: on a VM
it moves in steps (about 37 or about 60 GB/s on the Zen 2 of docs/measurements.md, for tens of
seconds at a time), and a copy measured after the dense f32 form's seconds of streaming read
38 GB/s where one after the int8 form's read 61, so a figure taken at the start of a round
told of the form that ran last in the round before, not of the forms it was paired with.

Each form of a model lives in its own child process for the whole run (so that its peak RSS is
its own), and the driver asks them for one measurement each in turn, round after round: on a
loaded machine the ratios of one round hold even where absolute times do not. Reported: the
median over rounds, and each form's decode speed against "dense f32" as the median of its
per-round ratios. The load average is recorded with every round; timings taken on a loaded
machine are not measurements of the machine.

Models:
  bundled            the main job's output (runs/compressed/switch-mini-8; made if missing)
  base-shaped        synthetic switch-base shape (d 768, f 3072, 12+12 layers, every other
                     one sparse) with --experts experts, small enough for dense float32 to fit
  base128-shaped     the same with 128 experts: 30 GB as dense float32, so compressed only

The synthetic checkpoints are made directly from random ternary codes at QMoE's
zero fraction (P(0) = 0.885, static dictionary) and random dense weights,
without a dense source model: their outputs are meaningless, their cost is
real. They are written once into --work_dir and reused.

--isas measures every form once per instruction set the CPU kernels have here (``ops.cpu_isas()``
but portable) in each round, in the same process, QMOE_CPU_ISA set before each measurement (the
kernels read it at each call), the sets' order alternating from round to round: rows "<form>
[<isa>]", so that the sets compare on one loaded model, its memory placed once.

    python benchmarks/inference.py                              # all three models
    python benchmarks/inference.py --models base-shaped --rounds 7
    python benchmarks/inference.py --models bundled --quick
    python benchmarks/inference.py --models base128-shaped --forms "compressed int8" --isas
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np
from common import REPO, cpu_model, memory_bandwidth, result_path, work_dir, write_result

MODELS = ("bundled", "base-shaped", "base128-shaped")
FORMS = (
    "compressed f32",
    "compressed bf16",
    "compressed int8",
    "dense f32",
    "dense bf16",
    "dense int8",
)
DEFAULT_FORMS = ("compressed f32", "compressed bf16", "compressed int8", "dense f32")
BASELINE = "dense f32"
DENSE_DTYPES = {"f32": "float32", "bf16": "bfloat16", "int8": "int8"}
DECODED = 32  # time per token = (time for DECODED + 1 tokens - time for 1) / DECODED
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
        arrays, kernels = {}, {}
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
            codewords = int(arrays[kernel]["row_offsets"][:, -1].astype(np.int64).sum())
            kernels[kernel] = {  # the stats docs/format.md §8.5 asks of every kernel
                "rows": rows,
                "cols": cols,
                "zero_fraction": float(np.mean(codes == 0)),
                "codewords": codewords,
                "bits_per_weight": (16.0 * codewords + 64.0 * rows * experts) / codes.size,
            }
            del codes
        writer.write_layer(name, arrays, {"dictionary": fingerprint, "kernels": kernels})
        print(
            f"  synthetic {config.name}: {number}/{len(sparse)} sparse layers written", flush=True
        )
    writer.finalize({})


# ---------------------------------------------------------------- one form, in a child process


def _tree_bytes(tree) -> int:
    import jax

    return sum(int(np.asarray(leaf).nbytes) for leaf in jax.tree.leaves(tree))


def _expert_bytes(stack, num_experts: int) -> float:
    """Bytes one expert of a stack reads: a dense kernel's slice, or a compressed expert's codes in
    use (its row offsets' last entry), row offsets and row grid, averaged over the experts."""
    from qmoe_jax.codec import CompressedExperts

    if not isinstance(stack, CompressedExperts):
        return np.asarray(stack).nbytes / num_experts
    offsets = np.asarray(stack.row_offsets)
    codes = offsets[:, -1].astype(np.float64) * np.asarray(stack.codes).itemsize
    per_expert = codes + offsets[0].nbytes + np.asarray(stack.minmax)[0].nbytes
    return float(per_expert.mean())


def decoded_token_bytes(params, config, prompt_length: int, cache_length: int) -> dict:
    """What one greedy decoding step reads, in bytes, from the parameter tree as loaded."""
    from qmoe_jax.kernels.dense import PackedMatrix

    is_leaf = lambda leaf: isinstance(leaf, PackedMatrix)  # noqa: E731

    def nbytes(tree) -> int:
        import jax

        leaves = jax.tree.leaves(tree, is_leaf=is_leaf)
        return sum(
            leaf.nbytes if isinstance(leaf, PackedMatrix) else int(np.asarray(leaf).nbytes)
            for leaf in leaves
        )

    decoder_dense = experts = 0.0
    for layer_name, layer in params["decoder"].items():
        if not layer_name.startswith("layers_"):
            decoder_dense += nbytes(layer)
            continue
        for part, value in layer.items():
            if part == "encoder_decoder_attention":
                decoder_dense += nbytes(value["query"]) + nbytes(value["out"])
            elif part == "mlp" and "expert" in value:
                decoder_dense += nbytes({k: v for k, v in value.items() if k != "expert"})
                for kernel, stack in value["expert"].items():
                    if kernel == "lora":
                        experts += nbytes(stack) / config.num_experts
                    else:
                        stack = stack["kernel"] if isinstance(stack, dict) else stack
                        experts += _expert_bytes(stack, config.num_experts)
            else:
                decoder_dense += nbytes(value)
    embedding = 0 if config.logits_dense else nbytes(params["token_embedder"])
    width = config.num_heads * config.d_kv * 4  # float32 keys or values of one position
    mean_cache = (cache_length + 1) / 2
    cache = config.num_decoder_layers * 2 * width * (prompt_length + mean_cache)
    return {
        "decoder_dense_bytes": decoder_dense,
        "embedding_bytes": embedding,
        "experts_bytes": experts,
        "kv_cache_bytes": cache,
        "total_bytes": decoder_dense + embedding + experts + cache,
    }


class FormRunner:
    """One form of one model, loaded and compiled; ``round()`` measures once."""

    def __init__(self, path: str, form: str, args):
        import jax

        from qmoe_jax.inference import open_model

        experts, dense = form.split()
        started = time.perf_counter()
        self.model = open_model(
            path,
            experts=experts,
            dense_dtype=DENSE_DTYPES[dense],
            expert_parallel="off",
        )
        jax.block_until_ready(self.model.params)
        self.load_seconds = time.perf_counter() - started
        rng = np.random.default_rng(0)
        vocab = self.model.config.vocab_size
        self.prompt = rng.integers(3, vocab - 100, (1, args.prompt_length)).astype(np.int32)
        self.prefill = rng.integers(3, vocab - 100, (1, args.prefill_length)).astype(np.int32)
        self.repeats = args.repeats
        self.info = {
            "load_seconds": self.load_seconds,
            "params_bytes": _tree_bytes(self.model.params),
            **decoded_token_bytes(
                self.model.params, self.model.config, args.prompt_length, DECODED + 1
            ),
        }
        started = time.perf_counter()
        self.round()  # compiles every program
        self.info["compile_seconds"] = time.perf_counter() - started

    def _best(self, run) -> float:
        import jax

        best = float("inf")
        for _ in range(self.repeats):
            begin = time.perf_counter()
            jax.block_until_ready(run())
            best = min(best, time.perf_counter() - begin)
        return best

    def _generate(self, length: int):
        from qmoe_jax.inference.strategies import DecodingConfig, generate

        config = DecodingConfig(max_decode_length=length, eos_id=-1)
        return generate(self.model.module, self.model.params, self.prompt, config).tokens

    def round(self) -> dict:
        model = self.model
        prefill = self._best(
            lambda: model.module.apply({"params": model.params}, self.prefill, method="encode")
        )
        one = self._best(lambda: self._generate(1))
        many = self._best(lambda: self._generate(DECODED + 1))
        return {
            "prefill_seconds": prefill,
            "prefill_tokens_per_second": self.prefill.size / prefill,
            "first_token_seconds": one,
            "decode_seconds_per_token": (many - one) / DECODED,
            "load_average": os.getloadavg()[0],
        }


def serve(path: str, form: str, args) -> None:
    """The child's loop: load, report, then one JSON line per "round" or "round <isa>" line on
    stdin (the latter sets QMOE_CPU_ISA first)."""
    runner = FormRunner(path, form, args)
    print(json.dumps({"ready": runner.info}), flush=True)
    for line in sys.stdin:
        words = line.split()
        if not words or words[0] != "round":
            break
        if len(words) > 1:
            os.environ["QMOE_CPU_ISA"] = words[1]
        print(json.dumps(runner.round()), flush=True)


class Child:
    """A form's child process (under the peak-RSS wrapper), driven over its stdin and stdout."""

    def __init__(self, path: str, form: str, args):
        self.form = form
        command = [
            sys.executable,
            os.path.abspath(__file__),
            "--child",
            path,
            "--form",
            form,
            "--repeats",
            str(args.repeats),
            "--prompt_length",
            str(args.prompt_length),
            "--prefill_length",
            str(args.prefill_length),
        ]
        self.process = subprocess.Popen(
            [sys.executable, "-c", PEAK_WRAPPER, *command],
            cwd=REPO,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.info = self._reply()["ready"]

    def _reply(self) -> dict:
        for line in self.process.stdout:
            if line.startswith("{"):
                return json.loads(line)
        error = self.process.stderr.read()[-2000:]
        raise RuntimeError(f"{self.form} failed:\n{error}")

    def round(self, isa: str | None = None) -> dict:
        self.process.stdin.write("round\n" if isa is None else f"round {isa}\n")
        self.process.stdin.flush()
        return self._reply()

    def close(self) -> float:
        """Ends the child; returns its peak RSS in GiB."""
        self.process.stdin.close()
        peak = 0
        for line in self.process.stdout:
            if line.startswith("qmoe-peak-rss "):
                peak = int(line.split()[1])
        self.process.wait()
        return peak / 2**30


def label(form: str, isa: str | None) -> str:
    return form if isa is None else f"{form} [{isa}]"


def measure_model(
    model: str, path: str, forms: list[str], args, isas: list[str] | None = None
) -> list[dict]:
    """Every form of one model, interleaved round by round; with ``isas``, each form once per
    instruction set in every round (in its own process, the sets' order alternating)."""
    children = []
    sets = isas or [None]
    labels = [label(form, isa) for form in forms for isa in sets]
    try:
        for form in forms:
            print(f"  {model} / {form}: loading and compiling", flush=True)
            children.append(Child(path, form, args))
        rounds = {name: [] for name in labels}
        for number in range(args.rounds):
            for child in children:
                for isa in sets if number % 2 == 0 else sets[::-1]:
                    copy = memory_bandwidth(megabytes=args.bandwidth_mb)["copy_gb_s"]
                    rounds[label(child.form, isa)].append(child.round(isa) | {"copy_gb_s": copy})
            line = ", ".join(
                f"{f} {1e3 * rounds[f][-1]['decode_seconds_per_token']:.2f} "
                f"({rounds[f][-1]['copy_gb_s']:.0f} GB/s)"
                for f in labels
            )
            print(
                f"  round {number + 1}/{args.rounds} (load {os.getloadavg()[0]:.1f}): ms/token "
                f"(copy before it) {line}",
                flush=True,
            )
    finally:
        peaks = {child.form: child.close() for child in children}
    rows = []
    for form, isa in [(form, isa) for form in forms for isa in sets]:
        info = next(child.info for child in children if child.form == form)
        per_round = rounds[label(form, isa)]
        decode = statistics.median(r["decode_seconds_per_token"] for r in per_round)
        bounds = [info["total_bytes"] / (r["copy_gb_s"] * 1e9) for r in per_round]
        row = {
            "model": model,
            "form": label(form, isa),
            **info,
            "rounds": per_round,
            "prefill_tokens_per_second": statistics.median(
                r["prefill_tokens_per_second"] for r in per_round
            ),
            "decode_seconds_per_token": decode,
            "decode_tokens_per_second": 1 / decode,
            "bound_seconds_per_token": statistics.median(bounds),
            "fraction_of_bound": statistics.median(
                b / r["decode_seconds_per_token"] for b, r in zip(bounds, per_round)
            ),
            "load_average_median": statistics.median(r["load_average"] for r in per_round),
            "peak_rss_gib": peaks.get(form, 0.0),
        }
        baseline = label(BASELINE, isa)
        if baseline in rounds:
            row["decode_speedup_over_dense_f32"] = statistics.median(
                b["decode_seconds_per_token"] / r["decode_seconds_per_token"]
                for b, r in zip(rounds[baseline], per_round)
            )
        rows.append(row)
    return rows


# ---------------------------------------------------------------- driver


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
    manifest = os.path.join(path, "manifest.json")
    complete = False
    if os.path.isfile(manifest):
        with open(manifest) as f:
            complete = bool(json.load(f).get("complete"))
    if not complete:
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
    parser.add_argument("--forms", nargs="+", choices=FORMS, default=list(DEFAULT_FORMS))
    parser.add_argument("--experts", type=int, default=16, help="experts of the base-shaped model")
    parser.add_argument("--rounds", type=int, default=5, help="measurements of each form")
    parser.add_argument(
        "--repeats", type=int, default=3, help="runs per measurement and round (the best counts)"
    )
    parser.add_argument("--prompt_length", type=int, default=32, help="decoding prompt tokens")
    parser.add_argument("--prefill_length", type=int, default=128, help="prefill prompt tokens")
    parser.add_argument(
        "--bandwidth_mb", type=int, default=512, help="bytes of the copy-bandwidth measurement"
    )
    parser.add_argument("--work_dir", default=work_dir("inference"))
    parser.add_argument("--output", default=result_path("inference"), help="the JSON result")
    parser.add_argument("--quick", action="store_true", help="bundled model only, fewer rounds")
    parser.add_argument(
        "--isas",
        action="store_true",
        help="each form once per instruction set of the CPU kernels in every round, in the same "
        "process (rows '<form> [<isa>]')",
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--form", help=argparse.SUPPRESS)
    parser.add_argument("--write_synthetic", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.write_synthetic:
        write_synthetic_checkpoint(args.write_synthetic, args.experts)
        return
    if args.child:
        serve(args.child, args.form, args)
        return
    if args.quick:
        args.models, args.rounds, args.repeats = ["bundled"], 3, 2

    isas = None
    if args.isas:
        from qmoe_jax.kernels import ops

        isas = [isa for isa in ops.cpu_isas() if isa != "portable"]
    started_load = os.getloadavg()
    rows = []
    for model in args.models:
        path = checkpoint_for(model, args)
        forms = [f for f in args.forms if model != "base128-shaped" or f.startswith("compressed")]
        rows += measure_model(model, path, forms, args, isas)

    cpu = cpu_model()
    width = max(17, *(len(row["form"]) + 1 for row in rows))
    header = (
        f"{'model':<16}{'form':<{width}}{'prefill tok/s':>14}{'decode tok/s':>13}{'ms/token':>10}"
        f"{'MB/token':>10}{'bound ms':>10}{'of bound':>10}{'vs dense f32':>14}{'peak GiB':>10}"
    )
    lines = [header]
    for row in rows:
        speedup = row.get("decode_speedup_over_dense_f32")
        lines.append(
            f"{row['model']:<16}{row['form']:<{width}}{row['prefill_tokens_per_second']:>14.1f}"
            f"{row['decode_tokens_per_second']:>13.1f}"
            f"{1e3 * row['decode_seconds_per_token']:>10.2f}"
            f"{row['total_bytes'] / 1e6:>10.1f}{1e3 * row['bound_seconds_per_token']:>10.2f}"
            f"{row['fraction_of_bound']:>10.0%}"
            + (f"{speedup:>13.2f}x" if speedup is not None else f"{'':>14}")
            + f"{row['peak_rss_gib']:>10.2f}"
        )
    loads = [r["load_average"] for row in rows for r in row["rounds"]]
    copies = [r["copy_gb_s"] for row in rows for r in row["rounds"]]
    print(
        f"\nCPU: {cpu}, {os.cpu_count()} cores; load average {started_load[0]:.1f} at the start, "
        f"{min(loads):.1f} to {max(loads):.1f} over the rounds (a loaded machine's times are not "
        f"measurements); copy {min(copies):.1f}-{max(copies):.1f} GB/s (median "
        f"{statistics.median(copies):.1f}) before the forms' rounds; synthetic models: random "
        "ternary codes at P(0) = 0.885, no dense source"
    )
    print("\n".join(lines))
    if isas and len(isas) > 1:
        print(f"time per decoded token, {isas[0]} / other sets, median of the per-round ratios:")
        by_label = {(row["model"], row["form"]): row for row in rows}
        for row in rows:
            for isa in isas[1:]:
                suffix = f" [{isas[0]}]"
                if not row["form"].endswith(suffix):
                    continue
                other = by_label[(row["model"], row["form"][: -len(suffix)] + f" [{isa}]")]
                ratio = statistics.median(
                    a["decode_seconds_per_token"] / b["decode_seconds_per_token"]
                    for a, b in zip(row["rounds"], other["rounds"])
                )
                print(f"  {row['model']} {row['form']} / {isa}: {ratio:.3f}")
    write_result(
        "inference",
        {"load_average_at_start": started_load, "rows": rows},
        path=args.output,
    )


if __name__ == "__main__":
    main()
