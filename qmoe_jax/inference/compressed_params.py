"""Loading a compressed checkpoint (docs/format.md §8) as model parameters.

Two forms of the expert kernels:
- "dense": dequantized to T5X's ``expert/<kernel>/kernel [E, in, out]``, for the
  plain ``MlpExperts`` layer (quality evaluation, reference numerics);
- "compressed": ternary ``CompressedExperts`` stacks W[E, out, in] at
  ``expert/<kernel>``, for the fused-kernel expert layer.

A fine-tuned checkpoint may carry expert LoRA adapters (docs/format.md §8.9):
the compressed form puts them at ``expert/lora/<kernel>``, the dense form folds
them into the dequantized kernel.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from qmoe_jax.checkpoints.format_v1 import CompressedCheckpoint, CompressedCheckpointError
from qmoe_jax.checkpoints.layer_arrays import check_kernel_arrays, compressed_stack, kernel_cols
from qmoe_jax.codec import CompressedExperts, Dictionary, decode_codes
from qmoe_jax.inference.dense_forms import pack_dense_params
from qmoe_jax.models import SwitchConfig, SwitchTransformer
from qmoe_jax.models.compressed_experts import compressed_experts_cls
from qmoe_jax.models.lora import LORA, merged_kernel
from qmoe_jax.quant import GridConfig, dequantize_codes


@dataclasses.dataclass
class CompressedModel:
    """A loaded compressed checkpoint.

    Attributes:
      config: the model config.
      params: the parameter tree (expert kernels in the requested form).
      dictionaries: ``{layer name: Dictionary}`` of ternary layers.
      grid: the grid the experts were quantized to.
      experts: "dense" or "compressed".
      mesh: the mesh whose ``expert`` axis the compressed stacks are sharded
        over (expert parallelism), or None.
    """

    config: SwitchConfig
    params: dict
    dictionaries: dict[str, Dictionary]
    grid: GridConfig
    experts: str = "dense"

    mesh: jax.sharding.Mesh | None = None

    def module(self) -> SwitchTransformer:
        """The model to ``apply`` with ``{"params": self.params}``."""
        if self.experts == "dense":
            return SwitchTransformer(self.config)
        return SwitchTransformer(
            self.config, experts_cls=compressed_experts_cls(self.dictionaries, self.mesh)
        )


def dequantized_kernel(
    arrays: dict, grid: GridConfig, cols: int, dictionary: Dictionary | None
) -> np.ndarray:
    """T5X-oriented float32 kernel [E, in, out] of one stored expert kernel."""
    if grid.kind == "ternary":
        codes, params = (
            decode_codes(compressed_stack(arrays, cols), dictionary),
            np.asarray(arrays["minmax"]),
        )
    else:
        codes, params = np.asarray(arrays["codes"]), np.asarray(arrays["grid_params"])
    weights = np.stack(
        [
            np.asarray(dequantize_codes(jnp.asarray(c), jnp.asarray(p), grid))
            for c, p in zip(codes, params)
        ]
    )
    return np.swapaxes(weights, 1, 2)


def load_compressed_model(
    directory: str,
    experts: str = "dense",
    dtype=jnp.float32,
    mesh: jax.sharding.Mesh | None = None,
    dense_dtype: str = "float32",
) -> CompressedModel:
    """Reads a finished compressed checkpoint, verifying checksums and dictionary fingerprints.

    Args:
      experts: "dense" or "compressed" (ternary checkpoints only).
      dtype: dtype of the dense parameters, the dequantized kernels and the activations.
      mesh: with "compressed", shard every expert stack over this mesh's
        ``expert`` axis (expert parallelism; E must divide by its size); the
        dense parameters are replicated on its devices.
      dense_dtype: storage of the dense matrices ("float32": ``dtype``; "bfloat16" or "int8":
        packed, ``inference.dense_forms``).
    """
    if experts not in ("dense", "compressed"):
        raise ValueError(f"experts must be 'dense' or 'compressed', got {experts!r}")
    checkpoint = CompressedCheckpoint(directory)
    if not checkpoint.complete:
        raise CompressedCheckpointError(
            f"{directory} is unfinished ({len(checkpoint.layer_names())} layers done); "
            "re-run the same `python -m qmoe_jax.compress` command to finish it"
        )
    config = dataclasses.replace(
        SwitchConfig(**checkpoint.header["model"]), dtype=jnp.dtype(dtype).name
    )
    # Checkpoints written before the header carried "grid" kept it under "settings".
    header = checkpoint.header
    grid = GridConfig(**(header["grid"] if "grid" in header else header["settings"]["grid"]))
    if experts == "compressed" and grid.kind != "ternary":
        raise ValueError(
            f"only ternary checkpoints run on the fused kernels; {directory} uses {grid}"
        )
    params = pack_dense_params(checkpoint.dense_params(), dense_dtype, dtype, release_source=True)
    adapters = checkpoint.adapters() or {}
    dictionaries = {}
    for name in checkpoint.layer_names():
        arrays, stats = checkpoint.layer(name)
        dictionary = checkpoint.dictionary(stats["dictionary"]) if stats["dictionary"] else None
        if dictionary is not None:
            dictionaries[name] = dictionary
        node = params
        for key in name.split("."):
            node = node.setdefault(key, {})
        expert = node.setdefault("expert", {})
        for kernel, stored in arrays.items():
            check_kernel_arrays(
                stored, grid.kind == "ternary", f"{directory}/layers/{name}/{kernel}"
            )
            cols = kernel_cols(kernel, config.d_model, config.d_ff)
            adapter = adapters.get(name, {}).get(kernel)
            if experts == "dense":
                dense = dequantized_kernel(stored, grid, cols, dictionary)
                dense = dense if adapter is None else merged_kernel(dense, adapter)
                expert[kernel] = {"kernel": jnp.asarray(dense, dtype)}
            else:
                expert[kernel] = jax.tree.map(jnp.asarray, compressed_stack(stored, cols))
                if adapter is not None:
                    expert.setdefault(LORA, {})[kernel] = _cast(adapter, dtype)
    return placed_model(config, params, dictionaries, grid, experts, mesh)


def placed_model(config, params, dictionaries, grid, experts: str, mesh) -> CompressedModel:
    """The loaded model, on ``mesh`` when one is given and the experts are compressed: each
    ``CompressedExperts`` stack split over the mesh's "expert" axis, everything else replicated."""
    if mesh is None or experts == "dense":
        return CompressedModel(config, params, dictionaries, grid, experts)
    if config.num_experts % mesh.shape["expert"]:
        raise ValueError(
            f"{config.num_experts} experts per layer cannot be split evenly over "
            f"{mesh.shape['expert']} devices; use a device count that divides {config.num_experts}"
        )
    by_expert = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("expert"))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    placement = jax.tree.map(
        lambda leaf: by_expert if isinstance(leaf, CompressedExperts) else replicated,
        params,
        is_leaf=lambda leaf: isinstance(leaf, CompressedExperts),
    )
    return CompressedModel(
        config, jax.device_put(params, placement), dictionaries, grid, experts, mesh
    )


def _cast(tree, dtype):
    if isinstance(tree, dict):
        return {key: _cast(value, dtype) for key, value in tree.items()}
    return jnp.asarray(tree, dtype)
