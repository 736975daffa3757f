"""Opening checkpoints for inference: parameters as a model applies them.

``open_model`` takes a T5X checkpoint (legacy or Orbax), a qmoe_jax
compressed directory (recognized by its ``manifest.json``) or a mapped one
(``python -m qmoe_jax.convert --layout mmap``) and returns the model with its
parameters, the experts in the form asked for.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np

from qmoe_jax.checkpoints import (
    ShapeMismatchError,
    T5XCheckpoint,
    open_t5x_checkpoint,
    path_shapes,
)
from qmoe_jax.checkpoints.format_v1 import MANIFEST
from qmoe_jax.checkpoints.mapped_layout import CONVERT, is_mapped_checkpoint
from qmoe_jax.cli import finite_float
from qmoe_jax.data import bundled
from qmoe_jax.inference.compressed_params import load_compressed_model
from qmoe_jax.inference.dense_forms import DENSE_DTYPES, pack_dense_params
from qmoe_jax.inference.mapped_params import (
    DEFAULT_EXPERT_CACHE_GB,
    VERIFY_MODES,
    ExpertResidency,
    load_mapped_model,
)
from qmoe_jax.inference.model_directory import refuse_non_model
from qmoe_jax.interop.t5x_layout import has_sidecar
from qmoe_jax.malloc import release_free_memory, release_free_memory_after_compiles
from qmoe_jax.models import SwitchConfig, SwitchTransformer, config_names, get_config, param_shapes


def load_t5x_params(
    path: str | T5XCheckpoint, config: SwitchConfig, dtype=jnp.float32, dense_dtype="float32"
) -> dict:
    """All parameters of a T5X checkpoint, shape-checked against ``config``, cast to ``dtype``
    (the dense matrices stored as ``dense_dtype``, ``inference.dense_forms``)."""
    checkpoint = open_t5x_checkpoint(path) if isinstance(path, str) else path
    check_config(checkpoint, config)
    params = checkpoint.read_params(checkpoint.keys())
    return pack_dense_params(params, dense_dtype, dtype, release_source=True)


def _layer_count(paths, stack: str) -> int:
    return len({path.split("/")[1] for path in paths if path.startswith(f"{stack}/layers_")})


def _may_fit(config: SwitchConfig, found: dict[str, tuple]) -> bool:
    """Whether ``config`` passes checks that are necessary for it to fit shapes ``found`` and cost
    nothing: the embedding's shape and the depth of each stack. What passes is then compared in
    full (``_registered_shapes``)."""
    return (
        found.get("token_embedder/embedding") == (config.vocab_size, config.d_model)
        and _layer_count(found, "encoder") == config.num_encoder_layers
        and _layer_count(found, "decoder") == config.num_decoder_layers
    )


@functools.cache
def _registered_shapes(name: str) -> dict:
    """The parameter shapes of the registered config ``name``, traced once per process: tracing a
    model's ``init`` costs about a second, and the registry is fixed at import."""
    return path_shapes(param_shapes(get_config(name)))


def fitting_configs(checkpoint: T5XCheckpoint) -> list[str]:
    """The registered configs whose parameter shapes the checkpoint has."""
    found = {path: info.shape for path, info in checkpoint.spec().items()}
    return [
        name
        for name in config_names()
        if _may_fit(get_config(name), found) and _registered_shapes(name) == found
    ]


def check_config(checkpoint: T5XCheckpoint, config: SwitchConfig) -> None:
    """Raises ``ShapeMismatchError``, in one line that names the registered config that fits the
    checkpoint (if one does), unless the checkpoint holds exactly ``config``'s shapes."""
    try:
        checkpoint.check_shapes(path_shapes(param_shapes(config)), config_name=config.name)
    except ShapeMismatchError as error:
        fits = fitting_configs(checkpoint)
        if len(fits) == 1:
            advice = (
                f"its shapes fit the config {fits[0]}: pass --config {fits[0]}, or leave --config "
                "out to infer it"
            )
        elif fits:
            advice = f"its shapes fit the configs {', '.join(fits)}: pass one with --config"
        else:
            advice = "no registered config fits its shapes"
        raise ShapeMismatchError(f"{error}; {advice}") from None


