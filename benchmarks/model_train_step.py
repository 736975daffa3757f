"""Training-step time of a SwitchTransformer config on this machine (jitted optax Adam step).

Compares parameter/activation dtypes side by side in one process. Prints a
table and writes JSON to --output (default benchmarks/results/model_train_step.json).

    python benchmarks/model_train_step.py --config switch-mini-8 \
        --batch 32 --encoder-length 128 --decoder-length 32
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from common import result_path, write_result

from qmoe_jax.models import SwitchTransformer, get_config, router_metrics


def make_step(model: SwitchTransformer, optimizer: optax.GradientTransformation):
    cfg = model.config

    def loss_fn(params, batch, dropout_key):
        logits, state = model.apply(
            {"params": params},
            batch["encoder_input_tokens"],
            batch["decoder_input_tokens"],
            batch["decoder_target_tokens"],
            enable_dropout=True,
            rngs={"dropout": dropout_key},
            mutable=["intermediates"],
        )
        weights = (batch["decoder_target_tokens"] > 0).astype(jnp.float32)
        xent = optax.softmax_cross_entropy_with_integer_labels(
            logits, batch["decoder_target_tokens"]
        )
        loss = jnp.sum(xent * weights) / jnp.sum(weights)
        metrics = router_metrics(state["intermediates"])
        return loss + cfg.aux_loss_factor * metrics["auxiliary_loss"], loss

    @jax.jit
    def step(params, opt_state, batch, dropout_key):
        (_, loss), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch, dropout_key)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


def time_config(
    config, batch_size: int, encoder_length: int, decoder_length: int, steps: int
) -> dict:
    rng = np.random.default_rng(0)
    batch = {
        "encoder_input_tokens": rng.integers(1, config.vocab_size, (batch_size, encoder_length)),
        "decoder_target_tokens": rng.integers(1, config.vocab_size, (batch_size, decoder_length)),
    }
    batch["decoder_input_tokens"] = np.pad(batch["decoder_target_tokens"][:, :-1], ((0, 0), (1, 0)))
    batch = {k: jnp.asarray(v, jnp.int32) for k, v in batch.items()}
    model = SwitchTransformer(config)
    params = jax.jit(model.init)(
        jax.random.PRNGKey(0),
        batch["encoder_input_tokens"],
        batch["decoder_input_tokens"],
        batch["decoder_target_tokens"],
    )["params"]
    optimizer = optax.adam(1e-3)
    opt_state = optimizer.init(params)
    step = make_step(model, optimizer)
    start = time.perf_counter()
    params, opt_state, loss = step(params, opt_state, batch, jax.random.PRNGKey(1))
    loss.block_until_ready()
    compile_s = time.perf_counter() - start
    times, cpu_times = [], []
    for i in range(steps):
        start, cpu_start = time.perf_counter(), time.process_time()
        params, opt_state, loss = step(params, opt_state, batch, jax.random.PRNGKey(2 + i))
        loss.block_until_ready()
        times.append(time.perf_counter() - start)
        cpu_times.append(time.process_time() - cpu_start)
    return {
        "param_dtype": config.param_dtype,
        "dtype": config.dtype,
        "compile_and_first_step_s": compile_s,
        "median_step_s": float(np.median(times)),
        "min_step_s": float(np.min(times)),
        "median_cpu_s": float(np.median(cpu_times)),
        "final_loss": float(loss),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="switch-mini-8")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--encoder-length", type=int, default=128)
    parser.add_argument("--decoder-length", type=int, default=32)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--output", default=result_path("model_train_step"), help="the JSON result")
    args = parser.parse_args()

    base = get_config(args.config)
    variants = [("float32", "float32"), ("bfloat16", "bfloat16"), ("float32", "bfloat16")]
    rows = []
    for param_dtype, dtype in variants:
        config = dataclasses.replace(base, param_dtype=param_dtype, dtype=dtype)
        rows.append(
            time_config(config, args.batch, args.encoder_length, args.decoder_length, args.steps)
        )

    print(
        f"{args.config}: batch {args.batch}, encoder {args.encoder_length}, decoder "
        f"{args.decoder_length}, Adam, {args.steps} timed steps, {jax.devices()[0].device_kind}"
    )
    print(
        f"{'params':>9} {'activations':>11} {'median s/step':>14} {'min s/step':>11} "
        f"{'CPU s/step':>11} {'compile s':>10}"
    )
    for row in rows:
        print(
            f"{row['param_dtype']:>9} {row['dtype']:>11} {row['median_step_s']:>14.3f} "
            f"{row['min_step_s']:>11.3f} {row['median_cpu_s']:>11.3f} "
            f"{row['compile_and_first_step_s']:>10.1f}"
        )
    print(
        "CPU s/step is process CPU time (all threads); wall time on an idle 2-core machine is "
        "about half."
    )
    write_result(
        "model_train_step",
        {"args": vars(args), "device": jax.devices()[0].device_kind, "rows": rows},
        args.output,
    )


if __name__ == "__main__":
    main()
