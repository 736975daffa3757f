"""The encoder-decoder SwitchTransformer with T5X's parameter tree (docs/t5x.md §2).

Lingo: token id 0 is padding (and the decoder start token); a *logit mask*
zeroes the normalized inputs of padding positions as flaxformer does; sparse
layers (``config.is_sparse_layer``) use ``MoeLayer`` as their ``mlp``, dense
ones ``DenseMlp``. Tree: ``token_embedder/embedding``;
``{encoder,decoder}/relpos_bias/rel_embedding``; ``encoder/layers_i/{attention,
pre_attention_layer_norm, pre_mlp_layer_norm, mlp}``; ``decoder/layers_i/
{self_attention, pre_self_attention_layer_norm, encoder_decoder_attention,
pre_cross_attention_layer_norm, pre_mlp_layer_norm, mlp}``;
``encoder/encoder_norm``, ``decoder/decoder_norm``, ``decoder/logits_dense``
(untied configs only).
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from qmoe_jax.kernels import dense
from qmoe_jax.kernels.dense import PackedMatrix
from qmoe_jax.models.configs import SwitchConfig
from qmoe_jax.models.experts import MlpExperts
from qmoe_jax.models.layers import (
    DenseKernel,
    DenseMlp,
    MultiHeadAttention,
    RelativePositionBias,
    RmsNorm,
    attention_mask,
    causal_mask,
    dropout,
    kernel_init,
)
from qmoe_jax.models.moe import MoeLayer


class Embedding(nn.Module):
    """Token embedding ``embedding [V, d]``, shared by encoder, decoder and tied logits.

    The parameter may be a ``PackedMatrix`` [V, d] in bfloat16 or int8 (``--dense_dtype``): a
    lookup converts only the rows it takes, and the logits multiply the packed form.
    """

    config: SwitchConfig

    def setup(self):
        cfg = self.config
        # Read before self.param: flax checks a parameter's shape against its initializer.
        packed = self.get_variable("params", "embedding")
        if isinstance(packed, PackedMatrix):
            self.packed = packed
            return
        self.packed = None
        self.embedding = self.param(
            "embedding",
            nn.initializers.normal(1.0),
            (cfg.vocab_size, cfg.d_model),
            cfg.jnp_param_dtype,
        )

    def __call__(self, tokens: jax.Array) -> jax.Array:
        if self.packed is not None:
            return dense.take_rows(self.packed, tokens).astype(self.config.jnp_dtype)
        return jnp.take(self.embedding, tokens, axis=0).astype(self.config.jnp_dtype)

    def attend(self, x: jax.Array) -> jax.Array:
        """``x [.., d] @ embeddingᵀ`` in float32 → ``[.., V]``."""
        if self.packed is not None:
            return dense.matmul(x, self.packed)
        return dense.rows_matmul(x.astype(jnp.float32), self.embedding.astype(jnp.float32))


def _mlp(config: SwitchConfig, sparse: bool, experts_cls: Any) -> nn.Module:
    if sparse:
        return MoeLayer(config, experts_cls)
    return DenseMlp(config)


class EncoderLayer(nn.Module):
    """Pre-norm self-attention then MLP (dense, or MoE when ``sparse``).

    ``attend`` is the part before the MLP; the calibration pass calls it alone.
    """

    config: SwitchConfig
    sparse: bool
    experts_cls: Any = MlpExperts

    def setup(self):
        cfg = self.config
        self.pre_attention_layer_norm = RmsNorm(cfg)
        self.attention = MultiHeadAttention(cfg)
        self.pre_mlp_layer_norm = RmsNorm(cfg)
        self.mlp = _mlp(cfg, self.sparse, self.experts_cls)

    def attend(self, x, mask, bias, logit_mask, *, enable_dropout: bool = False):
        """(residual stream after attention, MLP input), both ``[B, L, d]``."""
        cfg = self.config
        h = self.pre_attention_layer_norm(x) * logit_mask
        h = self.attention(h, h, mask, bias, enable_dropout=enable_dropout)
        x = x + dropout(h, cfg.dropout_rate, enable_dropout, self)
        return x, self.pre_mlp_layer_norm(x) * logit_mask

    def __call__(self, x, mask, bias, logit_mask, *, enable_dropout: bool = False):
        x, h = self.attend(x, mask, bias, logit_mask, enable_dropout=enable_dropout)
        h = self.mlp(h, enable_dropout=enable_dropout)
        return x + dropout(h, self.config.dropout_rate, enable_dropout, self)


class DecoderLayer(nn.Module):
    """Pre-norm causal self-attention, cross-attention, then MLP; ``attend`` is all but the MLP."""

    config: SwitchConfig
    sparse: bool
    experts_cls: Any = MlpExperts

    def setup(self):
        cfg = self.config
        self.pre_self_attention_layer_norm = RmsNorm(cfg)
        self.self_attention = MultiHeadAttention(cfg)
        self.pre_cross_attention_layer_norm = RmsNorm(cfg)
        self.encoder_decoder_attention = MultiHeadAttention(cfg)
        self.pre_mlp_layer_norm = RmsNorm(cfg)
        self.mlp = _mlp(cfg, self.sparse, self.experts_cls)

    def attend(
        self,
        x,
        encoded,
        self_mask,
        cross_mask,
        bias,
        logit_mask,
        *,
        enable_dropout: bool = False,
        cache_position=None,
    ):
        """(residual stream after both attentions, MLP input), both ``[B, L, d]``."""
        cfg = self.config
        h = self.pre_self_attention_layer_norm(x) * logit_mask
        h = self.self_attention(
            h, h, self_mask, bias, enable_dropout=enable_dropout, cache_position=cache_position
        )
        x = x + dropout(h, cfg.dropout_rate, enable_dropout, self)
        h = self.pre_cross_attention_layer_norm(x) * logit_mask
        h = self.encoder_decoder_attention(
            h,
            encoded,
            cross_mask,
            None,
            enable_dropout=enable_dropout,
            cache_encoded=cache_position is not None,
        )
        x = x + dropout(h, cfg.dropout_rate, enable_dropout, self)
        return x, self.pre_mlp_layer_norm(x) * logit_mask

    def __call__(
        self,
        x,
        encoded,
        self_mask,
        cross_mask,
        bias,
        logit_mask,
        *,
        enable_dropout: bool = False,
        cache_position=None,
    ):
        x, h = self.attend(
            x,
            encoded,
            self_mask,
            cross_mask,
            bias,
            logit_mask,
            enable_dropout=enable_dropout,
            cache_position=cache_position,
        )
        h = self.mlp(h, enable_dropout=enable_dropout)
        return x + dropout(h, self.config.dropout_rate, enable_dropout, self)


class Encoder(nn.Module):
    config: SwitchConfig
    embedder: Embedding
    experts_cls: Any = MlpExperts

    @nn.compact
    def __call__(self, tokens: jax.Array, *, enable_dropout: bool = False) -> jax.Array:
        cfg = self.config
        length = tokens.shape[1]
        x = dropout(self.embedder(tokens), cfg.dropout_rate, enable_dropout, self)
        valid = tokens > 0
        logit_mask = valid[..., None].astype(cfg.jnp_dtype)
        mask = attention_mask(valid, valid)
        bias = RelativePositionBias(cfg, bidirectional=True, name="relpos_bias")(length, length)
        for i in range(cfg.num_encoder_layers):
            x = EncoderLayer(
                cfg, cfg.is_sparse_layer(i, decoder=False), self.experts_cls, name=f"layers_{i}"
            )(x, mask, bias, logit_mask, enable_dropout=enable_dropout)
        x = RmsNorm(cfg, name="encoder_norm")(x)
        return dropout(x, cfg.dropout_rate, enable_dropout, self) * logit_mask


def decoder_logit_mask(decoder_input_tokens: jax.Array) -> jax.Array:
    """flaxformer's decoder logit mask ``[B, L]``: token > 0, or next token > 0, or position 0."""
    valid = decoder_input_tokens > 0
    next_valid = jnp.pad(valid[:, 1:], ((0, 0), (0, 1)))
    first = jnp.arange(decoder_input_tokens.shape[1]) == 0
    return valid | next_valid | first[None, :]


