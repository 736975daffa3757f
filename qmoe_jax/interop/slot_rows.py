"""Which rows of an expert stack's capacity slots to compute, for the compressed MoE layer inside
T5X (``interop/t5x_moe.py``), and its per-token path: no flaxformer.

flaxformer's dispatch hands the experts ``[E, T, H]`` rows, and its empty capacity slots are all
zero. ``on_rows_in_use`` runs an expert MLP on the nonzero rows only, at one of a few compiled
row counts (``row_buckets``); where the MLP maps a zero row to zero (``maps_zero_to_zero``), that
is what running it on every row gives.
"""

from __future__ import annotations

import functools
import operator

import flax.linen as nn
import jax
import jax.numpy as jnp

from qmoe_jax.kernels import ops


def activation(name):
    """flaxformer's ``MlpBlock`` activation ``name`` ("linear", or a ``flax.linen`` function
    name) as a function; a callable is returned as it is."""
    if name == "linear":
        return lambda x: x
    return getattr(nn, name) if isinstance(name, str) else name


def maps_zero_to_zero(activations) -> bool:
    """Whether the expert MLP gives zero for a zero input row: the product of its activations
    at 0 is 0 (the kernels and ``wo`` carry no bias)."""
    with jax.ensure_compile_time_eval():
        at_zero = functools.reduce(
            operator.mul,
            [float(activation(act)(jnp.zeros((), jnp.float32))) for act in activations],
        )
    return at_zero == 0.0


def row_buckets(rows: int) -> list[int]:
    """The row counts ``on_rows_in_use`` compiles the MLP for, ascending: ``rows`` and each
    quarter of the last, rounded up, down to 1."""
    sizes = [rows]
    while sizes[-1] > 1:
        sizes.append(-(-sizes[-1] // 4))
    return sorted(set(sizes))


def on_rows_in_use(mlp, x: jax.Array, blocks: int, labels: jax.Array | None = None) -> jax.Array:
    """``mlp`` (``[E, N, H], counts int32[E, blocks] → [E, N, H']``, rows past each block's count
    unread and zero) applied to the nonzero rows of ``x [E, T, H]`` only; zero rows give zero.

    Each of the ``blocks`` blocks of T // blocks rows (one per device along the replicas axis)
    has its nonzero rows moved first, in order; the MLP then runs on the first ``size`` rows of
    every block, ``size`` the smallest of ``row_buckets`` that holds the largest count (one
    branch of ``lax.switch`` per bucket), and its outputs go back to the rows they came from.
    ``labels [E, T]``, when given, move with the rows and reach ``mlp`` as a third argument
    ``[E, N]`` (the per-token path passes each row's own expert).
    """
    experts, tokens, *hidden = x.shape
    per_block = tokens // blocks
    grouped = x.reshape(experts, blocks, per_block, *hidden)
    in_use = jnp.any(grouped != 0, axis=tuple(range(3, grouped.ndim)))
    order = jnp.argsort(~in_use, axis=-1, stable=True)
    counts = jnp.sum(in_use, axis=-1, dtype=jnp.int32)
    sizes = row_buckets(per_block)
    expert_index = jnp.arange(experts)[:, None, None]
    block_index = jnp.arange(blocks)[None, :, None]

    def branch(size: int):
        def run(grouped, order, counts):
            index = order[..., :size]
            rows = grouped[expert_index, block_index, index]
            extra = ()
            if labels is not None:
                chosen = labels.reshape(experts, blocks, per_block)[
                    expert_index, block_index, index
                ]
                extra = (chosen.reshape(experts, blocks * size),)
            out = mlp(rows.reshape(experts, blocks * size, *hidden), counts, *extra)
            out = out.reshape(experts, blocks, size, *out.shape[2:])
            placed = jnp.zeros((experts, blocks, per_block, *out.shape[3:]), out.dtype)
            placed = placed.at[expert_index, block_index, index].set(out)
            return placed.reshape(experts, tokens, *out.shape[3:])

        return run

    which = jnp.searchsorted(jnp.asarray(sizes, jnp.int32), jnp.max(counts))
    return jax.lax.switch(which, [branch(size) for size in sizes], grouped, order, counts)


def hidden_units(project, kernels) -> jax.Array:
    """The expert MLP's hidden units: the product over ``kernels``, ``(name, activation)`` pairs,
    of ``activation(project(name))``."""
    return functools.reduce(operator.mul, [activation(act)(project(name)) for name, act in kernels])


def each_token_its_expert(
    weights: dict, dictionary, kernels: list, x: jax.Array, expert_index: jax.Array
) -> jax.Array:
    """Token n's expert MLP ``expert_index[n]`` on ``x [N, H]`` → ``[N, H']``, on the nonzero
    tokens only (``on_rows_in_use``, zero tokens give zero).

    ``weights`` maps kernel names to ``CompressedExperts`` stacks; ``kernels`` lists the input
    kernels as ``(name, activation)``, whose outputs multiply, and ``weights["wo"]`` maps the
    product back. Each kernel is one fused call on the experts gathered for the tokens (their
    codes, row offsets and min/max), with the tokens past the count skipped.
    """

    def mlp(rows: jax.Array, counts: jax.Array, chosen: jax.Array) -> jax.Array:
        rows, index = rows[0], chosen[0]
        in_use = (jnp.arange(rows.shape[0]) < counts[0, 0]).astype(jnp.int32)

        def project(kernel: str, h: jax.Array) -> jax.Array:
            gathered = weights[kernel].take(index)
            return ops.matmul(gathered, h[:, None, :], dictionary, in_use)[:, 0]

        hidden = hidden_units(lambda name: project(name, rows), kernels)
        return project("wo", hidden)[None]

    return on_rows_in_use(mlp, x[None], 1, labels=expert_index[None])[0]


def each_token_routed(
    weights: dict, dictionary, kernels: list, x: jax.Array, expert_index: jax.Array
) -> jax.Array:
    """``each_token_its_expert`` with the routed kernel (``ops.matmul_routed``): the tokens stay
    where they are and each expert named is decoded once for all its tokens; nothing is
    gathered. Zero tokens and indexes out of range give zero rows and are not computed."""
    num_experts = weights["wo"].num_experts
    index = jnp.where(jnp.any(x != 0, axis=-1), expert_index.astype(jnp.int32), num_experts)

    def project(kernel: str, h: jax.Array) -> jax.Array:
        return ops.matmul_routed(weights[kernel], h, index, dictionary)

    hidden = hidden_units(lambda name: project(name, x), kernels)
    return project("wo", hidden)
