"""Directories in the QMoE authors' published layout, made by the tests (docs/qmoe_import.md §2).

The packer follows the authors' ``Sub1Linear.make`` and ``sub1pack``: per row,
(min, max) of the ternary weights in bfloat16, interleaved; code 1 where a
weight equals the row min, then code 2 where it equals the row max (so a row
without negative weights has min 0 and its zeros get code 1); pair symbols
``w[i] + 3·w[i+1]`` walked greedily down the dictionary trie, emitting the
current entry whenever the next pair has no child; one ``row_off`` per linear
from 0; ``w_comp`` int16. Their dictionary is our p0 = 0.885 dictionary.

``.pt`` files are written with ``torch.save`` when torch is present, or by
``save_pt``, which writes the same zip and pickle structure without torch.
"""

from __future__ import annotations

import collections
import io
import json
import os
import pickle
import zipfile

import ml_dtypes
import numpy as np

from qmoe_jax.checkpoints import hf_names
from qmoe_jax.codec import DEFAULT_P0, build_dictionary
from qmoe_jax.codec.dictionary import entry_weights

BF16 = np.dtype(ml_dtypes.bfloat16)


# ---- a .pt writer without torch -------------------------------------------------------------


class Global:
    """A global the pickle names by module and name (GLOBAL opcode), without importing it."""

    def __init__(self, module: str, name: str):
        self.module, self.name = module, name

    def __call__(self, *args):  # pickle requires reduce functions to be callable; never called here
        raise TypeError(f"{self.module}.{self.name} is only a name in a pickle")


class Call:
    """Pickles as ``func(*args)`` (REDUCE)."""

    def __init__(self, func: Global, args: tuple):
        self.func, self.args = func, args

    def __reduce__(self):
        return self.func, self.args


REBUILD = Global("torch._utils", "_rebuild_tensor_v2")
STORAGE_NAMES = {
    np.dtype(np.float32): "FloatStorage",
    BF16: "BFloat16Storage",
    np.dtype(np.int16): "ShortStorage",
    np.dtype(np.int32): "IntStorage",
    np.dtype(np.int64): "LongStorage",
}


class _Storage:
    def __init__(self, key: str, array: np.ndarray):
        self.key, self.array = key, array


