"""The fine-tuning optimizer: clipping by the global gradient norm, then AdamW, applied to the
parameters in one elementwise pass per array.

The math and the state are optax's ``chain(clip_by_global_norm(c), adamw(schedule, b1, b2, eps,
weight_decay))``: ``init`` is that chain's own, so checkpoints of either restore into the other,
and ``reference()`` returns the chain for tests to compare against. What differs is the update.
optax builds the update tree and ``optax.apply_updates`` then adds it to the parameters; XLA:CPU
keeps that tree as a temporary array per parameter. Here each parameter's new value and moments
come out of one expression of (parameter, gradient, first moment, second moment), which XLA fuses
into one loop writing the three donated buffers in place, so a train step holds the gradient and
nothing else the size of the parameters (docs/measurements.md, finetune.py).

Pure math: no I/O.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax


def _increment(count):
    """count + 1, held at the integer type's maximum (optax's step counters do the same)."""
    return jnp.where(count < jnp.iinfo(count.dtype).max, count + 1, count)


@dataclasses.dataclass(frozen=True)
class ClippedAdamW:
    """AdamW after global-norm clipping (see the module docstring).

    Attributes:
      schedule: the learning rate per step (optax's schedule, counted from 0).
      clip_norm: gradients whose global norm exceeds it are scaled down to it.
      weight_decay: decoupled weight decay, on every parameter.
      b1, b2, eps: Adam's moment decays and denominator epsilon.
    """

    schedule: optax.Schedule
    clip_norm: float
    weight_decay: float
    b1: float = 0.9
    b2: float = 0.98
    eps: float = 1e-8

    def reference(self) -> optax.GradientTransformation:
        """The optax chain whose math and state this optimizer has."""
        return optax.chain(
            optax.clip_by_global_norm(self.clip_norm),
            optax.adamw(
                self.schedule,
                b1=self.b1,
                b2=self.b2,
                eps=self.eps,
                weight_decay=self.weight_decay,
            ),
        )

    def init(self, params):
        """The optimizer state of ``params``: the reference chain's."""
        return self.reference().init(params)

    def apply(self, params, grads, state):
        """One step: (new params, new state, the gradients' global norm before clipping).

        Inside ``jax.jit`` with ``params`` and ``state`` donated, the new parameters and moments
        take the old ones' buffers.
        """
        clip_state, (adam, decay_state, schedule_state) = state
        norm = jnp.sqrt(sum(jnp.sum(jnp.square(g)) for g in jax.tree.leaves(grads)))
        # optax: g where the norm is below the limit, else g / norm * limit
        scale = jnp.where(norm < self.clip_norm, 1.0, self.clip_norm / norm)
        count = _increment(adam.count)
        learning_rate = self.schedule(schedule_state.count)
        b1, b2, eps, decay = self.b1, self.b2, self.eps, self.weight_decay

        def one(p, g, mu, nu):
            g = g * scale.astype(g.dtype)
            mu = (1 - b1) * g + b1 * mu
            nu = (1 - b2) * (g * g) + b2 * nu
            mu_hat = mu / (1 - b1**count).astype(mu.dtype)
            nu_hat = nu / (1 - b2**count).astype(nu.dtype)
            update = mu_hat / (jnp.sqrt(nu_hat) + eps) + decay * p
            return (p - learning_rate.astype(p.dtype) * update).astype(p.dtype), mu, nu

        triples = jax.tree.map(one, params, grads, adam.mu, adam.nu)
        structure = jax.tree.structure(params)
        new_params, mu, nu = jax.tree.transpose(structure, jax.tree.structure((0, 0, 0)), triples)
        new_state = (
            clip_state,
            (
                adam._replace(count=count, mu=mu, nu=nu),
                decay_state,
                schedule_state._replace(count=_increment(schedule_state.count)),
            ),
        )
        return new_params, new_state, norm
