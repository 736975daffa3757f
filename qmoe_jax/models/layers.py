"""Dense building blocks of the T5X SwitchTransformer (docs/t5x.md §5).

Lingo: B batch, L_q / L_k query / key lengths, d model width, h heads, k per-head
width, f MLP width. T5 semantics: RMS norm without mean subtraction or bias
(eps 1e-6), attention logits without the 1/sqrt(k) factor (T5X folds it into the
query initializer), relative position buckets shared by all layers of a stack,
attention masks as -1e10 biases, dropout broadcast over the length axis.
Parameter names follow flaxformer, so a T5X checkpoint loads without renaming.
"""

from __future__ import annotations

from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from qmoe_jax.kernels import dense
from qmoe_jax.kernels.dense import PackedMatrix
from qmoe_jax.models.configs import SwitchConfig
from qmoe_jax.models.mlp import hidden_units

MASK_BIAS = -1e10


def kernel_init(scale: float, distribution: str = "truncated_normal", divide_by: float = 1.0):
    """T5X variance-scaling (fan_in) initializer, optionally divided by a constant."""
    base = nn.initializers.variance_scaling(scale, "fan_in", distribution)
    if divide_by == 1.0:
        return base
    return lambda key, shape, dtype=jnp.float32: (base(key, shape, dtype) / divide_by).astype(dtype)


class DenseKernel(nn.Module):
    """``y = x @ kernel`` with a single parameter ``kernel [in, out]`` (no bias).

    The parameter may instead be a ``PackedMatrix`` of ``kernelᵀ [out, in]`` in bfloat16 or int8
    (``inference.dense_forms``, ``--dense_dtype``): the product then runs on the packed form in
    float32 (``kernels.dense.matmul``) and is cast to the compute dtype. A float32 product of a
    few tokens (a decoding step's) runs through the CPU kernel ``kernels.dense.kernel_matmul``.
    """

    features: int
    config: SwitchConfig
    init: Callable = nn.initializers.lecun_normal()
    dtype: jnp.dtype | None = None

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        dtype = self.dtype or self.config.jnp_dtype
        # Read before self.param: flax checks a parameter's shape against its initializer.
        packed = self.get_variable("params", "kernel")
        if isinstance(packed, PackedMatrix):
            return dense.matmul(x, packed).astype(dtype)
        kernel = self.param(
            "kernel", self.init, (x.shape[-1], self.features), self.config.jnp_param_dtype
        )
        return dense.kernel_matmul(x.astype(dtype), kernel.astype(dtype))


class RmsNorm(nn.Module):
    """T5 layer norm: ``x / sqrt(mean(x²) + eps) * scale``, computed in float32."""

    config: SwitchConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        scale = self.param(
            "scale", nn.initializers.ones, (x.shape[-1],), self.config.jnp_param_dtype
        )
        x = x.astype(jnp.float32)
        mean_square = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
        y = (x * jax.lax.rsqrt(mean_square + self.config.layer_norm_epsilon)).astype(
            self.config.jnp_dtype
        )
        return y * scale.astype(self.config.jnp_dtype)


def relative_position_bucket(
    relative_position: np.ndarray, bidirectional: bool, num_buckets: int, max_distance: int
) -> np.ndarray:
    """T5 bucket of ``memory_position - query_position`` (numpy, int32).

    Half the buckets (per direction when bidirectional) hold exact distances
    0..n/2-1, the rest grow logarithmically up to ``max_distance``; causal
    (not bidirectional) buckets map every future position to bucket 0.
    """
    n = -np.asarray(relative_position, np.int32)
    bucket = np.zeros_like(n)
    if bidirectional:
        num_buckets //= 2
        bucket += (n < 0).astype(np.int32) * num_buckets
        n = np.abs(n)
    else:
        n = np.maximum(n, 0)
    max_exact = num_buckets // 2
    with np.errstate(divide="ignore"):
        large = max_exact + (
            np.log(n.astype(np.float32) / max_exact + np.finfo(np.float32).eps)
            / np.log(max_distance / max_exact)
            * (num_buckets - max_exact)
        ).astype(np.int32)
    large = np.minimum(large, num_buckets - 1)
    return bucket + np.where(n < max_exact, n, large)


