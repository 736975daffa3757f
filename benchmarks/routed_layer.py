"""A sparse layer's scoring call with many experts: the routed kernel against the dispatch buffer.

With T5X's grouping (G ≥ E groups once a call's N tokens are a multiple of E), the dispatch path
fills a buffer of E · G · slots rows, whatever N is: at switch-c-2048's E = 2048 and capacity 2,
a call of 4096 tokens gets 8.4 M rows, 2048 per token, and the experts' hidden units and outputs
as many again. The routed path (``ops.matmul_routed``) keeps the N tokens where they are, each
with its expert's index, and the kernel groups them by expert: its buffers hold N rows.

One ``MoeLayer`` of switch-c-2048's routing (E, group size, capacity factor, minimum capacity)
with small expert matrices (``--d_model``, ``--d_ff``), so that the dispatch path still fits in
memory here, compressed from i.i.d. ternary codes at P(0) = 0.885. For each path:

  temp bytes   XLA's own account of the compiled program's temporary buffers
               (``memory_analysis().temp_size_in_bytes``), and its ratio to the tokens' bytes
  time         one call, the two paths taking turns in shuffled rounds (medians)

and the largest difference between their outputs. A path whose program's temporaries exceed
``--max_temp_gb`` is compiled and accounted, not run.

Then whole models, the synthetic switch-base-shaped checkpoints of benchmarks/inference.py (16
and 128 experts, int8 dense parameters; made there if missing): the routed experts against the
same model with ``routed=False`` (the per-token path for decoding steps of up to
``min(16, E // 16)`` tokens, the dispatch above), taking turns round by round: an encoder pass
of ``--prefill_batch`` × 128 tokens (best of 3 per round), and greedy decoding at batch 1, ms
per decoded token as inference.py measures it ((33 tokens − 1 token) / 32, best of 3 each). The
ratios are medians of the per-round ratios; the greedy tokens and encoder outputs of the two
must agree.

    python benchmarks/routed_layer.py [--experts 2048] [--tokens 4096] [--repeats 7]
    python benchmarks/routed_layer.py --models        # the layer, then the two models
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from common import cpu_model, result_path, work_dir, write_result
from kernels_cpu import P0, encode_matrix, side_by_side, synthetic

from qmoe_jax.codec import CompressedExperts, build_dictionary
from qmoe_jax.models import MoeLayer
from qmoe_jax.models.compressed_experts import CompressedMlpExperts
from qmoe_jax.models.configs import get_config

PATHS = {"routed": dict(routed=True), "dispatch": dict(routed=False, per_token_limit=0)}


def expert_stack(rng, dictionary, experts: int, rows: int, cols: int) -> CompressedExperts:
    return CompressedExperts.stack(
        [encode_matrix(*synthetic(rng, rows, cols), dictionary) for _ in range(experts)]
    )


def layer_params(rng, dictionary, config) -> dict:
    e, d, f = config.num_experts, config.d_model, config.d_ff
    router = rng.normal(0, 1.0, (d, e)).astype(np.float32)
    return {
        "router": {"router_weights": {"w": {"kernel": router}}},
        "expert": {
            "wi": expert_stack(rng, dictionary, e, f, d),
            "wo": expert_stack(rng, dictionary, e, d, f),
        },
    }


def program(config, dictionary, fields: dict):
    layer = MoeLayer(
        config, functools.partial(CompressedMlpExperts, dictionaries={"": dictionary}, **fields)
    )
    return jax.jit(lambda params, x: layer.apply({"params": params}, x))


def bench(args) -> dict:
    base = get_config(args.config)
    config = dataclasses.replace(
        base, d_model=args.d_model, d_ff=args.d_ff, num_experts=args.experts
    )
    dictionary = build_dictionary(P0)
    rng = np.random.default_rng(args.seed)
    start = time.perf_counter()
    params = jax.device_put(layer_params(rng, dictionary, config))
    print(f"encoded 2 × {args.experts} experts in {time.perf_counter() - start:.1f} s")
    x = jnp.asarray(
        rng.standard_normal((args.tokens // args.length, args.length, args.d_model)), jnp.float32
    )
    token_bytes = x.size * x.dtype.itemsize
    results, runs = {}, {}
    for name, fields in PATHS.items():
        jitted = program(config, dictionary, fields)
        compiled = jitted.lower(params, x).compile()
        temp = int(compiled.memory_analysis().temp_size_in_bytes)
        runnable = temp <= args.max_temp_gb * 2**30
        results[name] = {
            "temp_bytes": temp,
            "temp_over_tokens": temp / token_bytes,
            "ran": runnable,
        }
        print(f"{name}: temporaries {temp / 2**20:.1f} MiB ({temp / token_bytes:.1f}× the tokens)")
        if runnable:
            runs[name] = functools.partial(compiled, params, x)
    outputs = {name: np.asarray(run()) for name, run in runs.items()}
    if len(outputs) == 2:
        difference = float(np.abs(outputs["routed"] - outputs["dispatch"]).max())
        results["max_abs_difference"] = difference
        print(f"largest difference between the paths' outputs: {difference:.2e}")
    times = side_by_side(runs, args.repeats)
    for name, timing in times.items():
        results[name] |= timing
        print(f"{name}: {timing['median_ms']:.1f} ms per call (median), {timing['min_ms']:.1f} min")
    if len(times) == 2:
        results["time_ratio"] = times["routed"]["median_ms"] / times["dispatch"]["median_ms"]
    results["temp_ratio"] = results["routed"]["temp_bytes"] / results["dispatch"]["temp_bytes"]
    print(
        f"routed / dispatch: temporaries {results['temp_ratio']:.4f}"
        + (f", time {results['time_ratio']:.3f}" if "time_ratio" in results else "")
    )
    return {
        "config": args.config,
        "experts": args.experts,
        "d_model": args.d_model,
        "d_ff": args.d_ff,
        "tokens": args.tokens,
        "token_bytes": token_bytes,
        "results": results,
    }


def _best_ms(run, repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        begin = time.perf_counter()
        jax.block_until_ready(run())
        best = min(best, time.perf_counter() - begin)
    return 1e3 * best


def bench_model(path: str, args) -> dict:
    """Routed experts against ``routed=False`` in one model: encoder pass and decoding."""
    from qmoe_jax.inference import open_model
    from qmoe_jax.inference.strategies import DecodingConfig, generate

    model = open_model(path, experts="compressed", dense_dtype="int8", expert_parallel="off")
    rng = np.random.default_rng(args.seed)
    vocab = model.config.vocab_size
    prompt = rng.integers(3, vocab - 100, (1, 32)).astype(np.int32)
    prefill = rng.integers(3, vocab - 100, (args.prefill_batch, 128)).astype(np.int32)
    modules = {
        name: model.module.clone(experts_cls=functools.partial(model.module.experts_cls, **fields))
        for name, fields in PATHS.items()
    }
    encode = {
        name: jax.jit(lambda p, x, m=module: m.apply({"params": p}, x, method="encode"))
        for name, module in modules.items()
    }

    def decode(module, length: int):
        config = DecodingConfig(max_decode_length=length, eos_id=-1)
        return generate(module, model.params, prompt, config).tokens

    tokens = {name: np.asarray(decode(m, 33)) for name, m in modules.items()}
    encoded = {name: np.asarray(f(model.params, prefill)) for name, f in encode.items()}
    if not np.array_equal(tokens["routed"], tokens["dispatch"]):
        raise SystemExit(f"{path}: the routed and unrouted models decode different tokens")
    samples = {f"{kind}_{name}": [] for kind in ("prefill", "decode") for name in PATHS}
    order = np.random.default_rng(1)
    for _ in range(args.model_rounds):
        for name in order.permutation(list(PATHS)):
            encoder, module = encode[name], modules[name]
            samples[f"prefill_{name}"].append(_best_ms(lambda f=encoder: f(model.params, prefill)))
            one = _best_ms(lambda m=module: decode(m, 1))
            many = _best_ms(lambda m=module: decode(m, 33))
            samples[f"decode_{name}"].append((many - one) / 32)
    result = {
        "path": path,
        "experts": model.config.num_experts,
        "encoder_difference": float(np.abs(encoded["routed"] - encoded["dispatch"]).max()),
        "ms": {key: float(np.median(values)) for key, values in samples.items()},
        "samples_ms": samples,
    }
    for kind in ("prefill", "decode"):
        ratios = np.asarray(samples[f"{kind}_routed"]) / np.asarray(samples[f"{kind}_dispatch"])
        result[f"{kind}_ratio"] = float(np.median(ratios))
        result[f"{kind}_ratio_range"] = [float(ratios.min()), float(ratios.max())]
        print(
            f"{model.config.num_experts} experts, {kind}: routed "
            f"{result['ms'][f'{kind}_routed']:.2f} ms, routed=False "
            f"{result['ms'][f'{kind}_dispatch']:.2f} ms, ratio {result[f'{kind}_ratio']:.3f} "
            f"({ratios.min():.3f}-{ratios.max():.3f})"
        )
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="switch-c-2048", help="routing of this named config")
    parser.add_argument("--experts", type=int, default=2048)
    parser.add_argument("--d_model", type=int, default=32)
    parser.add_argument("--d_ff", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=4096, help="tokens of the call")
    parser.add_argument("--length", type=int, default=512, help="tokens per sequence")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--max_temp_gb", type=float, default=8.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--models", action="store_true", help="also the base-shaped models, routed or not"
    )
    parser.add_argument("--model_rounds", type=int, default=5)
    parser.add_argument("--prefill_batch", type=int, default=8)
    parser.add_argument("--work_dir", default=work_dir("inference"))
    parser.add_argument("--output", default=result_path("routed_layer"))
    args = parser.parse_args(argv)
    if args.tokens % args.length:
        parser.error("--tokens must be a multiple of --length")
    print(f"CPU: {cpu_model()}")
    payload = bench(args)
    if args.models:
        from inference import checkpoint_for

        payload["models"] = [
            bench_model(
                checkpoint_for(model, argparse.Namespace(experts=16, work_dir=args.work_dir)), args
            )
            for model in ("base-shaped", "base128-shaped")
        ]
    write_result("routed_layer", payload, args.output)


if __name__ == "__main__":
    main()
