"""SwitchTransformer configurations (docs/t5x.md §4), as T5X/flaxformer define them.

Lingo: L = layers per stack, NS = sparse (MoE) layers per stack; layer i is
sparse when ``i % (L/NS) == L/NS - 1`` (flaxformer's MIXED layout); E = experts;
a *group* is the set of tokens routed together; *capacity* is the number of
tokens one expert takes from one group, ``max(round(CF * tokens_per_group / E),
min_expert_capacity)``.

Values of the released "switch_classic" checkpoints come from flaxformer's
``flaxformer/t5x/configs/moe/models/switch_{base,large,xxl,c}.gin`` (named
``switch_classic_*.gin`` before 2022; they include ``tokens_choose_*.gin`` and
``architectures/moe.gin``) and from t5x's ``docs/models.md``. The gin files
``qmoe_jax/configs/models/<name>.gin`` bind each config with those files' macro
names.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import jax.numpy as jnp

_DTYPES = ("float32", "bfloat16", "float16")
_ACTIVATIONS = ("relu", "gelu", "silu", "linear")
_CHECKPOINT_ROOT = "gs://t5-data/pretrained_models/t5x/moe/switch_classic"


@dataclasses.dataclass(frozen=True)
class SwitchConfig:
    """Hyper-parameters of an encoder-decoder SwitchTransformer.

    Attributes:
      name: config name (``get_config`` key).
      vocab_size: embedding rows V (32128 for the T5 vocabulary).
      d_model: model width d.
      num_heads, d_kv: attention heads h and per-head width k (projections are
        [d, h*k]).
      d_ff: MLP hidden width f, for dense MLPs and for each expert.
      num_encoder_layers, num_decoder_layers: L per stack.
      num_experts: E per sparse layer.
      num_encoder_sparse_layers, num_decoder_sparse_layers: NS per stack; must
        divide L (0 makes the stack dense).
      mlp_activations: ``("relu",)`` for one ``wi``; two entries, e.g.
        ``("gelu", "linear")``, make a gated MLP ``act0(x wi_0) * act1(x wi_1)``
        with kernels ``wi_0`` and ``wi_1`` (Switch XXL). ``gelu`` is the tanh
        approximation, as in flaxformer.
      logits_dense: untied output projection ``decoder/logits_dense/kernel
        [d, V]``; when False the logits use the token embedding, scaled by
        1/sqrt(d).
      relative_attention_num_buckets, relative_attention_max_distance: T5
        relative position buckets.
      layer_norm_epsilon: RMS norm epsilon.
      dropout_rate: dropout (only with ``enable_dropout=True``), applied where
        T5X applies it: embeddings, attention weights, sublayer outputs, MLP
        hidden units, final norm output.
      train_capacity_factor, eval_capacity_factor: CF with and without dropout.
      min_expert_capacity: lower bound on capacity.
      group_size: maximum tokens per routing group (T5X ``GROUP_SIZE``).
      groups_multiple_of_experts: T5X's rule that the number of groups be a
        multiple of E (a sharding constraint of its pjit layout that also
        changes which tokens drop); see ``moe.num_groups``.
      aux_loss_factor, router_z_loss_factor: weights of the load-balancing and
        router z-loss (T5X ``AUX_LOSS_FACTOR``, ``ROUTER_Z_LOSS_FACTOR``).
      init_scale: T5X ``SCALE`` of the variance-scaling initializers.
      router_dtype: dtype of the router logits and softmax.
      param_dtype: dtype parameters are created in by ``init``.
      dtype: activation / matmul dtype.
      checkpoint_path: T5X checkpoint directory (``.../checkpoint_<step>``) of
        the released model, or None.
      checkpoint_step: training step of that checkpoint, or None.
    """

    name: str
    d_model: int
    num_heads: int
    d_ff: int
    num_encoder_layers: int
    num_decoder_layers: int
    num_experts: int
    num_encoder_sparse_layers: int
    num_decoder_sparse_layers: int
    vocab_size: int = 32128
    d_kv: int = 64
    mlp_activations: tuple[str, ...] = ("relu",)
    logits_dense: bool = False
    relative_attention_num_buckets: int = 32
    relative_attention_max_distance: int = 128
    layer_norm_epsilon: float = 1e-6
    dropout_rate: float = 0.0
    train_capacity_factor: float = 1.25
    eval_capacity_factor: float = 2.0
    min_expert_capacity: int = 4
    group_size: int = 8192
    groups_multiple_of_experts: bool = True
    aux_loss_factor: float = 0.01
    router_z_loss_factor: float = 0.0
    init_scale: float = 0.1
    router_dtype: str = "float32"
    param_dtype: str = "float32"
    dtype: str = "float32"
    checkpoint_path: str | None = None
    checkpoint_step: int | None = None

    def __post_init__(self):
        object.__setattr__(self, "mlp_activations", tuple(self.mlp_activations))
        positive = (
            "d_model",
            "num_heads",
            "d_kv",
            "d_ff",
            "vocab_size",
            "num_experts",
            "num_encoder_layers",
            "num_decoder_layers",
            "group_size",
            "relative_attention_num_buckets",
            "relative_attention_max_distance",
        )
        for field in positive:
            if getattr(self, field) <= 0:
                raise ValueError(
                    f"SwitchConfig {self.name!r}: {field} must be positive, "
                    f"got {getattr(self, field)}"
                )
        for stack in ("encoder", "decoder"):
            layers = getattr(self, f"num_{stack}_layers")
            sparse = getattr(self, f"num_{stack}_sparse_layers")
            if sparse < 0 or sparse > layers or (sparse and layers % sparse):
                raise ValueError(
                    f"SwitchConfig {self.name!r}: num_{stack}_sparse_layers={sparse} must be 0 "
                    f"or divide num_{stack}_layers={layers} (layer i is sparse when "
                    f"i % (L/NS) == L/NS - 1)"
                )
        if not 1 <= len(self.mlp_activations) <= 2:
            raise ValueError(
                f"SwitchConfig {self.name!r}: mlp_activations must have one entry "
                f"(plain MLP) or two (gated MLP), got {self.mlp_activations}"
            )
        for act in self.mlp_activations:
            if act not in _ACTIVATIONS:
                raise ValueError(
                    f"SwitchConfig {self.name!r}: unknown activation {act!r}; "
                    f"choose from {_ACTIVATIONS}"
                )
        for field in ("router_dtype", "param_dtype", "dtype"):
            if getattr(self, field) not in _DTYPES:
                raise ValueError(
                    f"SwitchConfig {self.name!r}: {field}={getattr(self, field)!r} "
                    f"is not one of {_DTYPES}"
                )
        if self.relative_attention_num_buckets % 2:
            raise ValueError(
                f"SwitchConfig {self.name!r}: relative_attention_num_buckets must "
                f"be even (half per direction in the encoder)"
            )
        if min(self.train_capacity_factor, self.eval_capacity_factor) <= 0:
            raise ValueError(f"SwitchConfig {self.name!r}: capacity factors must be positive")
        if self.min_expert_capacity < 1:
            raise ValueError(f"SwitchConfig {self.name!r}: min_expert_capacity must be >= 1")
        if not 0.0 <= self.dropout_rate < 1.0:
            raise ValueError(f"SwitchConfig {self.name!r}: dropout_rate must be in [0, 1)")

    @property
    def gated_mlp(self) -> bool:
        """True when MLPs have two input kernels ``wi_0``, ``wi_1``."""
        return len(self.mlp_activations) == 2

    @property
    def jnp_dtype(self) -> Any:
        return jnp.dtype(self.dtype)

    @property
    def jnp_param_dtype(self) -> Any:
        return jnp.dtype(self.param_dtype)

    @property
    def jnp_router_dtype(self) -> Any:
        return jnp.dtype(self.router_dtype)

    def is_sparse_layer(self, layer: int, decoder: bool) -> bool:
        """Whether ``layers_<layer>`` of the encoder (or decoder) stack is an MoE layer."""
        layers = self.num_decoder_layers if decoder else self.num_encoder_layers
        sparse = self.num_decoder_sparse_layers if decoder else self.num_encoder_sparse_layers
        if sparse == 0:
            return False
        period = layers // sparse
        return layer % period == period - 1

    def sparse_layers(self, decoder: bool) -> tuple[int, ...]:
        """Indices of the sparse layers of one stack."""
        layers = self.num_decoder_layers if decoder else self.num_encoder_layers
        return tuple(i for i in range(layers) if self.is_sparse_layer(i, decoder))

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serializable dict; ``SwitchConfig.from_dict`` inverts it."""
        out = dataclasses.asdict(self)
        out["mlp_activations"] = list(self.mlp_activations)
        return out

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> SwitchConfig:
        """Builds a config from ``to_dict`` output; unknown keys are an error."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(
                f"unknown SwitchConfig fields {unknown}; known fields: {sorted(known)}"
            )
        return cls(**values)


def _switch_base(experts: int, step: int) -> SwitchConfig:
    return SwitchConfig(
        name=f"switch-base-{experts}",
        d_model=768,
        num_heads=12,
        d_kv=64,
        d_ff=3072,
        num_encoder_layers=12,
        num_decoder_layers=12,
        num_experts=experts,
        num_encoder_sparse_layers=6,
        num_decoder_sparse_layers=6,
        train_capacity_factor=1.25,
        eval_capacity_factor=2.0,
        min_expert_capacity=4,
        group_size=8192,
        checkpoint_path=f"{_CHECKPOINT_ROOT}/base/e{experts}/checkpoint_{step}",
        checkpoint_step=step,
    )


def _named_configs() -> dict[str, SwitchConfig]:
    configs = [
        _switch_base(8, 500100),
        *(_switch_base(e, 550000) for e in (16, 32, 64, 128, 256)),
        SwitchConfig(
            name="switch-large-128",
            d_model=1024,
            num_heads=16,
            d_kv=64,
            d_ff=4096,
            num_encoder_layers=24,
            num_decoder_layers=24,
            num_experts=128,
            num_encoder_sparse_layers=12,
            num_decoder_sparse_layers=12,
            train_capacity_factor=1.25,
            eval_capacity_factor=2.0,
            min_expert_capacity=4,
            group_size=4096,
            checkpoint_path=f"{_CHECKPOINT_ROOT}/large/e128/checkpoint_483100",
            checkpoint_step=483100,
        ),
        SwitchConfig(
            name="switch-xxl-128",
            d_model=4096,
            num_heads=64,
            d_kv=64,
            d_ff=10240,
            num_encoder_layers=24,
            num_decoder_layers=24,
            num_experts=128,
            num_encoder_sparse_layers=12,
            num_decoder_sparse_layers=12,
            mlp_activations=("gelu", "linear"),
            logits_dense=True,
            train_capacity_factor=1.25,
            eval_capacity_factor=4.0,
            min_expert_capacity=2,
            group_size=4096,
            checkpoint_path=f"{_CHECKPOINT_ROOT}/xxl/e128/checkpoint_634600",
            checkpoint_step=634600,
        ),
        SwitchConfig(
            name="switch-c-2048",
            d_model=2080,
            num_heads=30,
            d_kv=64,
            d_ff=6144,
            num_encoder_layers=15,
            num_decoder_layers=15,
            num_experts=2048,
            num_encoder_sparse_layers=15,
            num_decoder_sparse_layers=15,
            logits_dense=True,
            train_capacity_factor=1.0,
            eval_capacity_factor=2.0,
            min_expert_capacity=2,
            group_size=2048,
            checkpoint_path=f"{_CHECKPOINT_ROOT}/c/e2048/checkpoint_611800",
            checkpoint_step=611800,
        ),
        # The project's own bundled model (checkpoints/switch-mini-8): 4000
        # SentencePiece pieces + 100 sentinels, padded to a multiple of 128.
        # Every MLP is sparse, as in switch-c-2048: with every other layer
        # sparse, a run of this size learned to lean on the dense MLPs and
        # zeroing all experts cost only 0.014 nats at step 2500, which would
        # make expert compression unmeasurable on the bundled model. All-sparse
        # training diverged at init_scale 1.0 and peak learning rate 2e-3 (router
        # z-loss 3 -> 7, gradient norm 2e3 by step 1500); the Switch paper's
        # 10x smaller initialization (0.1) keeps it stable.
        SwitchConfig(
            name="switch-mini-8",
            vocab_size=4224,
            d_model=128,
            num_heads=4,
            d_kv=32,
            d_ff=512,
            num_encoder_layers=4,
            num_decoder_layers=4,
            num_experts=8,
            num_encoder_sparse_layers=4,
            num_decoder_sparse_layers=4,
            dropout_rate=0.1,
            train_capacity_factor=1.25,
            eval_capacity_factor=2.0,
            min_expert_capacity=4,
            group_size=4096,
            init_scale=0.1,
            checkpoint_path="checkpoints/switch-mini-8/checkpoint_6000",
            checkpoint_step=6000,
        ),
    ]
    return {c.name: c for c in configs}


_CONFIGS = _named_configs()


def config_names() -> tuple[str, ...]:
    """Names ``get_config`` knows."""
    return tuple(_CONFIGS)


def get_config(name: str) -> SwitchConfig:
    """Returns the named config; ``dataclasses.replace(cfg, ...)`` makes variants.

    Raises:
      KeyError: unknown name (the message lists the known names).
    """
    try:
        return _CONFIGS[name]
    except KeyError:
        raise KeyError(
            f"unknown SwitchTransformer config {name!r}; known configs: {', '.join(_CONFIGS)}"
        ) from None


def resolve_config(spec: str) -> SwitchConfig:
    """A registered config by name, or one read from a JSON file of ``SwitchConfig`` fields."""
    if spec.endswith(".json"):
        if not os.path.isfile(spec):
            raise FileNotFoundError(f"config file {spec!r} does not exist")
        try:
            with open(spec) as f:
                return SwitchConfig(**json.load(f))
        except (TypeError, ValueError) as error:
            raise ValueError(f"{spec} is not a SwitchConfig: {error}") from None
    try:
        return get_config(spec)
    except KeyError as error:
        raise ValueError(error.args[0]) from None