class Decoder(nn.Module):
    config: SwitchConfig
    embedder: Embedding
    experts_cls: Any = MlpExperts

    @nn.compact
    def __call__(
        self,
        encoded,
        encoder_input_tokens,
        decoder_input_tokens,
        decoder_target_tokens,
        *,
        enable_dropout: bool = False,
        decode: bool = False,
    ) -> jax.Array:
        cfg = self.config
        batch, length = decoder_input_tokens.shape
        x = dropout(self.embedder(decoder_input_tokens), cfg.dropout_rate, enable_dropout, self)
        relpos = RelativePositionBias(cfg, bidirectional=False, name="relpos_bias")
        encoder_valid = encoder_input_tokens > 0
        if decode:
            initialized = self.has_variable("cache", "cache_index")
            index = self.variable("cache", "cache_index", lambda: jnp.zeros((), jnp.int32))
            position = index.value
            if initialized:
                index.value = position + length
            self_mask = None
            cross_mask = attention_mask(jnp.ones((batch, length), bool), encoder_valid)
            logit_mask = jnp.ones((batch, length, 1), cfg.jnp_dtype)
            bias = relpos(length, length, decode_position=position)
        else:
            position = None
            if decoder_target_tokens is None:
                target_valid = jnp.ones((batch, length), bool)
            else:
                target_valid = decoder_target_tokens > 0
            self_mask = causal_mask(length) & attention_mask(target_valid, target_valid)
            cross_mask = attention_mask(target_valid, encoder_valid)
            logit_mask = decoder_logit_mask(decoder_input_tokens)[..., None].astype(cfg.jnp_dtype)
            bias = relpos(length, length)
        for i in range(cfg.num_decoder_layers):
            x = DecoderLayer(
                cfg, cfg.is_sparse_layer(i, decoder=True), self.experts_cls, name=f"layers_{i}"
            )(
                x,
                encoded,
                self_mask,
                cross_mask,
                bias,
                logit_mask,
                enable_dropout=enable_dropout,
                cache_position=position,
            )
        x = RmsNorm(cfg, name="decoder_norm")(x)
        x = dropout(x, cfg.dropout_rate, enable_dropout, self) * logit_mask
        if cfg.logits_dense:
            return DenseKernel(
                cfg.vocab_size,
                cfg,
                kernel_init(cfg.init_scale),
                dtype=jnp.float32,
                name="logits_dense",
            )(x)
        return self.embedder.attend(x) / jnp.sqrt(jnp.float32(x.shape[-1]))


