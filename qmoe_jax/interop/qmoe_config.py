"""The model config of a published QMoE directory: its HF ``config.json`` as a ``SwitchConfig``.

HF's ``SwitchTransformersConfig`` names the architecture (``d_model``, ``d_kv``,
``d_ff``, ``num_heads``, ``num_layers``, ``num_decoder_layers``, ``num_experts``,
``encoder_sparse_step`` …). Block i of a stack is sparse in HF when
``i % step == 1 or step == 1``; the QMoE authors' loader makes every block
sparse when ``is_full_sparse`` is present (switch-c-2048), whatever its value.
Routing settings that HF does not describe the T5X way (capacity factors,
group size) come from the registered config of the same model
(``models.get_config``), which is found by the name in ``_name_or_path`` or by
(d_model, num_experts); every architecture field on which ``config.json``
and that config disagree is reported, and ``config.json`` wins.
"""

from __future__ import annotations

import dataclasses
import json
import os

from qmoe_jax.models import SwitchConfig, config_names, get_config

ACTIVATIONS = {"relu": "relu", "gelu_new": "gelu", "gelu_pytorch_tanh": "gelu"}
ARCHITECTURE = (
    "vocab_size",
    "d_model",
    "num_heads",
    "d_kv",
    "d_ff",
    "num_encoder_layers",
    "num_decoder_layers",
    "num_experts",
    "num_encoder_sparse_layers",
    "num_decoder_sparse_layers",
    "mlp_activations",
    "logits_dense",
    "relative_attention_num_buckets",
    "relative_attention_max_distance",
    "layer_norm_epsilon",
)


class QMoEConfigError(ValueError):
    """A config.json that does not describe a SwitchTransformer qmoe_jax can run."""


def _hf_sparse_layers(values: dict, layers: int, step_key: str, count_key: str) -> list[int]:
    if "is_full_sparse" in values:
        return list(range(layers))
    step = values.get(step_key)
    if step is None:  # older configs: derived as HF's __init__ derives it
        count = values.get(count_key, 0)
        step = layers // count if count else layers
    return [i for i in range(layers) if step > 0 and (i % step == 1 or step == 1)]


def _sparse_count(layers: int, sparse: list[int], stack: str, path: str) -> int:
    """NS such that T5X's layout (block i sparse when i % (L/NS) == L/NS - 1) gives exactly
    ``sparse``."""
    for count in range(1, layers + 1):
        period = layers // count
        if layers % count == 0 and [i for i in range(layers) if i % period == period - 1] == sparse:
            return count
    if not sparse:
        return 0
    raise QMoEConfigError(
        f"{path}: the {stack}'s sparse blocks {sparse} do not follow T5X's layout (block i "
        "sparse when i % (L/NS) == L/NS - 1), which qmoe_jax's model uses"
    )


def _registered(values: dict) -> SwitchConfig | None:
    name = os.path.basename(str(values.get("_name_or_path", "")).rstrip("/"))
    for candidate in (name, name.removesuffix("_qmoe")):
        if candidate in config_names():
            return get_config(candidate)
    shape = (values.get("d_model"), values.get("num_experts"))
    matches = [
        get_config(n)
        for n in config_names()
        if (get_config(n).d_model, get_config(n).num_experts) == shape
    ]
    return matches[0] if len(matches) == 1 else None


def read_qmoe_config(path: str) -> tuple[SwitchConfig, list[str]]:
    """The ``SwitchConfig`` of a published QMoE ``config.json`` and the fields on which the
    registered config of the same model disagrees with it (one phrase each; empty when they agree or
    none is registered).

    Raises:
      QMoEConfigError: unreadable JSON, a missing field, a gated or unknown
        activation, or a layout of sparse blocks our model cannot express.
    """
    try:
        with open(path) as f:
            values = json.load(f)
    except ValueError as error:
        raise QMoEConfigError(f"{path} is not valid JSON ({error})") from None
    if not isinstance(values, dict):
        raise QMoEConfigError(f"{path} holds a JSON {type(values).__name__}, not a config object")
    if values.get("model_type", "switch_transformers") != "switch_transformers":
        raise QMoEConfigError(
            f"{path} describes a {values['model_type']!r} model, not switch_transformers"
        )
    missing = [
        key
        for key in (
            "vocab_size",
            "d_model",
            "d_kv",
            "d_ff",
            "num_heads",
            "num_layers",
            "num_experts",
        )
        if key not in values
    ]
    if missing:
        raise QMoEConfigError(
            f"{path} lacks {', '.join(missing)}, which a SwitchTransformersConfig has"
        )
    if values.get("is_gated_act"):
        raise QMoEConfigError(
            f"{path} asks for a gated activation, which the published QMoE models do not use "
            "and this importer does not map"
        )
    activation = values.get("dense_act_fn", "relu")
    if activation not in ACTIVATIONS:
        raise QMoEConfigError(
            f"{path}: activation {activation!r} is not one of {', '.join(ACTIVATIONS)}"
        )
    encoder_layers = values["num_layers"]
    decoder_layers = values.get("num_decoder_layers") or encoder_layers
    architecture = {
        "vocab_size": values["vocab_size"],
        "d_model": values["d_model"],
        "num_heads": values["num_heads"],
        "d_kv": values["d_kv"],
        "d_ff": values["d_ff"],
        "num_encoder_layers": encoder_layers,
        "num_decoder_layers": decoder_layers,
        "num_experts": values["num_experts"],
        "num_encoder_sparse_layers": _sparse_count(
            encoder_layers,
            _hf_sparse_layers(
                values, encoder_layers, "encoder_sparse_step", "num_sparse_encoder_layers"
            ),
            "encoder",
            path,
        ),
        "num_decoder_sparse_layers": _sparse_count(
            decoder_layers,
            _hf_sparse_layers(
                values, decoder_layers, "decoder_sparse_step", "num_sparse_decoder_layers"
            ),
            "decoder",
            path,
        ),
        "mlp_activations": (ACTIVATIONS[activation],),
        "logits_dense": not values.get("tie_word_embeddings", True),
        "relative_attention_num_buckets": values.get("relative_attention_num_buckets", 32),
        "relative_attention_max_distance": values.get("relative_attention_max_distance", 128),
        "layer_norm_epsilon": values.get("layer_norm_epsilon", 1e-6),
    }
    registered = _registered(values)
    if registered is None:
        name = (
            os.path.basename(os.path.dirname(os.path.abspath(path))).removesuffix("_qmoe")
            or "qmoe-import"
        )
        return SwitchConfig(name=name, dropout_rate=0.0, **architecture), []
    differences = [
        f"{key}: config.json {architecture[key]}, get_config({registered.name!r}) "
        f"{getattr(registered, key)}"
        for key in ARCHITECTURE
        if architecture[key] != getattr(registered, key)
    ]
    config = dataclasses.replace(
        registered, dropout_rate=0.0, checkpoint_path=None, checkpoint_step=None, **architecture
    )
    return config, differences
