"""The fine-tuning optimizers: clipping by the global gradient norm, then AdamW or Adafactor,
applied to the parameters in one elementwise pass per array.

``ClippedAdamW``'s math and state are optax's ``chain(clip_by_global_norm(c), adamw(schedule, b1,
b2, eps, weight_decay))``; ``ClippedAdafactor``'s are ``chain(clip_by_global_norm(c),
adafactor(schedule))`` with optax's (and T5X's) Adafactor defaults: factored second moments for
arrays whose two largest dimensions are at least 128, no first moment, update clipping at RMS 1,
steps relative to the parameter's RMS, second-moment decay 1 - t^-0.8. Adafactor keeps a row and a
column vector per matrix where AdamW keeps two moments the matrix's size, so its state is a small
fraction of the parameters' bytes (AdamW's is twice them).

``init`` is the reference chain's own, so checkpoints of either restore into the other, and
``reference()`` returns the chain for tests to compare against. What differs is the update.
optax builds the update tree and ``optax.apply_updates`` then adds it to the parameters; XLA:CPU
keeps that tree as a temporary array per parameter. Here each parameter's new value and state come
out of one expression of (parameter, gradient, state), which XLA fuses into loops writing the
donated buffers in place, so a train step holds the gradient and nothing else the size of the
parameters (docs/measurements.md, finetune.py).

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


def _clipped(grads, clip_norm: float):
    """(gradients scaled to global norm at most ``clip_norm``, their norm before clipping), as
    optax's ``clip_by_global_norm``."""
    norm = jnp.sqrt(sum(jnp.sum(jnp.square(g)) for g in jax.tree.leaves(grads)))
    # optax: g where the norm is below the limit, else g / norm * limit
    scale = jnp.where(norm < clip_norm, 1.0, clip_norm / norm)
    return jax.tree.map(lambda g: g * scale.astype(g.dtype), grads), norm


def _unzip(params, tuples, width: int):
    """A tree of ``width``-tuples shaped like ``params`` -> a ``width``-tuple of such trees."""
    return jax.tree.transpose(jax.tree.structure(params), jax.tree.structure((0,) * width), tuples)


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
        grads, norm = _clipped(grads, self.clip_norm)
        count = _increment(adam.count)
        learning_rate = jnp.asarray(self.schedule(schedule_state.count), jnp.float32)
        b1, b2, eps, decay = self.b1, self.b2, self.eps, self.weight_decay

        def one(p, g, mu, nu):
            mu = (1 - b1) * g + b1 * mu
            nu = (1 - b2) * (g * g) + b2 * nu
            mu_hat = mu / (1 - b1**count).astype(mu.dtype)
            nu_hat = nu / (1 - b2**count).astype(nu.dtype)
            update = mu_hat / (jnp.sqrt(nu_hat) + eps) + decay * p
            return (p - learning_rate.astype(p.dtype) * update).astype(p.dtype), mu, nu

        triples = jax.tree.map(one, params, grads, adam.mu, adam.nu)
        new_params, mu, nu = _unzip(params, triples, 3)
        new_state = (
            clip_state,
            (
                adam._replace(count=count, mu=mu, nu=nu),
                decay_state,
                schedule_state._replace(count=_increment(schedule_state.count)),
            ),
        )
        return new_params, new_state, norm


def _factored_dims(shape: tuple[int, ...], min_dim: int) -> tuple[int, int] | None:
    """(the second-largest axis, the largest axis) where Adafactor factors the second moment of an
    array of ``shape`` (both at least ``min_dim``), else None; optax's rule, ties included."""
    if len(shape) < 2:
        return None
    # ties keep axis order, as optax's np.argsort does for so few axes (tested on square arrays)
    order = sorted(range(len(shape)), key=lambda axis: shape[axis])
    if shape[order[-2]] < min_dim:
        return None
    return order[-2], order[-1]