class SwitchTransformer(nn.Module):
    """Encoder-decoder SwitchTransformer, T5X call convention.

    ``model.apply({'params': params}, encoder_input_tokens, decoder_input_tokens,
    decoder_target_tokens, enable_dropout=False)`` returns float32 logits
    ``[B, L_dec, V]``. Token id 0 is padding. With ``enable_dropout=True`` pass
    ``rngs={'dropout': key}``; the training capacity factor applies. Router
    metrics are sown in ``intermediates`` (see ``moe.router_metrics``).

    Attributes:
      config: a ``SwitchConfig``.
      experts_cls: expert layer of the sparse MLPs (interface in
        ``qmoe_jax.models.experts``); ``MlpExperts`` holds T5X's dense kernels.
    """

    config: SwitchConfig
    experts_cls: Any = MlpExperts

    def setup(self):
        self.token_embedder = Embedding(self.config)
        self.encoder = Encoder(self.config, self.token_embedder, self.experts_cls)
        self.decoder = Decoder(self.config, self.token_embedder, self.experts_cls)

    def encode(self, encoder_input_tokens: jax.Array, *, enable_dropout: bool = False) -> jax.Array:
        """``int32[B, L_enc]`` tokens → encoder outputs ``[B, L_enc, d]`` (zero at padding)."""
        return self.encoder(encoder_input_tokens, enable_dropout=enable_dropout)

    def decode(
        self,
        encoded: jax.Array,
        encoder_input_tokens: jax.Array,
        decoder_input_tokens: jax.Array,
        decoder_target_tokens: jax.Array | None = None,
        *,
        enable_dropout: bool = False,
        decode: bool = False,
    ) -> jax.Array:
        """Decoder logits ``float32[B, L_q, V]`` for ``decoder_input_tokens int32[B, L_q]``.

        Teacher forcing (``decode=False``): causal self-attention; padding comes
        from ``decoder_target_tokens`` (None: no padding).

        Incremental (``decode=True``, ``mutable=['cache']``): the first call,
        with ``decoder_input_tokens`` of the full decode length L and no
        ``cache`` collection, creates a zero cache (its logits are not
        meaningful); each later call feeds the next L_q tokens (usually 1), which
        attend to all earlier ones. The cache also keeps the cross-attention
        keys/values of ``encoded`` from the first call, so later calls must pass
        the same encoder outputs. ``decoding.init_cache`` wraps the first call.
        """
        return self.decoder(
            encoded,
            encoder_input_tokens,
            decoder_input_tokens,
            decoder_target_tokens,
            enable_dropout=enable_dropout,
            decode=decode,
        )

    def __call__(
        self,
        encoder_input_tokens: jax.Array,
        decoder_input_tokens: jax.Array,
        decoder_target_tokens: jax.Array | None,
        *,
        enable_dropout: bool = False,
    ) -> jax.Array:
        encoded = self.encode(encoder_input_tokens, enable_dropout=enable_dropout)
        return self.decode(
            encoded,
            encoder_input_tokens,
            decoder_input_tokens,
            decoder_target_tokens,
            enable_dropout=enable_dropout,
        )


def param_shapes(config: SwitchConfig, experts_cls: Any = MlpExperts) -> dict:
    """The parameter tree as ``jax.ShapeDtypeStruct`` leaves, without allocating anything.

    E.g. to check a checkpoint against a config, or to restore into a shape-only
    tree. Works for every config, switch-c-2048 included.
    """
    model = SwitchTransformer(config, experts_cls)
    tokens = jnp.ones((1, 1), jnp.int32)
    return jax.eval_shape(model.init, jax.random.PRNGKey(0), tokens, tokens, tokens)["params"]