def infer_config(checkpoint: T5XCheckpoint) -> SwitchConfig:
    """The one registered config whose parameter shapes the checkpoint has."""
    matches = fitting_configs(checkpoint)
    if len(matches) != 1:
        raise ValueError(
            f"cannot infer the model config of {checkpoint.url}: {len(matches)} known configs "
            "match its shapes "
            f"({', '.join(matches) or 'none'}); pass --config (known: {', '.join(config_names())})"
        )
    return get_config(matches[0])


@dataclasses.dataclass
class OpenedModel:
    """A model ready to ``module.apply({"params": params}, ...)``.

    Attributes:
      kind: "t5x", "compressed" or "mapped"; experts: "dense", "compressed" (fused kernels) or
        "mapped" (fused kernels on memory-mapped stacks).
      mesh: the expert-parallel mesh (axis ``expert``), or None.
      residency: mapped experts only: their verification, read-ahead and budget
        (``inference.mapped_params``).
    """

    config: SwitchConfig
    module: SwitchTransformer
    params: dict
    kind: str
    experts: str
    mesh: jax.sharding.Mesh | None = None
    residency: ExpertResidency | None = None


def is_compressed_checkpoint(path: str) -> bool:
    return os.path.isfile(os.path.join(path, MANIFEST))


EXPERT_PARALLEL = ("auto", "on", "off")


def open_model(
    path: str,
    config: SwitchConfig | None = None,
    experts: str | None = None,
    dtype=jnp.float32,
    expert_parallel: str = "auto",
    verify: str = "lazy",
    expert_cache_gb: float = DEFAULT_EXPERT_CACHE_GB,
    dense_dtype: str = "float32",
) -> OpenedModel:
    """Opens a T5X checkpoint or a compressed directory for inference.

    Args:
      config: the model config of a T5X checkpoint (None: inferred from its
        shapes); a compressed directory carries its own.
      experts: "compressed" (fused kernels; the default for compressed
        directories), "dense" (dequantized; the only form of a T5X checkpoint)
        or "mapped" (fused kernels on memory-mapped stacks; the only form of a
        mapped directory, docs/format.md §9).
      dtype: of the parameters and the activations (float32 or bfloat16).
      expert_parallel: compressed experts only: "on" shards every expert stack
        over all devices (mesh axis ``expert``; with ``jax.distributed``, the
        devices of every host), so that each device multiplies the tokens
        routed to its own experts; "auto" does so when there is more than one
        device; "off" runs every expert on one device.
      verify, expert_cache_gb: mapped directories only
        (``inference.mapped_params.load_mapped_model``).
      dense_dtype: storage of the dense (non-expert) matrices and the embedding: "float32" (in
        ``dtype``), "bfloat16" or "int8" (``inference.dense_forms``).

    The memory the loading freed (restored checkpoint arrays, their conversions) is returned to
    the system before the model is returned (``malloc.release_free_memory``), and from then on
    the memory each XLA compilation frees, before the compiled program first runs
    (``malloc.release_free_memory_after_compiles``).
    """
    opened = _open_model(
        path, config, experts, dtype, expert_parallel, verify, expert_cache_gb, dense_dtype
    )
    release_free_memory()
    release_free_memory_after_compiles()
    return opened


