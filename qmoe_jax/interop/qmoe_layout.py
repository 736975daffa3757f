"""The QMoE authors' published directory layout, read (docs/qmoe_import.md §2).

A directory holds ``config.json`` (HF ``SwitchTransformersConfig``),
``noexp.pt`` (every non-expert parameter, HF names), ``sizes.pt``
(``{"<expert>.wi": codewords, ...}``) and one ``expNN.pt`` per sparse layer
with, per expert linear ``<expert>.{wi,wo}``: ``w_comp`` int16[n] (the
codewords), ``row_off`` int32[rows + 1] (per linear, from 0), ``ter_minmax``
bfloat16[2·rows] ((min, max) per row, interleaved) and an empty ``weight``.
Rows are output units (HF's ``[out, in]``), so the streams are in our
orientation already and are copied bit for bit: the int16 codewords are
reinterpreted as uint16, the offsets and levels are kept, and the level pairs
are viewed as [rows, 2].
"""

from __future__ import annotations

import dataclasses
import glob
import os
import re

import numpy as np

from qmoe_jax.checkpoints import hf_names, torch_pickle
from qmoe_jax.checkpoints.layer_arrays import TERNARY_DTYPES, kernel_cols
from qmoe_jax.codec.dictionary import Dictionary
from qmoe_jax.codec.streams import count_zeros
from qmoe_jax.interop.qmoe_config import read_qmoe_config
from qmoe_jax.models import SwitchConfig

CONFIG, DENSE, SIZES = "config.json", "noexp.pt", "sizes.pt"
LAYER_FILES = "exp*.pt"
EXPERT_KEY = re.compile(
    r"^(encoder|decoder)\.block\.(\d+)\.layer\.(\d+)\.mlp\.experts\.expert_(\d+)\."
    r"(wi|wo)\.(w_comp|row_off|ter_minmax|weight)$"
)
STREAM_DTYPES = {
    "w_comp": np.dtype(np.int16),
    "row_off": np.dtype(np.int32),
    "ter_minmax": TERNARY_DTYPES["minmax"],
}
# Names in noexp.pt that the T5X tree does not need: the per-stack copies of the shared embedding
# (checked equal to it) and, for tied models, the output projection (tied to it).
REDUNDANT = ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight")


class QMoELayoutError(ValueError):
    """A directory or file that is not in the QMoE authors' layout."""


@dataclasses.dataclass
class LayerFile:
    """One ``expNN.pt``: the sparse layer it holds and, per kernel, each expert's three tensors
    (unread)."""

    path: str
    layer: str  # our name, e.g. encoder.layers_1.mlp
    hf_prefix: str  # e.g. encoder.block.1.layer.1.mlp
    tensors: dict[str, list[dict[str, torch_pickle.LazyTensor]]]

    @property
    def name(self) -> str:
        return os.path.basename(self.path)


class _Tracked(dict):
    """A state dict that remembers which names were read."""

    def __init__(self, values):
        super().__init__(values)
        self.read: set[str] = set()

    def __getitem__(self, key):
        self.read.add(key)
        return super().__getitem__(key)