class _Tensor:
    def __init__(self, storage: _Storage):
        self.storage = storage

    def __reduce__(self):
        array = self.storage.array
        strides = tuple(s // array.itemsize for s in array.strides)
        return REBUILD, (
            self.storage,
            0,
            tuple(array.shape),
            strides,
            False,
            collections.OrderedDict(),
        )


class _Pickler(pickle._Pickler):
    dispatch = pickle._Pickler.dispatch.copy()

    def save_named_global(self, obj: Global) -> None:
        self.write(pickle.GLOBAL + f"{obj.module}\n{obj.name}\n".encode())
        self.memoize(obj)

    dispatch[Global] = save_named_global

    def persistent_id(self, obj):
        if isinstance(obj, _Storage):
            return (
                "storage",
                Global("torch", STORAGE_NAMES[obj.array.dtype]),
                obj.key,
                "cpu",
                obj.array.size,
            )
        return None


def _wrapped(value, storages: list):
    if isinstance(value, np.ndarray):
        storage = _Storage(str(len(storages)), np.ascontiguousarray(value))
        storages.append(storage)
        return _Tensor(storage)
    if isinstance(value, dict):
        return type(value)((k, _wrapped(v, storages)) for k, v in value.items())
    return value


def save_pt(obj, path: str) -> None:
    """Writes ``obj`` (dicts of numpy arrays and plain values) as torch.save's zip format would,
    without torch."""
    storages: list[_Storage] = []
    buffer = io.BytesIO()
    _Pickler(buffer, protocol=2).dump(_wrapped(obj, storages))
    archive = os.path.splitext(os.path.basename(path))[0]
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        z.writestr(f"{archive}/data.pkl", buffer.getvalue())
        z.writestr(f"{archive}/byteorder", "little")
        for storage in storages:
            z.writestr(f"{archive}/data/{storage.key}", storage.array.tobytes())
        z.writestr(f"{archive}/version", "3\n")


def torch_save(obj, path: str) -> None:
    """``torch.save`` of ``obj`` with its numpy arrays as torch tensors (bfloat16 included)."""
    import torch

    def convert(value):
        if isinstance(value, np.ndarray):
            if value.dtype == BF16:
                return (
                    torch.from_numpy(np.ascontiguousarray(value).view(np.int16))
                    .view(torch.bfloat16)
                    .clone()
                )
            return torch.from_numpy(np.ascontiguousarray(value)).clone()
        if isinstance(value, dict):
            return type(value)((k, convert(v)) for k, v in value.items())
        return value

    torch.save(convert(obj), path)


# ---- the authors' ternary quantizer and packer --------------------------------------------------


def ternarize(weight: np.ndarray) -> np.ndarray:
    """QMoE's ternary round-to-nearest of W[out, in] (bfloat16 values): per row {min(0, min), 0,
    max(0, max)}, x -> max where x > max/2, min where x < min/2, else 0."""
    w = weight.astype(BF16).astype(np.float32)
    low = np.minimum(w.min(axis=1, keepdims=True), 0)
    high = np.maximum(w.max(axis=1, keepdims=True), 0)
    return np.where(w > high / 2, high, 0) + np.where(w < low / 2, low, 0)


def add_edge_rows(q: np.ndarray) -> np.ndarray:
    """Rows the authors' packer treats specially: no negative weight (min 0, zeros coded 1), all
    zero, all max."""
    q = q.copy()
    q[0] = np.where(q[0] > 0, q[0], 0)
    q[0, ::5] = q[0].max() or 0.5
    q[1] = 0
    q[2] = q[0].max()
    return q


def _dictionary_index() -> dict[tuple[int, ...], int]:
    # p0 passed as the package and the ``dictionary`` fixture pass it: build_dictionary's cache
    # keys a call without arguments apart from one with p0, and a build takes seconds.
    weights, pair_count = entry_weights(build_dictionary(DEFAULT_P0).entries)
    index = {}
    for code in range(weights.shape[0]):
        w = weights[code, : 2 * pair_count[code]]
        index[tuple(int(a) + 3 * int(b) for a, b in zip(w[0::2], w[1::2]))] = code
    return index


_INDEX = None


def pack_linear(q: np.ndarray) -> dict[str, np.ndarray]:
    """The authors' ``Sub1Linear.make`` state (w_comp, row_off, ter_minmax, weight) of ternary
    W[out, in]."""
    global _INDEX
    _INDEX = _INDEX or _dictionary_index()
    w = q.astype(BF16)
    low, high = w.min(axis=1), w.max(axis=1)
    ter_minmax = np.stack([low, high], axis=1).reshape(-1)
    tern = np.zeros(w.shape, np.int64)
    tern[w == low[:, None]] = 1
    tern[w == high[:, None]] = 2
    stream, row_off = [], [0]
    for row in tern:
        node: tuple[int, ...] = ()
        for i in range(0, len(row), 2):
            pair = int(row[i]) + 3 * (int(row[i + 1]) if i + 1 < len(row) else 0)
            if node + (pair,) not in _INDEX:
                stream.append(_INDEX[node])
                node = ()
            node = node + (pair,)
        stream.append(_INDEX[node])
        row_off.append(len(stream))
    return {
        "w_comp": np.asarray(stream, np.uint16).view(np.int16),
        "row_off": np.asarray(row_off, np.int32),
        "ter_minmax": ter_minmax,
        "weight": np.zeros(0, BF16),
    }


# ---- whole directories --------------------------------------------------------------------------


def hf_config(
    vocab=164,
    d_model=32,
    heads=4,
    d_kv=8,
    d_ff=64,
    layers=2,
    experts=4,
    full_sparse=False,
    tied=True,
) -> dict:
    """A ``SwitchTransformersConfig`` dict as the authors save it (torch_dtype bfloat16)."""
    values = {
        "model_type": "switch_transformers",
        "vocab_size": vocab,
        "d_model": d_model,
        "d_kv": d_kv,
        "d_ff": d_ff,
        "num_heads": heads,
        "num_layers": layers,
        "num_decoder_layers": layers,
        "num_experts": experts,
        "num_sparse_encoder_layers": layers // 2,
        "num_sparse_decoder_layers": layers // 2,
        "encoder_sparse_step": 2,
        "decoder_sparse_step": 2,
        "expert_capacity": 4096,
        "router_jitter_noise": 0.0,
        "dropout_rate": 0.0,
        "router_dtype": "float32",
        "relative_attention_num_buckets": 32,
        "relative_attention_max_distance": 128,
        "layer_norm_epsilon": 1e-6,
        "dense_act_fn": "relu",
        "tie_word_embeddings": tied,
        "decoder_start_token_id": 0,
        "pad_token_id": 0,
        "eos_token_id": 1,
        "torch_dtype": "bfloat16",
    }
    if (
        full_sparse
    ):  # HF makes every block sparse with step 1; the authors' loader checks is_full_sparse
        values.update(
            is_full_sparse=True,
            num_sparse_encoder_layers=layers,
            num_sparse_decoder_layers=layers,
            encoder_sparse_step=1,
            decoder_sparse_step=1,
        )
    return values


def sparse_blocks(config: dict, stack: str) -> list[int]:
    layers = config["num_layers"]
    return (
        list(range(layers))
        if "is_full_sparse" in config
        else [i for i in range(layers) if i % 2 == 1]
    )


def write_qmoe_directory(
    directory, config: dict, state: dict[str, np.ndarray], use_torch: bool
) -> dict:
    """Writes config.json, noexp.pt, expNN.pt (one per sparse layer, encoder first) and sizes.pt
    from an HF state dict whose expert weights are ternary already; returns ``{expert linear: packed
    state}``."""
    os.makedirs(directory, exist_ok=True)
    save = torch_save if use_torch else save_pt
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    dense = collections.OrderedDict(
        (k, v.astype(BF16)) for k, v in state.items() if ".experts." not in k
    )
    save(dense, os.path.join(directory, "noexp.pt"))
    packed, sizes, number = {}, {}, 0
    for stack in ("encoder", "decoder"):
        for block in sparse_blocks(config, stack):
            layer = {}
            for e in range(config["num_experts"]):
                for kernel in hf_names.EXPERT_KERNELS:
                    name = f"{hf_names.expert_name(stack, block, e)}.{kernel}"
                    linear = pack_linear(state[f"{name}.weight"])
                    packed[name] = linear
                    sizes[name] = int(linear["w_comp"].size)
                    layer.update({f"{name}.{part}": value for part, value in linear.items()})
            save(layer, os.path.join(directory, f"exp{number:02d}.pt"))
            number += 1
    save(sizes, os.path.join(directory, "sizes.pt"))
    return packed


def ternary_state(state: dict[str, np.ndarray], edge_rows: bool = True) -> dict[str, np.ndarray]:
    """``state`` in bfloat16 values (as float32) with every expert weight ternarized (and, for
    expert 0's wi of each layer, the edge-case rows)."""
    out = {}
    for name, value in state.items():
        value = np.asarray(value, np.float32).astype(BF16).astype(np.float32)
        if ".experts." in name:
            value = ternarize(value)
            if edge_rows and name.endswith("expert_0.wi.weight"):
                value = add_edge_rows(value)
        out[name] = value
    return out


def t5x_to_hf(tree: dict, config) -> dict[str, np.ndarray]:
    """The inverse of ``hf_names.hf_to_t5x``: HF names of a T5X tree (kernels transposed back)."""
    state = {"shared.weight": tree["token_embedder"]["embedding"]}
    for stack in ("encoder", "decoder"):
        node = tree[stack]
        state[f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight"] = node[
            "relpos_bias"
        ]["rel_embedding"].T
        state[f"{stack}.final_layer_norm.weight"] = node[f"{stack}_norm"]["scale"]
        layers = config.num_decoder_layers if stack == "decoder" else config.num_encoder_layers
        names = (
            ("pre_attention_layer_norm", "attention", None)
            if stack == "encoder"
            else ("pre_self_attention_layer_norm", "self_attention", "encoder_decoder_attention")
        )
        for i in range(layers):
            layer, block = node[f"layers_{i}"], f"{stack}.block.{i}.layer"
            state[f"{block}.0.layer_norm.weight"] = layer[names[0]]["scale"]
            for ours, theirs in hf_names.ATTENTION:
                state[f"{block}.0.SelfAttention.{theirs}.weight"] = layer[names[1]][ours][
                    "kernel"
                ].T
                if names[2]:
                    state[f"{block}.1.EncDecAttention.{theirs}.weight"] = layer[names[2]][ours][
                        "kernel"
                    ].T
            if names[2]:
                state[f"{block}.1.layer_norm.weight"] = layer["pre_cross_attention_layer_norm"][
                    "scale"
                ]
            prefix = hf_names.mlp_name(stack, i)
            state[f"{prefix.rsplit('.', 1)[0]}.layer_norm.weight"] = layer["pre_mlp_layer_norm"][
                "scale"
            ]
            mlp = layer["mlp"]
            if "expert" in mlp:
                state[f"{prefix}.router.classifier.weight"] = mlp["router"]["router_weights"]["w"][
                    "kernel"
                ].T
                for kernel in hf_names.EXPERT_KERNELS:
                    for e, matrix in enumerate(mlp["expert"][kernel]["kernel"]):
                        state[f"{hf_names.expert_name(stack, i, e)}.{kernel}.weight"] = matrix.T
            else:
                for kernel in ("wi", "wo"):
                    state[f"{prefix}.{kernel}.weight"] = mlp[kernel]["kernel"].T
    if "logits_dense" in tree["decoder"]:
        state["lm_head.weight"] = tree["decoder"]["logits_dense"]["kernel"].T
    return {name: np.ascontiguousarray(value) for name, value in state.items()}