def _open_model(
    path, config, experts, dtype, expert_parallel, verify, expert_cache_gb, dense_dtype
) -> OpenedModel:
    if dense_dtype not in DENSE_DTYPES:
        raise ValueError(
            f"dense_dtype must be one of {', '.join(DENSE_DTYPES)}, got {dense_dtype!r}"
        )
    if expert_parallel not in EXPERT_PARALLEL:
        raise ValueError(
            f"expert_parallel must be one of {', '.join(EXPERT_PARALLEL)}, got {expert_parallel!r}"
        )
    if is_mapped_checkpoint(path):
        if experts not in (None, "mapped"):
            raise ValueError(
                f"{path} is a mapped checkpoint, whose experts are mapped; for --experts {experts} "
                "use the compressed checkpoint it was converted from"
            )
        if expert_parallel == "on":
            raise ValueError("mapped experts run on one CPU device; drop --expert_parallel on")
        mapped = load_mapped_model(path, verify, expert_cache_gb, dtype, dense_dtype=dense_dtype)
        return OpenedModel(
            mapped.config,
            mapped.module(),
            mapped.params,
            "mapped",
            "mapped",
            residency=mapped.residency,
        )
    refuse_non_model(path)
    if experts == "mapped":
        raise ValueError(
            f"--experts mapped needs a mapped checkpoint, and {path} is not one; convert a "
            "compressed "
            f"checkpoint once with `{CONVERT} --checkpoint <compressed> --output_dir <new "
            "directory>`"
        )
    if is_compressed_checkpoint(path):
        parallel = expert_parallel == "on" or (expert_parallel == "auto" and jax.device_count() > 1)
        mesh = jax.sharding.Mesh(np.asarray(jax.devices()), ("expert",)) if parallel else None
        loaded = load_compressed_model(
            path, experts=experts or "compressed", dtype=dtype, mesh=mesh, dense_dtype=dense_dtype
        )
        return OpenedModel(
            loaded.config, loaded.module(), loaded.params, "compressed", loaded.experts, loaded.mesh
        )
    if has_sidecar(path):  # T5X's checkpoint of a compressed model (t5x.train, docs/gin.md §8)
        from qmoe_jax.interop.t5x_state import load_t5x_compressed_model

        parallel = expert_parallel == "on" or (expert_parallel == "auto" and jax.device_count() > 1)
        mesh = jax.sharding.Mesh(np.asarray(jax.devices()), ("expert",)) if parallel else None
        loaded = load_t5x_compressed_model(path, experts or "compressed", dtype, mesh)
        return OpenedModel(
            loaded.config, loaded.module(), loaded.params, "compressed", loaded.experts, loaded.mesh
        )
    if experts not in (None, "dense"):
        raise ValueError(
            f"{path} is a T5X checkpoint, whose experts are dense; --experts compressed needs a "
            "directory written by `python -m qmoe_jax.compress`"
        )
    checkpoint = open_t5x_checkpoint(path)
    config = dataclasses.replace(config or infer_config(checkpoint), dtype=jnp.dtype(dtype).name)
    return OpenedModel(
        config,
        SwitchTransformer(config),
        load_t5x_params(checkpoint, config, dtype, dense_dtype),
        "t5x",
        "dense",
    )


def add_model_arguments(parser) -> None:
    """The flags that choose a model, shared by the commands that open one
    (``open_model_from_args``)."""
    parser.add_argument(
        "--checkpoint",
        help="T5X checkpoint_<step> directory or URL, or a directory written by "
        "python -m qmoe_jax.compress (default: the bundled model)",
    )
    parser.add_argument(
        "--config",
        choices=config_names(),
        metavar="CONFIG",
        help="model config name of a T5X checkpoint (default: inferred from its shapes)",
    )
    parser.add_argument(
        "--experts",
        choices=["compressed", "dense", "mapped"],
        help="compressed checkpoints: fused kernels (compressed, the default) "
        "or dequantized (dense); "
        "mapped checkpoints (python -m qmoe_jax.convert --layout mmap): mapped, expert codes "
        "read from disk when routed tokens touch them",
    )
    parser.add_argument(
        "--expert_parallel",
        choices=EXPERT_PARALLEL,
        default="auto",
        help="shard compressed experts over all devices (auto: when there are several)",
    )
    parser.add_argument(
        "--verify",
        choices=VERIFY_MODES,
        default="lazy",
        help="mapped experts: check each expert's SHA-256 when it is first routed "
        "(lazy, the default) "
        "or every expert at open (full)",
    )
    parser.add_argument(
        "--expert_cache_gb",
        type=finite_float,
        default=DEFAULT_EXPERT_CACHE_GB,
        help="mapped experts: mapped expert pages kept resident at most, in GiB (default: "
        f"{DEFAULT_EXPERT_CACHE_GB:g}); the least recently routed are released first",
    )
    parser.add_argument(
        "--dense_dtype",
        choices=DENSE_DTYPES,
        default="float32",
        help="storage of the dense (non-expert) matrices and the embedding: float32 (default), "
        "bfloat16, or int8 with one scale per output channel; products stay float32 "
        "(docs/dense_forms.md)",
    )
    parser.add_argument("--tokenizer", help="SentencePiece model (default: the bundled model's)")


def open_model_from_args(args) -> OpenedModel:
    """``open_model`` with the flags of ``add_model_arguments`` (default checkpoint: the bundled
    model)."""
    return open_model(
        args.checkpoint or bundled.checkpoint_path(),
        get_config(args.config) if args.config else None,
        args.experts,
        expert_parallel=args.expert_parallel,
        verify=getattr(args, "verify", "lazy"),
        expert_cache_gb=getattr(args, "expert_cache_gb", DEFAULT_EXPERT_CACHE_GB),
        dense_dtype=getattr(args, "dense_dtype", "float32"),
    )