class RelativePositionBias(nn.Module):
    """Shared per-stack attention bias ``rel_embedding [h, buckets]`` → ``[1, h, L_q, L_k]``.

    For incremental decoding (``decode_position`` given) the first call, made
    with the full decode length L, stores the buckets of every relative offset
    in ``-(L-1)..L-1`` as the cache variable ``relative_buckets`` (its length
    also fixes L); each later call looks up the rows of the queries at
    ``decode_position + arange(L_q)`` against the L key slots.
    """

    config: SwitchConfig
    bidirectional: bool

    def _buckets(self, relative: np.ndarray) -> np.ndarray:
        cfg = self.config
        return relative_position_bucket(
            relative,
            self.bidirectional,
            cfg.relative_attention_num_buckets,
            cfg.relative_attention_max_distance,
        )

    @nn.compact
    def __call__(
        self, query_length: int, key_length: int, decode_position: jax.Array | None = None
    ) -> jax.Array:
        cfg = self.config
        table = self.param(
            "rel_embedding",
            nn.initializers.variance_scaling(cfg.init_scale, "fan_avg", "uniform"),
            (cfg.num_heads, cfg.relative_attention_num_buckets),
            cfg.jnp_param_dtype,
        )
        if decode_position is None:
            relative = np.arange(key_length)[None, :] - np.arange(query_length)[:, None]
            buckets = jnp.asarray(self._buckets(relative))
        else:
            offsets = self.variable(
                "cache",
                "relative_buckets",
                lambda: jnp.asarray(self._buckets(np.arange(1 - key_length, key_length))),
            )
            length = (offsets.value.shape[0] + 1) // 2
            queries = decode_position + jnp.arange(query_length)
            buckets = offsets.value[jnp.arange(length)[None, :] - queries[:, None] + length - 1]
        return jnp.take(table.astype(jnp.float32), buckets, axis=1)[None]


def attention_mask(query_valid: jax.Array, key_valid: jax.Array) -> jax.Array:
    """``[B, 1, L_q, L_k]`` boolean mask from ``[B, L_q]`` and ``[B, L_k]`` validity."""
    return query_valid[:, None, :, None] & key_valid[:, None, None, :]


def causal_mask(length: int) -> jax.Array:
    """``[1, 1, L, L]`` lower-triangular mask."""
    return jnp.tril(jnp.ones((length, length), bool))[None, None]


def dropout(
    x: jax.Array,
    rate: float,
    enable_dropout: bool,
    module: nn.Module,
    broadcast_dims: tuple[int, ...] = (-2,),
) -> jax.Array:
    """T5X dropout: one mask shared along ``broadcast_dims`` (the length axis by default)."""
    if not enable_dropout or rate == 0.0:
        return x
    shape = list(x.shape)
    for dim in broadcast_dims:
        shape[dim] = 1
    keep = jax.random.bernoulli(module.make_rng("dropout"), 1.0 - rate, shape)
    return jnp.where(keep, x / (1.0 - rate), jnp.zeros_like(x)).astype(x.dtype)


def token_expert_dropout(
    x: jax.Array,
    rate: float,
    enable_dropout: bool,
    module: nn.Module,
    num_experts: int,
    expert_index: jax.Array,
) -> jax.Array:
    """``dropout`` of expert hidden units ``x [N, ..., f]`` held token by token, with the mask the
    expert layout ``[E, T, f]`` draws: one row per expert, shared by its tokens, taken for each
    token's expert (``expert_index int[N]``, clipped into range). The same random bits as
    ``dropout`` on ``[E, T, f]`` in the same place of the module, so both layouts drop alike."""
    if not enable_dropout or rate == 0.0:
        return x
    width = x.shape[-1]
    keep = jax.random.bernoulli(module.make_rng("dropout"), 1.0 - rate, (num_experts, 1, width))
    keep = jnp.take(keep, expert_index, axis=0, mode="clip")  # [N, 1, f]
    keep = keep.reshape(x.shape[0], *([1] * (x.ndim - 2)), width)
    return jnp.where(keep, x / (1.0 - rate), jnp.zeros_like(x)).astype(x.dtype)