@dataclasses.dataclass(frozen=True)
class ClippedAdafactor:
    """Adafactor after global-norm clipping (see the module docstring), with T5X's defaults.

    Attributes:
      schedule: the learning rate per step (optax's schedule, counted from 0), relative to each
        array's RMS (at least ``min_scale``), as optax's ``multiply_by_parameter_scale``.
      clip_norm: gradients whose global norm exceeds it are scaled down to it.
      weight_decay: decoupled weight decay scaled by the learning rate (``p -= lr * wd * p``), on
        every parameter; not part of optax's chain, which has none by default.
      decay_rate: the second moment's decay is 1 - (step + 1)^-decay_rate.
      min_dim_size_to_factor, eps, clipping_threshold, min_scale: optax's ``adafactor`` defaults.
    """

    schedule: optax.Schedule
    clip_norm: float
    weight_decay: float
    decay_rate: float = 0.8
    min_dim_size_to_factor: int = 128
    eps: float = 1e-30
    clipping_threshold: float = 1.0
    min_scale: float = 1e-3

    def reference(self) -> optax.GradientTransformation:
        """The optax chain whose math (at ``weight_decay`` 0) and state this optimizer has."""
        return optax.chain(
            optax.clip_by_global_norm(self.clip_norm),
            optax.adafactor(
                self.schedule,
                min_dim_size_to_factor=self.min_dim_size_to_factor,
                decay_rate=self.decay_rate,
                clipping_threshold=self.clipping_threshold,
                eps=self.eps,
            ),
        )

    def init(self, params):
        """The optimizer state of ``params``: the reference chain's."""
        return self.reference().init(params)

    def apply(self, params, grads, state):
        """One step: (new params, new state, the gradients' global norm before clipping).

        Inside ``jax.jit`` with ``params`` and ``state`` donated, the new parameters and second
        moments take the old ones' buffers.
        """
        clip_state, (factored, block_clip, schedule_state, *rest) = state
        learning_rate = jnp.asarray(self.schedule(schedule_state.count), jnp.float32)
        t = (factored.count + 1).astype(jnp.float32)
        decay = 1.0 - t ** (-self.decay_rate)

        # XLA:CPU fuses an elementwise producer (a product, a broadcast) into a reduction only
        # where the reduction is its sole user; a g * g read by two reductions becomes an array
        # the size of g. So each reduction of a factored array below forms its own expression of
        # g (g * g, |g| * |g|, g * (g * r^2)), and the global norm comes from the row sums.
        def sums(g):
            dims = _factored_dims(g.shape, self.min_dim_size_to_factor)
            if dims is None:
                return jnp.sum(g * g), jnp.float32(0), jnp.float32(0)  # no factors: placeholders
            small, large = dims
            rows = jnp.sum(g * g, axis=large)
            columns = jnp.sum(jnp.abs(g) * jnp.abs(g), axis=small)
            # the barrier keeps XLA from folding sum(rows) into a second reduction of g * g
            return jnp.sum(jax.lax.optimization_barrier(rows)), rows, columns

        stats = jax.tree.map(sums, grads)
        totals, rows, columns = _unzip(grads, stats, 3)
        norm = jnp.sqrt(sum(jax.tree.leaves(totals)))
        # optax's clip_by_global_norm: g where the norm is below the limit, else g / norm * limit
        scale = jnp.where(norm < self.clip_norm, 1.0, self.clip_norm / norm)

        def one(p, g, row_sums, column_sums, v_row, v_col, v):
            dims = _factored_dims(p.shape, self.min_dim_size_to_factor)
            if dims is None:
                g = g * scale.astype(g.dtype)
                v = (decay * v + (1.0 - decay) * (jnp.square(g) + self.eps)).astype(p.dtype)
                factor = jax.lax.rsqrt(v)
                mean_square = jnp.mean(jnp.square(g * factor))  # small arrays: no care taken
            else:
                small, large = dims
                # mean((scale * g)^2 + eps) over an axis, from the sums of g^2
                square_scale = jnp.square(scale)
                row_mean = square_scale * row_sums / p.shape[large] + self.eps
                column_mean = square_scale * column_sums / p.shape[small] + self.eps
                v_row = (decay * v_row + (1.0 - decay) * row_mean).astype(p.dtype)
                v_col = (decay * v_col + (1.0 - decay) * column_mean).astype(p.dtype)
                row_axis = small - 1 if small > large else small
                row_factor = jax.lax.rsqrt(v_row / jnp.mean(v_row, axis=row_axis, keepdims=True))
                column_factor = jax.lax.rsqrt(v_col)
                factor = scale * (
                    jnp.expand_dims(row_factor, axis=large)
                    * jnp.expand_dims(column_factor, axis=small)
                )
                # mean(update^2) from the sums over `small` of g^2 row_factor^2, then the column
                # factors: the reduction reads g and a broadcast of its own, not the update or the
                # factors the loop below forms
                squared_row_factors = jnp.expand_dims(jnp.square(row_factor), large)
                weighted = jnp.sum(g * (g * squared_row_factors), axis=small)
                mean_square = square_scale * jnp.mean(jnp.square(column_factor) * weighted)
                mean_square = mean_square / p.shape[small]
            rms = jnp.sqrt(mean_square)
            param_scale = jnp.maximum(jnp.sqrt(jnp.mean(jnp.square(p))), self.min_scale)
            step = learning_rate * param_scale / jnp.maximum(1.0, rms / self.clipping_threshold)
            new_p = p - step.astype(p.dtype) * (factor * g)
            if self.weight_decay:
                new_p = new_p - (learning_rate * self.weight_decay).astype(p.dtype) * p
            return new_p.astype(p.dtype), v_row, v_col, v

        quads = jax.tree.map(
            one, params, grads, rows, columns, factored.v_row, factored.v_col, factored.v
        )
        new_params, v_row, v_col, v = _unzip(params, quads, 4)
        new_state = (
            clip_state,
            (
                factored._replace(count=_increment(factored.count), v_row=v_row, v_col=v_col, v=v),
                block_clip,
                schedule_state._replace(count=_increment(schedule_state.count)),
                *rest,
            ),
        )
        return new_params, new_state, norm


Optimizer = ClippedAdamW | ClippedAdafactor
