"""Hugging Face SwitchTransformers parameter names and their places in the T5X tree
(docs/qmoe_import.md §5).

HF names a torch ``Linear`` weight ``W[out, in]`` (``y = W·x``); T5X stores the
kernel ``K[in, out]`` (``y = x·K``), so every kernel is the HF weight
transposed. Block ``i`` of a stack holds ``layer.0`` (self-attention), in the
decoder ``layer.1`` (cross-attention), and last its MLP (``layer.1`` in the
encoder, ``layer.2`` in the decoder); a sparse MLP holds
``router.classifier`` and ``experts.expert_<e>.{wi,wo}``. Only block 0 of each
stack carries ``relative_attention_bias``; T5X keeps it once per stack.
HF's ``shared`` embedding is T5X's single ``token_embedder``; an untied model
has ``lm_head`` (T5X ``decoder/logits_dense``).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from qmoe_jax.models import SwitchConfig

ATTENTION = (("query", "q"), ("key", "k"), ("value", "v"), ("out", "o"))
EXPERT_KERNELS = ("wi", "wo")


def mlp_name(stack: str, layer: int) -> str:
    """HF prefix of a block's MLP, e.g. ``encoder.block.1.layer.1.mlp``."""
    return f"{stack}.block.{layer}.layer.{1 if stack == 'encoder' else 2}.mlp"


def expert_name(stack: str, layer: int, expert: int) -> str:
    """HF prefix of one expert, e.g. ``encoder.block.1.layer.1.mlp.experts.expert_7``."""
    return f"{mlp_name(stack, layer)}.experts.expert_{expert}"


def t5x_layer_name(stack: str, layer: int) -> str:
    """Our name of a sparse layer (docs/format.md §8.1), e.g. ``encoder.layers_1.mlp``."""
    return f"{stack}.layers_{layer}.mlp"


class HFNamesError(ValueError):
    """HF parameters that do not fit the model config."""


def _get(state: Mapping[str, np.ndarray], name: str, shape: tuple[int, ...]) -> np.ndarray:
    if name not in state:
        raise HFNamesError(f"parameter {name} is missing")
    value = np.asarray(state[name])
    if value.shape != shape:
        raise HFNamesError(
            f"parameter {name} has shape {list(value.shape)}, expected {list(shape)}"
        )
    return value


def _kernel(state, name: str, inputs: int, outputs: int) -> dict:
    return {"kernel": np.ascontiguousarray(_get(state, f"{name}.weight", (outputs, inputs)).T)}


def _scale(state, name: str, config: SwitchConfig) -> dict:
    return {"scale": np.asarray(_get(state, f"{name}.weight", (config.d_model,)))}


def _attention(state, prefix: str, config: SwitchConfig) -> dict:
    inner = config.num_heads * config.d_kv
    tree = {
        ours: _kernel(state, f"{prefix}.{theirs}", config.d_model, inner)
        for ours, theirs in ATTENTION[:3]
    }
    tree["out"] = _kernel(state, f"{prefix}.o", inner, config.d_model)
    return tree


def _mlp(state, stack: str, layer: int, config: SwitchConfig, experts: bool) -> dict:
    prefix = mlp_name(stack, layer)
    if not config.is_sparse_layer(layer, decoder=stack == "decoder"):
        return {
            "wi": _kernel(state, f"{prefix}.wi", config.d_model, config.d_ff),
            "wo": _kernel(state, f"{prefix}.wo", config.d_ff, config.d_model),
        }
    tree = {
        "router": {
            "router_weights": {
                "w": _kernel(
                    state, f"{prefix}.router.classifier", config.d_model, config.num_experts
                )
            }
        }
    }
    if experts:
        sizes = {"wi": (config.d_model, config.d_ff), "wo": (config.d_ff, config.d_model)}
        tree["expert"] = {
            kernel: {
                "kernel": np.stack(
                    [
                        _kernel(state, f"{expert_name(stack, layer, e)}.{kernel}", *sizes[kernel])[
                            "kernel"
                        ]
                        for e in range(config.num_experts)
                    ]
                )
            }
            for kernel in EXPERT_KERNELS
        }
    return tree


def _stack(state, stack: str, config: SwitchConfig, experts: bool) -> dict:
    buckets = (config.relative_attention_num_buckets, config.num_heads)
    tree = {
        "relpos_bias": {
            "rel_embedding": np.ascontiguousarray(
                _get(
                    state,
                    f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
                    buckets,
                ).T
            )
        },
        f"{stack}_norm": _scale(state, f"{stack}.final_layer_norm", config),
    }
    layers = config.num_decoder_layers if stack == "decoder" else config.num_encoder_layers
    for i in range(layers):
        block = f"{stack}.block.{i}.layer"
        if stack == "encoder":
            tree[f"layers_{i}"] = {
                "pre_attention_layer_norm": _scale(state, f"{block}.0.layer_norm", config),
                "attention": _attention(state, f"{block}.0.SelfAttention", config),
                "pre_mlp_layer_norm": _scale(state, f"{block}.1.layer_norm", config),
            }
        else:
            tree[f"layers_{i}"] = {
                "pre_self_attention_layer_norm": _scale(state, f"{block}.0.layer_norm", config),
                "self_attention": _attention(state, f"{block}.0.SelfAttention", config),
                "pre_cross_attention_layer_norm": _scale(state, f"{block}.1.layer_norm", config),
                "encoder_decoder_attention": _attention(
                    state, f"{block}.1.EncDecAttention", config
                ),
                "pre_mlp_layer_norm": _scale(state, f"{block}.2.layer_norm", config),
            }
        tree[f"layers_{i}"]["mlp"] = _mlp(state, stack, i, config, experts)
    return tree


def hf_to_t5x(state: Mapping[str, np.ndarray], config: SwitchConfig, experts: bool = True) -> dict:
    """The T5X parameter tree of an HF SwitchTransformers state dict (HF name -> array), dtypes
    kept.

    Args:
      experts: also map the expert weights to ``expert/{wi,wo}/kernel [E, in, out]``;
        False leaves them out (the dense part of a compressed checkpoint).

    Raises:
      HFNamesError: a parameter is missing or has the wrong shape, or the
        encoder's or decoder's input embedding differs from ``shared`` (T5X has
        one token embedder).
    """
    embedding = np.asarray(_get(state, "shared.weight", (config.vocab_size, config.d_model)))
    for name in ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight"):
        if name in state and not np.array_equal(np.asarray(state[name]), embedding):
            raise HFNamesError(
                f"{name} differs from shared.weight, but a T5X SwitchTransformer has one token "
                "embedding for the encoder and the decoder"
            )
    tree = {
        "token_embedder": {"embedding": embedding},
        "encoder": _stack(state, "encoder", config, experts),
        "decoder": _stack(state, "decoder", config, experts),
    }
    if config.logits_dense:
        tree["decoder"]["logits_dense"] = _kernel(
            state, "lm_head", config.d_model, config.vocab_size
        )
    return tree
