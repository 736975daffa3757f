"""One sparse decoder layer of stock T5X at ``t5x.infer``'s decoding shapes: the compressed layer
(interop/t5x_moe.py) as it runs by default (each token multiplied by its own expert, on the CPU
with the routed kernel), the same layer on flaxformer's dispatch computing only the capacity
slots in use (``per_token_limit=0``) or every slot, and flaxformer's own ``MoeLayer`` on the
dequantized float32 experts.

A decoding step hands the MoE layer one token per sequence, ``[batch, 1, d_model]``. flaxformer
pads the tokens to a multiple of E, makes E routing groups of them and gives every expert
``max(round(CF · tokens per group / E), min_expert_capacity)`` slots per group: E × 4 slots per
expert under switch_base.gin's settings, of which at most ``batch`` hold a token. flaxformer's
layer multiplies every slot by every expert; on the dispatch, the compressed layer skips the empty
ones and every expert no token chose; by default it skips the dispatch itself.

Measured: milliseconds per call of the jitted layer (``apply`` with ``decode=True``), per model,
batch and variant, the median over --rounds rounds in which the variants take turns (each round
times --calls calls of each; a variant slower than a second per call gets one call per round);
and each variant's ratio to the compressed layer, the median of the per-round ratios. The layer
is the checkpoint's first sparse decoder layer, with flaxformer's switch_base.gin routing
(``TokensChooseMaskedRouter``, top-1) and the checkpoint's capacity factors, group size and
minimum capacity. Outputs of the variants are compared: each must be within 1e-4 of the
largest output of the compressed layer's.

Models: the synthetic switch-base-shaped checkpoints of benchmarks/inference.py (made there if
missing; 16 and 128 experts) and the bundled model (runs/compressed/switch-mini-8).
Needs a T5X environment (docs/gin.md §9) with qmoe_jax installed.

    python benchmarks/t5x_decode.py                       # base-shaped and base128-shaped
    python benchmarks/t5x_decode.py --models bundled --batches 1 --rounds 3

Result file: benchmarks/results/t5x_decode.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import numpy as np
from common import cpu_model, result_path, work_dir, write_result
from inference import checkpoint_for

LAYER = ("decoder", "layers_1", "mlp")


def build(path: str):
    """(model config, {variant: (module, variables)}) for the checkpoint's decoder layer 1."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    from flax import traverse_util

    from qmoe_jax.checkpoints.format_v1 import CompressedCheckpoint
    from qmoe_jax.inference.compressed_params import dequantized_kernel
    from qmoe_jax.interop.t5x_layout import COLLECTION
    from qmoe_jax.interop.t5x_moe import compressed_moe_layer, switch_moe_layer
    from qmoe_jax.models import SwitchConfig
    from qmoe_jax.quant import GridConfig

    checkpoint = CompressedCheckpoint(path)
    config = SwitchConfig(**checkpoint.header["model"])
    name = ".".join(LAYER)
    if name not in checkpoint.layer_names():
        raise SystemExit(f"{path} has no sparse layer {name}")
    arrays, stats = checkpoint.layer(name)
    if "kernels" not in stats:
        raise SystemExit(
            f"{path} was written by an older benchmarks/inference.py without the kernel stats "
            "that T5X's layer reads (docs/format.md §8.5); delete it and run again to rewrite it"
        )
    dictionary = checkpoint.dictionary(stats["dictionary"])
    dense_params = traverse_util.flatten_dict(checkpoint.dense_params())
    router = {k[3:]: jnp.asarray(v) for k, v in dense_params.items() if k[:4] == (*LAYER, "router")}

    stock = switch_moe_layer(config)

    class Block(nn.Module):
        mlp: nn.Module

        def __call__(self, x):
            return self.mlp(x, decode=True, enable_dropout=False)

    class Stack(nn.Module):
        layers_1: nn.Module

        def __call__(self, x):
            return self.layers_1(x)

    class Root(nn.Module):
        decoder: nn.Module

        def __call__(self, x):
            return self.decoder(x)

    def nest(tree: dict) -> dict:
        return traverse_util.unflatten_dict({(*LAYER, *k): v for k, v in tree.items()})

    router_params = nest(router)
    codes = nest(
        {
            (kernel, array): jnp.asarray(value)
            for (kernel, array), value in traverse_util.flatten_dict(arrays).items()
        }
    )
    variants = {}
    for variant, fields in (
        ("compressed", {}),
        ("compressed, slots in use", {"per_token_limit": 0}),
        ("compressed, every slot", {"skip_empty_slots": False}),
    ):
        layer = dataclasses.replace(compressed_moe_layer(stock, path), **fields)
        variants[variant] = (
            Root(Stack(Block(layer))),
            {"params": router_params, COLLECTION: codes},
        )
    header = checkpoint.header
    grid = GridConfig(**(header["grid"] if "grid" in header else header["settings"]["grid"]))
    experts = {
        ("expert", kernel, "kernel"): jnp.asarray(
            dequantized_kernel(arrays[kernel], grid, cols, dictionary)
        )
        for kernel, cols in (("wi", config.d_model), ("wo", config.d_ff))
    }
    dense_variables = {"params": nest({**router, **experts})}
    variants["flaxformer, dense f32"] = (Root(Stack(Block(stock))), dense_variables)
    jitted = {
        variant: (jax.jit(module.apply), variables)
        for variant, (module, variables) in variants.items()
    }
    return config, jitted


