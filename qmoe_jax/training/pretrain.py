"""Span-corruption pre-training of a Switch model (used for the bundled model).

Lingo: one *epoch* is one pass over the training chunks in a fresh order, each
chunk corrupted anew with rng (seed, epoch, index); loss = mean token
cross-entropy + ``aux_loss_factor`` · load-balancing loss + ``router_z_loss_factor``
· router z-loss (Switch Transformer, Fedus et al. 2021); schedule = linear
warm-up then cosine decay (T5-like warm-up then decay).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Callable, Iterator

import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np
import optax

from qmoe_jax.checkpoints import strict_json
from qmoe_jax.data.batches import batch_examples
from qmoe_jax.data.span_corruption import span_corrupt
from qmoe_jax.inference.evaluation import (
    evaluate_batches,
    make_eval_step,
    model_inputs,
    token_cross_entropy,
)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    batch_size: int = 32
    steps: int = 12_000
    peak_learning_rate: float = 1e-3
    warmup_steps: int = 500
    final_learning_rate_fraction: float = 0.05
    weight_decay: float = 0.01
    clip_norm: float = 1.0
    aux_loss_factor: float = 0.01
    router_z_loss_factor: float = 1e-3
    eval_every: int = 250
    snapshot_every: int = 500
    seed: int = 0


def learning_rate_schedule(config: TrainConfig) -> optax.Schedule:
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=config.peak_learning_rate,
        warmup_steps=config.warmup_steps,
        decay_steps=config.steps,
        end_value=config.peak_learning_rate * config.final_learning_rate_fraction,
    )


def make_optimizer(config: TrainConfig) -> optax.GradientTransformation:
    return optax.chain(
        optax.clip_by_global_norm(config.clip_norm),
        optax.adamw(
            learning_rate_schedule(config), b1=0.9, b2=0.98, weight_decay=config.weight_decay
        ),
    )


def training_batches(
    chunks: list[np.ndarray],
    first_sentinel: int,
    batch_size: int,
    encoder_length: int,
    decoder_length: int,
    seed: int,
    start_step: int = 0,
) -> Iterator[dict[str, np.ndarray]]:
    """Endless span-corrupted batches over ``chunks``; step ``k`` is the same whatever
    ``start_step``."""
    per_epoch = len(chunks) // batch_size
    if per_epoch == 0:
        raise ValueError(f"{len(chunks)} training chunks cannot fill one batch of {batch_size}")
    step = start_step
    while True:
        epoch, position = divmod(step, per_epoch)
        order = np.random.default_rng((seed, epoch)).permutation(len(chunks))
        indices = order[position * batch_size : (position + 1) * batch_size]
        examples = [
            span_corrupt(chunks[i], np.random.default_rng((seed, epoch, int(i))), first_sentinel)
            for i in indices
        ]
        yield batch_examples(examples, encoder_length, decoder_length)
        step += 1


def make_train_step(
    model, optimizer: optax.GradientTransformation, config: TrainConfig, aux_losses: Callable
):
    """A jitted step (params, opt_state, batch, rng) -> (params, opt_state, metrics).

    ``aux_losses(intermediates) -> (load_balancing, router_z)`` reads the MoE
    auxiliary losses the model sows.
    """

    def loss_fn(params, batch, rng):
        logits, state = model.apply(
            {"params": params},
            *model_inputs(batch),
            enable_dropout=True,
            rngs={"dropout": rng},
            mutable=["intermediates"],
        )
        loss_sum, weight_sum = token_cross_entropy(
            logits, batch["decoder_target_tokens"], batch["decoder_loss_weights"]
        )
        cross_entropy = loss_sum / jnp.maximum(weight_sum, 1.0)
        load_balancing, router_z = aux_losses(state.get("intermediates", {}))
        total = (
            cross_entropy
            + config.aux_loss_factor * load_balancing
            + config.router_z_loss_factor * router_z
        )
        return total, dict(
            cross_entropy=cross_entropy, load_balancing=load_balancing, router_z=router_z
        )

    @jax.jit
    def step(params, opt_state, batch, rng):
        (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch, rng)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        metrics["grad_norm"] = jnp.sqrt(
            sum(jnp.sum(jnp.square(g)) for g in jax.tree_util.tree_leaves(grads))
        )
        return optax.apply_updates(params, updates), opt_state, metrics

    return step


def save_snapshot(path: str, step: int, params, opt_state, history: list[dict]) -> None:
    """Writes a resumable training snapshot atomically."""
    payload = flax.serialization.to_bytes({"step": step, "params": params, "opt_state": opt_state})
    temporary = path + ".tmp"
    with open(temporary, "wb") as f:
        f.write(payload)
    os.replace(temporary, path)
    with open(path + ".history.json.tmp", "w") as f:
        strict_json.dump(history, f, what="the training history")
    os.replace(path + ".history.json.tmp", path + ".history.json")


def load_snapshot(path: str, params, opt_state) -> tuple[int, dict, dict, list[dict]]:
    with open(path, "rb") as f:
        restored = flax.serialization.from_bytes(
            {"step": 0, "params": params, "opt_state": opt_state}, f.read()
        )
    with open(path + ".history.json") as f:
        history = json.load(f)
    return int(restored["step"]), restored["params"], restored["opt_state"], history


def train(
    model,
    params,
    chunks: list[np.ndarray],
    eval_batches: list[dict],
    first_sentinel: int,
    encoder_length: int,
    decoder_length: int,
    config: TrainConfig,
    aux_losses: Callable,
    snapshot_path: str,
    log: Callable[[str], None] = print,
) -> tuple[dict, list[dict]]:
    """Trains (resuming from ``snapshot_path`` if present); returns final params and the eval
    history."""
    optimizer = make_optimizer(config)
    opt_state = optimizer.init(params)
    start, history = 0, []
    if os.path.exists(snapshot_path):
        start, params, opt_state, history = load_snapshot(snapshot_path, params, opt_state)
        log(f"resumed from {snapshot_path} at step {start}")
    train_step = make_train_step(model, optimizer, config, aux_losses)
    eval_step = make_eval_step(model)
    schedule = learning_rate_schedule(config)
    batches = training_batches(
        chunks,
        first_sentinel,
        config.batch_size,
        encoder_length,
        decoder_length,
        config.seed,
        start,
    )
    base_rng = jax.random.PRNGKey(config.seed)
    started = time.time()
    running: dict[str, float] = {}
    running_steps = 0
    for step in range(start, config.steps):
        batch = next(batches)
        params, opt_state, metrics = train_step(
            params, opt_state, batch, jax.random.fold_in(base_rng, step)
        )
        for name, value in metrics.items():
            running[name] = running.get(name, 0.0) + float(value)
        running_steps += 1
        done = step + 1
        if done % config.eval_every == 0 or done == config.steps:
            validation = evaluate_batches(eval_step, params, eval_batches)
            record = {name: value / running_steps for name, value in running.items()}
            record.update(
                step=done,
                validation_loss=validation,
                learning_rate=float(schedule(done)),
                seconds=time.time() - started,
            )
            history.append(record)
            running, running_steps = {}, 0
            log(strict_json.dumps(record, what="a training record"))
        if done % config.snapshot_every == 0 or done == config.steps:
            save_snapshot(snapshot_path, done, params, opt_state, history)
    return params, history


def moe_aux_losses(intermediates) -> tuple[jax.Array, jax.Array]:
    """(load-balancing loss, router z-loss), averaged over the MoE layers' sown metrics."""
    from qmoe_jax.models import router_metrics

    metrics = router_metrics(intermediates)
    return metrics["auxiliary_loss"], metrics["router_z_loss"]