class QMoEDirectory:
    """A downloaded ``*_qmoe`` directory, checked for its files and config.

    Attributes:
      config: the model config (``read_qmoe_config``); config_differences: where
        the registered config of the same model disagrees with config.json.
      layer_paths: the ``expNN.pt`` files, sorted.
    """

    def __init__(self, path: str):
        self.path = os.path.abspath(path)
        if not os.path.isdir(self.path):
            raise QMoELayoutError(
                f"{path} is not a directory; pass the directory of a downloaded QMoE model "
                "(e.g. a clone of https://huggingface.co/ISTA-DASLab/switch-base-128_qmoe)"
            )
        missing = [
            name
            for name in (CONFIG, DENSE, SIZES)
            if not os.path.isfile(os.path.join(self.path, name))
        ]
        self.layer_paths = sorted(glob.glob(os.path.join(self.path, LAYER_FILES)))
        if missing or not self.layer_paths:
            absent = missing + ([LAYER_FILES] if not self.layer_paths else [])
            raise QMoELayoutError(
                f"{self.path} is not a QMoE model directory: it lacks {', '.join(absent)} (a "
                f"published QMoE model has {CONFIG}, {DENSE}, {SIZES} and exp00.pt, exp01.pt, ...);"
                " if the files are Git LFS pointers, run `git lfs pull` in it"
            )
        self.config, self.config_differences = read_qmoe_config(os.path.join(self.path, CONFIG))

    def file(self, name: str) -> str:
        return os.path.join(self.path, name)

    def sparse_layers(self) -> list[tuple[str, int]]:
        """(stack, block) of every sparse layer, encoder first, as the authors number their
        files."""
        return [
            (stack, i)
            for stack in ("encoder", "decoder")
            for i in self.config.sparse_layers(decoder=stack == "decoder")
        ]

    def sizes(self) -> dict[str, int]:
        sizes = torch_pickle.load(self.file(SIZES))
        if not isinstance(sizes, dict) or not all(isinstance(v, int) for v in sizes.values()):
            raise QMoELayoutError(f"{self.file(SIZES)} does not hold a dict of codeword counts")
        return sizes

    def dense_params(self) -> dict:
        """The T5X tree of every non-expert parameter in noexp.pt, dtypes kept."""
        path = self.file(DENSE)
        state = torch_pickle.load(path)
        if not isinstance(state, dict):
            raise QMoELayoutError(f"{path} holds a {type(state).__name__}, not a state dict")
        tracked = _Tracked(state)
        try:
            tree = hf_names.hf_to_t5x(tracked, self.config, experts=False)
        except hf_names.HFNamesError as error:
            raise QMoELayoutError(f"{path}: {error}") from None
        if (
            not self.config.logits_dense
            and "lm_head.weight" in state
            and not np.array_equal(state["lm_head.weight"], state["shared.weight"])
        ):
            raise QMoELayoutError(
                f"{path}: lm_head.weight differs from shared.weight, but config.json ties them "
                '(tie_word_embeddings); set "tie_word_embeddings": false in config.json if the '
                "model has its own output layer"
            )
        ignored = set(REDUNDANT) | (set() if self.config.logits_dense else {"lm_head.weight"})
        unused = sorted(set(state) - tracked.read - ignored)
        if unused:
            raise QMoELayoutError(
                f"{path} holds parameters the model has no place for: {', '.join(unused[:5])}"
                f"{' ...' if len(unused) > 5 else ''} ({len(unused)}); is config.json this "
                "model's?"
            )
        return tree

    def layer_file(self, path: str, sizes: dict[str, int]) -> LayerFile:
        """Reads the pickle of one ``expNN.pt`` (not its data) and checks names, dtypes, shapes and
        sizes.pt."""
        state = torch_pickle.load(path, lazy=True)
        if not isinstance(state, dict) or not state:
            raise QMoELayoutError(f"{path} does not hold a non-empty state dict")
        layers, tensors = set(), {}
        for key, value in state.items():
            match = EXPERT_KEY.match(key)
            if match is None:
                raise QMoELayoutError(
                    f"{path} holds {key!r}, which is not <stack>.block.<i>.layer.<j>.mlp.experts."
                    "expert_<e>.{wi,wo}.{w_comp,row_off,ter_minmax,weight}"
                )
            stack, block, sublayer, expert, kernel, part = match.groups()
            layers.add((stack, int(block), int(sublayer)))
            if part != "weight":
                tensors.setdefault((kernel, int(expert)), {})[part] = value
        if len(layers) != 1:
            raise QMoELayoutError(
                f"{path} holds experts of {len(layers)} layers ({sorted(layers)}); the authors' "
                "layout has one sparse layer per file"
            )
        stack, block, sublayer = layers.pop()
        if (stack, block) not in self.sparse_layers() or sublayer != (
            1 if stack == "encoder" else 2
        ):
            raise QMoELayoutError(
                f"{path} holds experts of {stack}.block.{block}.layer.{sublayer}, which is not a "
                "sparse MLP of this model (config.json)"
            )
        config = self.config
        by_kernel = {}
        for kernel in hf_names.EXPERT_KERNELS:
            rows = config.d_ff if kernel == "wi" else config.d_model
            experts = []
            for e in range(config.num_experts):
                name = f"{hf_names.expert_name(stack, block, e)}.{kernel}"
                parts = tensors.get((kernel, e), {})
                for part, dtype in STREAM_DTYPES.items():
                    if part not in parts:
                        raise QMoELayoutError(f"{path} lacks {name}.{part}")
                    if parts[part].dtype != dtype or len(parts[part].shape) != 1:
                        raise QMoELayoutError(
                            f"{path}: {name}.{part} is "
                            f"{parts[part].dtype}{list(parts[part].shape)},"
                            f" expected a 1-d {dtype} tensor"
                        )
                shapes = {"row_off": (rows + 1,), "ter_minmax": (2 * rows,)}
                for part, shape in shapes.items():
                    if parts[part].shape != shape:
                        raise QMoELayoutError(
                            f"{path}: {name}.{part} has shape {list(parts[part].shape)}, expected "
                            f"{list(shape)} ({kernel} has {rows} output rows)"
                        )
                if sizes.get(name) != parts["w_comp"].shape[0]:
                    raise QMoELayoutError(
                        f"{path}: {name}.w_comp has {parts['w_comp'].shape[0]} codewords but "
                        f"{SIZES} says {sizes.get(name, 'nothing')}"
                    )
                experts.append(parts)
            by_kernel[kernel] = experts
        extra = len(tensors) - 2 * config.num_experts
        if extra:
            raise QMoELayoutError(
                f"{path} holds {extra} expert linears beyond the {config.num_experts} experts of "
                "config.json"
            )
        return LayerFile(
            path, hf_names.t5x_layer_name(stack, block), hf_names.mlp_name(stack, block), by_kernel
        )