def time_calls(apply, variables, x, calls: int) -> float:
    """Median seconds per call of ``apply(variables, x)`` over ``calls`` calls."""
    seconds = []
    for _ in range(calls):
        start = time.perf_counter()
        apply(variables, x).block_until_ready()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def measure(model: str, path: str, args) -> list[dict]:
    import jax
    import jax.numpy as jnp

    config, jitted = build(path)
    rows = []
    for batch in args.batches:
        x = jax.random.normal(jax.random.PRNGKey(batch), (batch, 1, config.d_model), jnp.float32)
        outputs, calls = {}, {}
        for variant, (apply, variables) in jitted.items():
            print(f"  {model} / batch {batch} / {variant}: compiling", flush=True)
            outputs[variant] = np.asarray(apply(variables, x))
            once = time_calls(apply, variables, x, 1)
            calls[variant] = 1 if once > 1.0 else args.calls
        base = outputs["compressed"]
        scale = float(np.max(np.abs(base))) or 1.0
        errors = {v: float(np.max(np.abs(out - base))) / scale for v, out in outputs.items()}
        for variant, error in errors.items():
            if error > 1e-4:
                raise SystemExit(f"{model}, batch {batch}: {variant} differs by {error:.2e}")
        times = {variant: [] for variant in jitted}
        for round_index in range(args.rounds):
            order = (
                list(jitted)[round_index % len(jitted) :]
                + list(jitted)[: round_index % len(jitted)]
            )
            for variant in order:
                apply, variables = jitted[variant]
                times[variant].append(time_calls(apply, variables, x, calls[variant]))
            print(
                f"  {model} / batch {batch} / round {round_index + 1}/{args.rounds}: "
                + ", ".join(f"{v} {times[v][-1] * 1e3:.2f} ms" for v in jitted),
                flush=True,
            )
        for variant in jitted:
            rows.append(
                {
                    "model": model,
                    "experts": config.num_experts,
                    "batch": batch,
                    "variant": variant,
                    "ms_per_call": statistics.median(times[variant]) * 1e3,
                    "vs_compressed": statistics.median(
                        t / c for t, c in zip(times[variant], times["compressed"])
                    ),
                    "calls_per_round": calls[variant],
                    "max_relative_difference": errors[variant],
                }
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--models",
        nargs="+",
        default=["base-shaped", "base128-shaped"],
        choices=["bundled", "base-shaped", "base128-shaped"],
    )
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--experts", type=int, default=16, help="experts of base-shaped")
    parser.add_argument(
        "--work_dir",
        default=work_dir("inference"),
        help="where the synthetic checkpoints are (shared with benchmarks/inference.py)",
    )
    parser.add_argument("--output", default=result_path("t5x_decode"), help="the JSON result")
    args = parser.parse_args()
    rows = []
    for model in args.models:
        rows += measure(model, checkpoint_for(model, args), args)
    print(f"\n{cpu_model()}; ms per call of one sparse decoder layer, medians")
    print(f"{'model':<16}{'batch':>6}  {'variant':<26}{'ms/call':>10}{'vs compressed':>15}")
    for row in rows:
        print(
            f"{row['model']:<16}{row['batch']:>6}  {row['variant']:<26}"
            f"{row['ms_per_call']:>10.2f}{row['vs_compressed']:>14.1f}×"
        )
    write_result("t5x_decode", {"args": vars(args), "rows": rows}, args.output)


if __name__ == "__main__":
    main()
