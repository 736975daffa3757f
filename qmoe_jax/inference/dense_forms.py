"""How a loaded model stores its dense (non-expert) parameters: ``--dense_dtype``.

- "float32": every parameter in the model's dtype (float32 unless asked otherwise), as T5X
  computes;
- "bfloat16": the kernels of attention and of the dense MLPs, the untied logits kernel and the
  token embedding stored as bfloat16 (lossless where the checkpoint holds bfloat16, as the
  released Switch checkpoints and compressed directories do);
- "int8": the same matrices as int8 codes with one float32 scale per output channel
  (``quant.int8``), a quarter of float32's bytes.

A packed matrix is held in y = W·x orientation (``kernels.dense.PackedMatrix``), so a T5X kernel
[in, out] is stored transposed and the embedding [V, d] as it is; the model multiplies it in
float32 without a float32 copy (``kernels.dense.matmul``). Layer-norm scales, relative position
tables and router kernels stay in the model's dtype: they are small, and routing decisions are
sensitive to the router's weights. Expert kernels are never touched here: their form is
``--experts``'. The packed forms are for inference (no gradients through them).

In a packed tree each self-attention's query, key and value kernels are one matrix, ``qkv``
(their rows stacked): the three products share their input, and one product of 3·h·k rows
reads its bytes faster than three small ones (docs/dense_forms.md). Cross-attention keeps them
apart: its query reads the decoder, its key and value the encoder.

docs/dense_forms.md has the bytes a decoded token reads in each form, speeds and quality.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from qmoe_jax.kernels.dense import FORMS, PackedMatrix, pack, stack_rows

DENSE_DTYPES = ("float32",) + FORMS
EMBEDDING = ("token_embedder", "embedding")
# The attention modules whose query, key and value read one input (models/switch.py).
SELF_ATTENTION = ("attention", "self_attention")
QKV = ("query", "key", "value")


def packed_orientation(path: tuple[str, ...]) -> str | None:
    """How the leaf at ``path`` (keys from the tree's root) is packed: "transpose" for a dense
    kernel [in, out], "as_is" for the token embedding [V, d], None when it is not packed."""
    if tuple(path) == EMBEDDING:
        return "as_is"
    if path and path[-1] == "kernel" and "expert" not in path and "router" not in path:
        return "transpose"
    return None


def pack_dense_params(
    params: dict,
    dense_dtype: str,
    dtype=jnp.float32,
    release_source: bool = False,
    fuse_self_attention: bool = True,
) -> dict:
    """The tree ``params`` (nested dicts of arrays, numpy or jax) with the dense matrices stored as
    ``dense_dtype`` and every other leaf, expert kernels included, as ``dtype``.

    With ``release_source``, ``params`` is emptied as it is converted: each source leaf is dropped
    once its converted form exists, so that the peak is the converted tree plus the part of the
    source not yet converted (and one matrix in float32 while int8 quantizes it), not both whole
    trees. The loaders pass the tree they just read this way.

    ``fuse_self_attention`` stacks each self-attention's packed query, key and value kernels into
    one ``qkv`` matrix (``fuse_qkv``); False keeps them apart (for comparisons).
    """
    if dense_dtype not in DENSE_DTYPES:
        raise ValueError(
            f"unknown dense dtype {dense_dtype!r}; choose one of {', '.join(DENSE_DTYPES)}"
        )

    def convert(node, path):
        if isinstance(node, Mapping) and not isinstance(node, dict):
            node = dict(node)  # a mapping of another type is copied, never emptied
        if isinstance(node, dict):
            converted = {}
            for key in list(node):
                value = node.pop(key) if release_source else node[key]
                converted[key] = convert(value, (*path, key))
            if fuse_self_attention and path and path[-1] in SELF_ATTENTION:
                converted = fuse_qkv(converted)
            return converted
        orientation = packed_orientation(path) if dense_dtype != "float32" else None
        if orientation is None:
            return jnp.asarray(node, dtype)
        matrix = np.asarray(node) if orientation == "as_is" else np.asarray(node).T
        return pack(matrix, dense_dtype)

    return convert(params, ())


def fuse_qkv(attention: dict) -> dict:
    """A self-attention's converted parameters with packed ``query``, ``key`` and ``value``
    kernels replaced by ``qkv``: one ``PackedMatrix`` of their rows stacked in that order (the
    layer splits its product back into three). Any other tree is returned as it is."""
    kernels = [attention.get(name) for name in QKV]
    if not all(isinstance(k, Mapping) and set(k) == {"kernel"} for k in kernels):
        return attention
    matrices = [k["kernel"] for k in kernels]
    if not all(isinstance(m, PackedMatrix) for m in matrices):
        return attention
    if len({(m.form, m.cols) for m in matrices}) != 1:
        return attention
    fused = {k: v for k, v in attention.items() if k not in QKV}
    fused["qkv"] = {"kernel": stack_rows(matrices)}
    return fused


def dense_bytes(params) -> int:
    """Bytes of a parameter tree's arrays as stored (a packed matrix counts its values and
    scales)."""
    leaves = jax.tree.leaves(params, is_leaf=lambda leaf: isinstance(leaf, PackedMatrix))
    return sum(int(leaf.nbytes) for leaf in leaves)