class MultiHeadAttention(nn.Module):
    """T5 attention with ``query``/``key``/``value`` ``[d, h*k]`` and ``out [h*k, d]``.

    In incremental decoding the ``cache`` collection holds ``cached_key
    [B, h, k, L]`` and ``cached_value [B, h, L, k]``: for self-attention
    (``cache_position`` given) the keys/values of the steps so far (L = L_max);
    for cross-attention (``cache_encoded=True``) the projected encoder outputs
    (L = L_enc), computed once by the call that creates the cache. These are the
    orders in which XLA:CPU's two attention products take their operands: stored
    as ``[B, L, h, k]``, every cached key and value was transposed into them on
    every decoding step (docs/measurements.md, inference.py). A decoding step
    attends to the cache as it was and to its own keys as two blocks of one
    softmax, so that no product reads the updated cache, and writes the cache
    after those products (its update depends on their result): XLA then updates
    it in place, with no copy.
    """

    config: SwitchConfig

    def _heads(self, x: jax.Array) -> jax.Array:
        return x.reshape(*x.shape[:-1], self.config.num_heads, self.config.d_kv)

    def _fused_qkv(self, inputs_q: jax.Array, inputs_kv: jax.Array) -> list[jax.Array]:
        """Query, key and value ``[B, L, h*k]`` from the packed ``qkv`` kernel, the three kernels'
        rows stacked (``inference.dense_forms.fuse_qkv``): one product when the inputs are one
        array, as in self-attention. Inputs that are distinct arrays (a transformation that
        re-wraps arguments) get the query's rows and the key's and value's rows in two
        products, which copies the slices of the matrix but computes the same."""
        packed = self.get_variable("params", "qkv")["kernel"]
        inner = self.config.num_heads * self.config.d_kv
        dtype = self.config.jnp_dtype
        if inputs_kv is inputs_q:
            return jnp.split(dense.matmul(inputs_q, packed).astype(dtype), 3, axis=-1)
        query_rows = dense.row_block(packed, slice(inner))
        kv_rows = dense.row_block(packed, slice(inner, None))
        return [
            dense.matmul(inputs_q, query_rows).astype(dtype),
            *jnp.split(dense.matmul(inputs_kv, kv_rows).astype(dtype), 2, axis=-1),
        ]

    @staticmethod
    def _logits(query, key, mask, bias) -> jax.Array:
        """Float32 logits ``[B, h, L_q, L_k]`` of ``query [B, L_q, h, k]`` against ``key
        [B, h, k, L_k]``, masked positions at ``MASK_BIAS``, plus ``bias``."""
        logits = jnp.einsum("bqhk,bhkt->bhqt", query.astype(jnp.float32), key.astype(jnp.float32))
        if mask is not None:
            logits = logits + jnp.where(mask, 0.0, MASK_BIAS)
        if bias is not None:
            logits = logits + bias
        return logits

    @nn.compact
    def __call__(
        self,
        inputs_q: jax.Array,
        inputs_kv: jax.Array,
        mask: jax.Array | None,
        bias: jax.Array | None,
        *,
        enable_dropout: bool = False,
        cache_position: jax.Array | None = None,
        cache_encoded: bool = False,
    ) -> jax.Array:
        """Attends ``inputs_q [B, L_q, d]`` to ``inputs_kv [B, L_k, d]``.

        Args:
          mask: bool ``[B|1, 1, L_q, L_k]`` (True = may attend) or None.
          bias: float ``[1, h, L_q, L_k]`` position bias or None.
          cache_position: int32 scalar; when given, the keys/values of this
            step are written into the cache at that position and the query
            attends to cache positions ``<= cache_position + i``; outputs are
            NaN if the step runs past the end of the cache.
          cache_encoded: reuse the cached projections of ``inputs_kv`` (the
            encoder outputs) after the call that creates them.
        Returns:
          ``[B, L_q, d]``.
        """
        cfg = self.config
        inner = cfg.num_heads * cfg.d_kv
        init = kernel_init(cfg.init_scale, "normal")
        query_init = kernel_init(cfg.init_scale, "normal", np.sqrt(cfg.d_kv))
        projected = None  # (key, value) [B, L_k, h*k] when a fused product made them
        if self.has_variable("params", "qkv"):
            query, *projected = self._fused_qkv(inputs_q, inputs_kv)
        else:
            query = DenseKernel(inner, cfg, query_init, name="query")(inputs_q)
        query = self._heads(query)
        if cache_encoded and self.has_variable("cache", "cached_key"):
            key = self.get_variable("cache", "cached_key")
            value = self.get_variable("cache", "cached_value")
        else:  # key [B, h, k, L_k], value [B, h, L_k, k]
            if projected is None:
                projected = [
                    DenseKernel(inner, cfg, init, name=name)(inputs_kv) for name in ("key", "value")
                ]
            key, value = (self._heads(p) for p in projected)
            key, value = key.transpose(0, 2, 3, 1), value.transpose(0, 2, 1, 3)
            if cache_encoded:
                self.put_variable("cache", "cached_key", key)
                self.put_variable("cache", "cached_value", value)
        stepped = False
        if cache_position is not None:
            # The first decode call creates a zero cache sized by its inputs
            # (L = L_max); later calls write their keys/values at
            # cache_position and attend to everything written so far.
            initialized = self.has_variable("cache", "cached_key")
            cached_key = self.variable("cache", "cached_key", jnp.zeros, key.shape, key.dtype)
            cached_value = self.variable(
                "cache", "cached_value", jnp.zeros, value.shape, value.dtype
            )
            if initialized:
                stepped = True
                old_key, old_value = cached_key.value, cached_value.value
            else:
                query_positions = cache_position + jnp.arange(query.shape[1])
                visible = jnp.arange(key.shape[3])[None, :] <= query_positions[:, None]
                mask = visible[None, None] if mask is None else mask & visible[None, None]
        # Blocks of keys along which one softmax runs: (key, value, mask, bias) each.
        blocks = [(key, value, mask, bias)]
        if stepped:
            # A decoding step attends to the cache as it was (the slots before cache_position)
            # and to its own keys (causally) as two blocks of one softmax: the same sum as over
            # the updated cache, but no product reads the updated arrays, so XLA writes them in
            # place once instead of copying the cache for every reader of a fused update.
            slots, steps = old_key.shape[3], query.shape[1]
            old_mask = (jnp.arange(slots) < cache_position)[None, None, None, :]
            new_mask = (jnp.arange(steps)[None, :] <= jnp.arange(steps)[:, None])[None, None]
            if mask is not None:
                old_mask = old_mask & mask
                new_mask = new_mask & jax.lax.dynamic_slice_in_dim(mask, cache_position, steps, 3)
            new_bias = None
            if bias is not None:
                new_bias = jax.lax.dynamic_slice_in_dim(bias, cache_position, steps, 3)
            blocks = [(old_key, old_value, old_mask, bias), (key, value, new_mask, new_bias)]
        logits = jnp.concatenate([self._logits(query, k, m, b) for k, _, m, b in blocks], axis=-1)
        weights = jax.nn.softmax(logits, axis=-1).astype(cfg.jnp_dtype)
        weights = dropout(weights, cfg.dropout_rate, enable_dropout, self, broadcast_dims=(-2,))
        contexts, start = [], 0
        for block_key, block_value, _, _ in blocks:
            width = block_key.shape[3]
            block_weights = weights[..., start : start + width]
            contexts.append(
                jnp.einsum("bhqt,bhtk->bqhk", block_weights, block_value.astype(cfg.jnp_dtype))
            )
            start += width
        context = sum(contexts[1:], contexts[0])
        if stepped:
            # The cache's update reads the context, so it comes after every product that read the
            # old cache, and XLA updates the cache in place: otherwise it copied each cache twice
            # per step, once for the products and once for the update (docs/measurements.md,
            # decode_profile.py). What is added is -0.0 whatever the context: the keys and values
            # are written bit for bit.
            total = jnp.sum(context)
            after = -0.0 * jnp.abs(jnp.where(jnp.isfinite(total), total, 0.0))
            cached_key.value = jax.lax.dynamic_update_slice_in_dim(
                old_key, key + after.astype(key.dtype), cache_position, axis=3
            )
            cached_value.value = jax.lax.dynamic_update_slice_in_dim(
                old_value, value + after.astype(value.dtype), cache_position, axis=2
            )
        context = context.reshape(*context.shape[:2], inner)
        out = DenseKernel(cfg.d_model, cfg, init, name="out")(context)
        if cache_position is not None:
            # Feeding past the cache's end has no meaningful answer: NaN, not a clamp.
            overflow = cache_position + query.shape[1] > cached_key.value.shape[3]
            out = jnp.where(overflow, jnp.nan, out).astype(out.dtype)
        return out


class DenseMlp(nn.Module):
    """T5 MLP ``wo(act(x wi))``, or gated ``wo(act0(x wi_0) * act1(x wi_1))``; ``[.., d] → [..,
    d]``."""

    config: SwitchConfig

    @nn.compact
    def __call__(self, x: jax.Array, *, enable_dropout: bool = False) -> jax.Array:
        cfg = self.config
        init = kernel_init(cfg.init_scale, "truncated_normal")
        hidden = hidden_units(cfg, lambda name: DenseKernel(cfg.d_ff, cfg, init, name=name)(x))
        hidden = dropout(hidden, cfg.dropout_rate, enable_dropout, self)
        return DenseKernel(cfg.d_model, cfg, init, name="wo")(hidden)
