"""Products with dense weights on XLA:CPU for few tokens: the qmoe_dense_matmul kernels against
XLA's own formulations and the float32 dot.

A decoding step multiplies one token by every dense matrix of the decoder once. This runs that
pattern: --matrices matrices of --rows x --cols (far more bytes than the last-level cache), each
multiplied by the same --tokens tokens, summed, in one jitted program per form:

  f32 dot                 x @ W, W float32 [cols, rows] (the float32 baseline)
  bf16 convert+dot        x @ W.astype(float32), W bfloat16
  int8 convert+dot        (x @ W.astype(float32)) * scales, W int8
  int8 multiply-reduce    sum(W.astype(float32) * x, axis=-1) * scales, W int8 [rows, cols]
  bf16 native dot         XLA's bfloat16 dot, float32 result
  f32 kernel [in, out]    kernels.dense.kernel_matmul on the float32 baseline's W (the FFI
                          kernel qmoe_dense_matmul_t up to float32_kernel_tokens() tokens,
                          32 or 8 with AVX-512, and from 768x768 weights; XLA's dot otherwise)
  f32 kernel [rows, cols] kernels.dense.rows_matmul on W float32 [rows, cols] (the FFI kernel
                          qmoe_dense_matmul, within the same bounds)
  bf16 kernel             kernels.dense.matmul on bfloat16 weights (the FFI kernel)
  int8 kernel             kernels.dense.matmul on int8 weights with row scales

--forms picks some of them (the float32 dot always runs: it is what the ratios divide by).

--step CONFIG runs instead the matrices of one decoding step of that model (decoding_step), each
product's input made to depend on the one before so that XLA runs them in turn, as a decoder
does. For switch-base that is 61 matrices, 95.5 MB in int8: every dense product of a decoded token
but the routed experts'. Its time, beside a decoded token's (inference.py) and the products' share
of it (decode_profile.py), says how much of a step is the products themselves.

Forms are timed round by round (each round runs every form once, best of --repeats); reported:
each form's median time, its stored bytes over that time, and the median of its per-round ratio
to the float32 dot. The load average of every round is printed beside it: on a loaded machine the
ratios hold better than the times, and neither is a measurement of the machine.

    python benchmarks/dense_product.py
    python benchmarks/dense_product.py --tokens 48 --rounds 9
    python benchmarks/dense_product.py --step switch-base-8
    python benchmarks/dense_product.py --step switch-base-8 --forms "f32 kernel [in, out]"
    python benchmarks/dense_product.py --step switch-base-8 --tokens 32 --kernel_tokens 32 \
        --forms "f32 kernel [in, out]" "f32 kernel [rows, cols]"
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
from common import cpu_model, result_path, write_result


def decoding_step(config) -> list[tuple[int, int]]:
    """(rows, cols) of y = W x for every dense product of one decoded token, in the decoder's
    order: per layer the fused query-key-value kernel, the self-attention output, the
    cross-attention query and output (its keys and values were projected once, from the encoder),
    and in a dense layer the MLP's input kernels and ``wo``; then the output embedding."""
    inner, d, d_ff = config.num_heads * config.d_kv, config.d_model, config.d_ff
    shapes = []
    for layer in range(config.num_decoder_layers):
        shapes += [(3 * inner, d), (d, inner), (inner, d), (d, inner)]
        if not config.is_sparse_layer(layer, decoder=True):
            shapes += [(d_ff, d)] * (2 if config.gated_mlp else 1) + [(d, d_ff)]
    return shapes + [(config.vocab_size, d)]


FORM_NAMES = (
    "f32 dot",
    "bf16 convert+dot",
    "int8 convert+dot",
    "int8 multiply-reduce",
    "bf16 native dot",
    "f32 kernel [in, out]",
    "f32 kernel [rows, cols]",
    "bf16 kernel",
    "int8 kernel",
)


def forms(matrices: list[np.ndarray], names=FORM_NAMES) -> dict:
    """{form: (product(x, weight), weights)} for the float32 matrices W[rows, cols], the forms
    ``names`` in FORM_NAMES' order."""
    import jax.numpy as jnp

    from qmoe_jax.kernels import dense
    from qmoe_jax.quant.int8 import quantize_int8

    def float32():
        return [jnp.asarray(w.T.copy()) for w in matrices]

    def bfloat16():
        return [jnp.asarray(w.T.copy(), jnp.bfloat16) for w in matrices]

    def int8():
        return [quantize_int8(w) for w in matrices]

    def int8_t():
        return [(codes.T.copy(), scales) for codes, scales in int8()]

    def packed(form):
        return lambda: [dense.pack(w, form) for w in matrices]

    makers = {
        "f32 dot": (lambda x, w: x @ w, float32),
        "bf16 convert+dot": (lambda x, w: x @ w.astype(jnp.float32), bfloat16),
        "int8 convert+dot": (lambda x, w: (x @ w[0].astype(jnp.float32)) * w[1], int8_t),
        "int8 multiply-reduce": (
            lambda x, w: jnp.sum(w[0].astype(jnp.float32) * x[:, None, :], axis=-1) * w[1],
            int8,
        ),
        "bf16 native dot": (
            lambda x, w: jnp.dot(x.astype(jnp.bfloat16), w, preferred_element_type=jnp.float32),
            bfloat16,
        ),
        "f32 kernel [in, out]": (dense.kernel_matmul, float32),
        "f32 kernel [rows, cols]": (dense.rows_matmul, lambda: [jnp.asarray(w) for w in matrices]),
        "bf16 kernel": (dense.matmul, packed("bfloat16")),
        "int8 kernel": (dense.matmul, packed("int8")),
    }
    return {name: (product, make()) for name, (product, make) in makers.items() if name in names}