def read_layer(layer: LayerFile, config: SwitchConfig, dictionary: Dictionary) -> tuple[dict, dict]:
    """One layer's stored arrays (docs/format.md §8.5) and per-kernel stats, codes copied bit for
    bit.

    Each expert's stream is read straight into its row of the padded stack.
    Every row is checked to hold exactly its columns' codewords, without decoding.
    """
    arrays, stats = {}, {}
    for kernel, experts in layer.tensors.items():
        rows, cols = (
            experts[0]["row_off"].shape[0] - 1,
            kernel_cols(kernel, config.d_model, config.d_ff),
        )
        longest = max(1, max(parts["w_comp"].shape[0] for parts in experts))
        codes = np.zeros((len(experts), longest), np.uint16)
        offsets = np.empty((len(experts), rows + 1), np.int32)
        minmax = np.empty((len(experts), rows, 2), TERNARY_DTYPES["minmax"])
        zeros = codewords = 0
        for e, parts in enumerate(experts):
            n = parts["w_comp"].shape[0]
            parts["w_comp"].read_into(codes[e, :n].view(np.int16))
            parts["row_off"].read_into(offsets[e])
            parts["ter_minmax"].read_into(minmax[e].reshape(-1))
            try:
                zeros += count_zeros(codes[e, :n], offsets[e], minmax[e], cols, dictionary)
            except ValueError as error:
                raise QMoELayoutError(
                    f"{layer.path}: expert {e}'s {kernel} stream is malformed ({error}); the file "
                    "is damaged or was not written with the QMoE dictionary"
                ) from None
            codewords += int(offsets[e, -1])
        weights = len(experts) * rows * cols
        arrays[kernel] = {"codes": codes, "row_offsets": offsets, "minmax": minmax}
        stats[kernel] = {
            "rows": rows,
            "cols": cols,
            "zero_fraction": zeros / weights,
            "codewords": codewords,
            "bits_per_weight": (16.0 * codewords + 64.0 * rows * len(experts)) / weights,
        }
    return arrays, stats
