"""The fine-tuning steps: a jitted training step (micro-batches accumulated, the MoE auxiliary
losses added) and the validation that scores a model on held-out batches (teacher-forced loss and
token accuracy, and exact match of greedy generations for generative tasks)."""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from qmoe_jax.distributed import exchange
from qmoe_jax.inference.evaluation import model_inputs, token_cross_entropy
from qmoe_jax.inference.strategies import DecodingConfig, generate
from qmoe_jax.training.optimizer import Optimizer
from qmoe_jax.training.pretrain import moe_aux_losses
from qmoe_jax.training.trainable import merge


def batch_scores(logits, batch):
    """(loss sum, weight sum, correct-token sum) of a batch."""
    loss_sum, weight_sum = token_cross_entropy(
        logits, batch["decoder_target_tokens"], batch["decoder_loss_weights"]
    )
    correct = (jnp.argmax(logits, -1) == batch["decoder_target_tokens"]) * batch[
        "decoder_loss_weights"
    ]
    return loss_sum, weight_sum, correct.sum()


def make_train_step(module, optimizer: Optimizer, accumulate: int) -> Callable:
    """A jitted (trainable, opt_state, frozen, batches [accumulate, B, ...], rng) -> (trainable,
    opt_state, metrics); the gradient is the mean over the micro-batches of their token-mean losses'
    gradients."""
    config = module.config

    def loss_fn(trainable, frozen, batch, rng):
        logits, state = module.apply(
            {"params": merge(trainable, frozen)},
            *model_inputs(batch),
            enable_dropout=True,
            rngs={"dropout": rng},
            mutable=["intermediates"],
        )
        loss_sum, weight_sum, correct = batch_scores(logits, batch)
        cross_entropy = loss_sum / jnp.maximum(weight_sum, 1.0)
        load_balancing, router_z = moe_aux_losses(state["intermediates"])
        total = (
            cross_entropy
            + config.aux_loss_factor * load_balancing
            + config.router_z_loss_factor * router_z
        )
        return total, {
            "train_loss": cross_entropy,
            "train_token_accuracy": correct / jnp.maximum(weight_sum, 1.0),
        }

    gradient = jax.value_and_grad(loss_fn, has_aux=True)

    @functools.partial(
        jax.jit, donate_argnums=(0, 1)
    )  # the old parameters and moments are not kept
    def step(trainable, opt_state, frozen, batches, rng):
        if accumulate == 1:  # no accumulator: the step then holds one gradient-sized buffer
            batch = jax.tree.map(lambda x: x[0], batches)
            (_, metrics), grads = gradient(trainable, frozen, batch, jax.random.fold_in(rng, 0))
            trainable, opt_state, metrics["grad_norm"] = optimizer.apply(
                trainable, grads, opt_state
            )
            return trainable, opt_state, metrics

        def micro(carry, inputs):
            batch, index = inputs
            (_, metrics), grads = gradient(trainable, frozen, batch, jax.random.fold_in(rng, index))
            return jax.tree.map(jnp.add, carry, (grads, metrics)), None

        zeros = (
            jax.tree.map(jnp.zeros_like, trainable),
            {"train_loss": jnp.float32(0), "train_token_accuracy": jnp.float32(0)},
        )
        (grads, metrics), _ = jax.lax.scan(micro, zeros, (batches, jnp.arange(accumulate)))
        grads, metrics = jax.tree.map(lambda x: x / accumulate, (grads, metrics))
        trainable, opt_state, metrics["grad_norm"] = optimizer.apply(trainable, grads, opt_state)
        return trainable, opt_state, metrics

    return step


def make_eval_step(module) -> Callable:
    """A jitted (trainable, frozen, batch) -> (loss sum, weight sum, correct-token sum)."""

    @jax.jit
    def step(trainable, frozen, batch):
        logits = module.apply(
            {"params": merge(trainable, frozen)}, *model_inputs(batch), enable_dropout=False
        )
        return batch_scores(logits, batch)

    return step


def evaluate(
    module, eval_step, trainable, frozen, batches: list[dict], generative: bool, placed: Callable
) -> dict[str, float]:
    """Validation loss and token accuracy (teacher forced) and, for ``generative`` tasks, exact
    match of greedy generations with the targets."""
    totals = np.zeros(3)
    matches = examples = 0
    params = merge(trainable, frozen) if generative else None
    for batch in batches:
        totals += [float(x) for x in eval_step(trainable, frozen, placed(batch))]
        if generative:
            targets = batch["decoder_target_tokens"]
            decoded = generate(
                module,
                params,
                placed(batch)["encoder_input_tokens"],
                DecodingConfig(method="greedy", max_decode_length=targets.shape[1]),
            )
            real = batch["decoder_loss_weights"].sum(1) > 0
            tokens = exchange.host_array(decoded.tokens)
            matches += int(np.sum(np.all(tokens == targets, axis=1) & real))
            examples += int(real.sum())
    loss_sum, weight_sum, correct = totals
    record = {
        "validation_loss": loss_sum / max(weight_sum, 1.0),
        "validation_token_accuracy": correct / max(weight_sum, 1.0),
    }
    if generative:
        record["validation_exact_match"] = matches / max(examples, 1)
    return record