def stored_bytes(weights) -> int:
    import jax

    return sum(int(leaf.nbytes) for leaf in jax.tree.leaves(weights))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--matrices", type=int, default=24)
    parser.add_argument("--rows", type=int, default=3072)
    parser.add_argument("--cols", type=int, default=768)
    parser.add_argument("--tokens", type=int, default=1)
    parser.add_argument(
        "--step",
        default=None,
        metavar="CONFIG",
        help="the matrices of one decoding step of this model config (e.g. switch-base-8) "
        "instead of --matrices x --rows x --cols",
    )
    parser.add_argument(
        "--forms",
        nargs="+",
        choices=FORM_NAMES,
        default=list(FORM_NAMES),
        metavar="FORM",
        help="forms to time besides the float32 dot (default: all of them)",
    )
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--kernel_tokens",
        type=int,
        default=None,
        help="tokens up to which the f32 kernel forms take the kernels, for this run (default: "
        "kernels.dense.float32_kernel_tokens(), what a model takes on this CPU)",
    )
    parser.add_argument("--output", default=result_path("dense_product"))
    args = parser.parse_args()

    import jax

    if args.kernel_tokens is not None:
        from qmoe_jax.kernels import dense

        dense.float32_kernel_tokens = lambda: args.kernel_tokens  # read at each trace

    rng = np.random.default_rng(0)
    if args.step:
        from qmoe_jax.models.configs import get_config

        shapes = decoding_step(get_config(args.step))
    else:
        shapes = [(args.rows, args.cols)] * args.matrices
    matrices = [
        (rng.standard_normal(shape) / np.sqrt(shape[1])).astype(np.float32) for shape in shapes
    ]
    x = {
        cols: jax.numpy.asarray(rng.standard_normal((args.tokens, cols)).astype(np.float32))
        for cols in sorted({cols for _, cols in shapes})
    }
    runs = {}
    chosen = {"f32 dot", *args.forms}
    for name, (product, weights) in forms(matrices, chosen).items():

        def total(x, weights, product=product):
            return sum(product(x[args.cols], w) for w in weights)

        def step(x, weights, product=product):
            # Each product's input depends on the one before (adding 0 times one of its outputs),
            # so that XLA runs them one after the other, as a decoder does, and not side by side.
            carry, results = 0.0, []
            for (_, cols), w in zip(shapes, weights, strict=True):
                results.append(product(x[cols] + carry, w))
                carry = 0.0 * results[-1][:, :1]
            return results

        runs[name] = (jax.jit(step if args.step else total), weights)
        jax.block_until_ready(runs[name][0](x, weights))  # compiles
    times = {name: [] for name in runs}
    loads = []
    for number in range(args.rounds):
        for name, (run, weights) in runs.items():
            best = float("inf")
            for _ in range(args.repeats):
                started = time.perf_counter()
                jax.block_until_ready(run(x, weights))
                best = min(best, time.perf_counter() - started)
            times[name].append(best)
        loads.append(os.getloadavg()[0])
        print(f"round {number + 1}/{args.rounds} (load {loads[-1]:.1f})", flush=True)

    cpu = cpu_model()
    pattern = (
        f"the {len(shapes)} matrices of a {args.step} decoding step"
        if args.step
        else f"{args.matrices} matrices {args.rows}x{args.cols}"
    )
    print(
        f"\nCPU: {cpu}, {os.cpu_count()} cores; {pattern}, "
        f"{args.tokens} token(s)"
        + (f", f32 kernels up to {args.kernel_tokens} tokens" if args.kernel_tokens else "")
        + f"; load average {min(loads):.1f} to {max(loads):.1f} (a loaded "
        "machine's times are not measurements)"
    )
    print(f"{'form':<22}{'ms':>9}{'GB/s stored':>13}{'time / f32 dot':>16}")
    rows = []
    for name, (_, weights) in runs.items():
        median = statistics.median(times[name])
        ratio = statistics.median(t / f for t, f in zip(times[name], times["f32 dot"]))
        nbytes = stored_bytes(weights)
        print(f"{name:<22}{1e3 * median:>9.2f}{nbytes / median / 1e9:>13.1f}{ratio:>16.2f}")
        rows.append(
            {
                "form": name,
                "seconds": times[name],
                "median_seconds": median,
                "stored_bytes": nbytes,
                "time_over_f32_dot": ratio,
            }
        )
    write_result(
        "dense_product",
        {
            "load_averages": loads,
            "step": args.step,
            "shapes": shapes,
            "kernel_tokens": args.kernel_tokens,
            "rows": rows,
        },
        args.output,
    )


if __name__ == "__main__":
    main()
