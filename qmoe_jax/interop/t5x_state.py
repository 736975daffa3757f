"""Reading a T5X checkpoint of a compressed model (written by ``t5x.train`` with
``configs/t5x/compressed_train.gin``) as qmoe_jax parameters.

Such a ``checkpoint_<step>/`` holds T5X's Orbax ``state/``: ``target`` (every
non-expert parameter, as fine-tuned) and ``flax_mutables.qmoe_experts`` (the
codes, ``<layer>/<kernel>/{codes, row_offsets, minmax}``), and qmoe_jax's
``qmoe_jax/`` folder (``t5x_layout``): the layout, the model config, the grid,
the SHA-256 of every code array as saved, and the dictionaries. This module reads
the parameters with tensorstore (no T5X import), verifies the codes' checksums,
and returns the ``CompressedModel`` that ``inference.open_model`` gives for a
compressed directory: the experts as ``CompressedExperts`` (fused kernels) or
dequantized (``experts="dense"``).
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import tensorstore as ts

from qmoe_jax.checkpoints import open_t5x_checkpoint
from qmoe_jax.checkpoints.compressed_trees import array_checksum
from qmoe_jax.checkpoints.format_v1 import CompressedCheckpointError
from qmoe_jax.checkpoints.layer_arrays import compressed_stack
from qmoe_jax.checkpoints.storage import location, open_zarrs
from qmoe_jax.checkpoints.t5x_orbax import METADATA_FILE, STATE_DIR
from qmoe_jax.inference.compressed_params import CompressedModel, dequantized_kernel, placed_model
from qmoe_jax.interop.t5x_layout import ARRAYS, COLLECTION, CompressedLayout, read_layout
from qmoe_jax.models import SwitchConfig
from qmoe_jax.quant import GridConfig


def _read_codes(path: str, layout: CompressedLayout) -> dict[tuple[str, str, str], np.ndarray]:
    """``{(layer, kernel, array): array}`` from ``state/``'s ``flax_mutables.qmoe_experts``."""
    state = os.path.join(path, STATE_DIR)
    metadata_file = os.path.join(state, METADATA_FILE)
    if not os.path.isfile(metadata_file):
        raise CompressedCheckpointError(
            f"{path} has qmoe_jax/ but no Orbax {STATE_DIR}/{METADATA_FILE}; T5X's legacy "
            "checkpoints cannot hold the codes (uint16): train with T5X's Orbax checkpoints"
        )
    with open(metadata_file) as f:
        metadata = json.load(f)
    wanted = {
        (name, kernel, array): ".".join(
            ("flax_mutables", COLLECTION, *name.split("."), kernel, array)
        )
        for name, layer in layout.layers.items()
        for kernel in layer.kernel_names()
        for array in ARRAYS
    }
    use_ocdbt = bool(metadata.get("use_ocdbt", True))
    base = location(state)
    arrays = {
        key: {"driver": "ocdbt", "base": base, "path": stored + "/"}
        if use_ocdbt
        else location(os.path.join(state, stored))
        for key, stored in wanted.items()
    }
    stores = open_zarrs(
        {"/".join(key): spec for key, spec in arrays.items()},
        ts.Context(),
        where=path,
        zarr3=bool(metadata.get("use_zarr3", False)),
        all_chunks_stored=bool(metadata.get("store_array_data_equal_to_fill_value", False)),
    )
    codes = {key: np.asarray(stores["/".join(key)].read().result()) for key in wanted}
    for (name, kernel, array_name), array in codes.items():
        key = "/".join((*name.split("."), kernel, array_name))
        expected = layout.checksums.get(key)
        if expected is None or array_checksum(array) != expected:
            raise CompressedCheckpointError(
                f"{path}: the codes {key} do not match the checksum recorded in "
                f"qmoe_jax/ when T5X saved them (the checkpoint is damaged)"
            )
    return codes


def load_t5x_compressed_model(
    path: str,
    experts: str = "compressed",
    dtype=jnp.float32,
    mesh: jax.sharding.Mesh | None = None,
) -> CompressedModel:
    """The compressed model in a T5X ``checkpoint_<step>/`` with ``qmoe_jax/``.

    Args and result as ``inference.compressed_params.load_compressed_model``.
    """
    if experts not in ("dense", "compressed"):
        raise ValueError(f"experts must be 'dense' or 'compressed', got {experts!r}")
    layout = read_layout(path)
    config = dataclasses.replace(SwitchConfig(**layout.model), dtype=jnp.dtype(dtype).name)
    grid = GridConfig(**layout.grid)
    checkpoint = open_t5x_checkpoint(path)
    params = jax.tree.map(
        lambda x: jnp.asarray(x, dtype), checkpoint.read_params(checkpoint.keys())
    )
    codes = _read_codes(path, layout)
    dictionaries = {}
    for name, layer in layout.layers.items():
        dictionary = layout.dictionary(layer.dictionary)
        dictionaries[name] = dictionary
        node = params
        for key in name.split("."):
            node = node.setdefault(key, {})
        expert = node.setdefault("expert", {})
        for kernel, shape in layer.kernels:
            arrays = {array: codes[(name, kernel, array)] for array in ARRAYS}
            if experts == "dense":
                expert[kernel] = {
                    "kernel": jnp.asarray(
                        dequantized_kernel(arrays, grid, shape.cols, dictionary), dtype
                    )
                }
            else:
                expert[kernel] = jax.tree.map(jnp.asarray, compressed_stack(arrays, shape.cols))
    return placed_model(config, params, dictionaries, grid, experts, mesh)
