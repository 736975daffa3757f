"""The shapes and dictionaries of a compressed model's expert codes, known to T5X before any read.

T5X initializes a model abstractly (``jax.eval_shape``) and only then restores
the checkpoint into that shape, so the compressed MoE layer inside T5X
(``interop/t5x_moe.py``) must know each sparse layer's code shapes when it is
built: the codes of a stack are ``uint16[E, n]`` with ``n`` the longest code
stream of its experts, different for every layer and kernel. A
``CompressedLayout`` holds, for each sparse layer, the code length, rows and
columns of each expert kernel and the layer's dictionary. It is read from

- a compressed directory (``python -m qmoe_jax.compress``): the manifest and the
  Orbax metadata of ``layers/<layer>/arrays`` (shapes only, no array is read),
  and its ``dictionaries/``;
- or a T5X checkpoint that T5X wrote of a model with compressed experts
  (``t5x.train``): its ``qmoe_jax/`` folder, ``layout.json`` (this layout, the
  source directory, and the SHA-256 of every code array as saved) and a copy of
  the dictionaries (``write_sidecar``, called by the checkpoint manager of
  ``interop/t5x_checkpoints.py``).

The gin macro ``QMOE_CHECKPOINT`` names the place (``configs/t5x/``); it is the
checkpoint being evaluated, or the one a fine-tuning starts from.

Inside T5X the code arrays live in the non-trainable variable collection
``qmoe_experts`` at ``<layer path>/<kernel>/{codes, row_offsets, minmax}``
(e.g. ``qmoe_experts/encoder/layers_1/mlp/wi/codes``), which T5X carries in
``TrainState.flax_mutables``, out of the optimizer's reach.

Nothing here imports T5X or flaxformer.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import shutil

import numpy as np

from qmoe_jax.checkpoints.compressed_trees import array_checksum, write_json_atomic
from qmoe_jax.checkpoints.format_v1 import (
    FORMAT as COMPRESSED_FORMAT,
)
from qmoe_jax.checkpoints.format_v1 import (
    CompressedCheckpoint,
    CompressedCheckpointError,
)
from qmoe_jax.checkpoints.layer_arrays import TERNARY_DTYPES, kernel_cols
from qmoe_jax.checkpoints.output_dir import MANIFEST, read_json_object
from qmoe_jax.codec.dictionary import Dictionary, fingerprint_of

COLLECTION = "qmoe_experts"
ARRAYS = ("codes", "row_offsets", "minmax")
SIDECAR = "qmoe_jax"
SIDECAR_LAYOUT = "layout.json"
SIDECAR_FORMAT = "qmoe_jax.t5x_compressed_state"
SIDECAR_VERSION = 1
STEP_NAME = re.compile(r"checkpoint_(\d+)")


class LayoutError(ValueError):
    """A place that holds no compressed layout, or a layout that disagrees with the model."""


@dataclasses.dataclass(frozen=True)
class KernelLayout:
    """One expert kernel of a sparse layer: W[E, rows, cols], codes ``uint16[E, code_length]``."""

    rows: int
    cols: int
    code_length: int

    def shapes(self, num_experts: int) -> dict[str, tuple[int, ...]]:
        """Shape of each stored array (``ARRAYS``) for ``num_experts`` experts."""
        return {
            "codes": (num_experts, self.code_length),
            "row_offsets": (num_experts, self.rows + 1),
            "minmax": (num_experts, self.rows, 2),
        }


@dataclasses.dataclass(frozen=True)
class LayerLayout:
    """One sparse layer: its experts, its kernels in stored order, its dictionary's fingerprint."""

    name: str
    num_experts: int
    kernels: tuple[tuple[str, KernelLayout], ...]
    dictionary: str

    def kernel(self, name: str) -> KernelLayout:
        return dict(self.kernels)[name]

    def kernel_names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.kernels)


@dataclasses.dataclass(frozen=True, eq=False)
class CompressedLayout:
    """Every sparse layer of a compressed model, and where the codes came from.

    Attributes:
      path: where this layout was read (a compressed directory or a T5X step directory).
      source: the compressed directory the codes were made in.
      model: the ``SwitchConfig`` fields of the compressed model (``header.model``).
      grid: the quantization grid (``header.grid``).
      step: the training step of the source checkpoint.
      layers: ``{layer name: LayerLayout}``, names as ``encoder.layers_1.mlp``.
      p0: ``{dictionary fingerprint: p0}``.
      checksums: T5X checkpoints only: SHA-256 of each code array as saved,
        ``{"<layer>/<kernel>/<array>": hex}``; empty for a compressed directory,
        whose own manifest holds them.
    """

    path: str
    source: str
    model: dict
    grid: dict
    step: int
    layers: dict[str, LayerLayout]
    p0: dict[str, float]
    checksums: dict[str, str] = dataclasses.field(default_factory=dict)

    def layer(self, name: str) -> LayerLayout:
        if name not in self.layers:
            raise LayoutError(
                f"{self.path} has no compressed sparse layer {name!r} (it has "
                f"{', '.join(sorted(self.layers))}); the model's sparse layers "
                "(NUM_ENCODER_SPARSE_LAYERS, NUM_DECODER_SPARSE_LAYERS, NUM_*_LAYERS) must be the "
                "checkpoint's"
            )
        return self.layers[name]

    def dictionary(self, fingerprint: str) -> Dictionary:
        """The dictionary with this fingerprint, read and verified once per process."""
        return _dictionary(self.path, fingerprint, self.p0[fingerprint])

    def to_json(self) -> dict:
        return {
            "source": self.source,
            "model": self.model,
            "grid": self.grid,
            "step": self.step,
            "p0": self.p0,
            "layers": {
                name: {
                    "num_experts": layer.num_experts,
                    "dictionary": layer.dictionary,
                    "kernels": {k: dataclasses.asdict(v) for k, v in layer.kernels},
                }
                for name, layer in self.layers.items()
            },
        }

    @classmethod
    def from_json(cls, path: str, payload: dict, checksums: dict[str, str]) -> CompressedLayout:
        layers = {
            name: LayerLayout(
                name,
                int(layer["num_experts"]),
                tuple((k, KernelLayout(**v)) for k, v in layer["kernels"].items()),
                layer["dictionary"],
            )
            for name, layer in payload["layers"].items()
        }
        return cls(
            path,
            payload["source"],
            payload["model"],
            payload["grid"],
            int(payload["step"]),
            layers,
            {k: float(v) for k, v in payload["p0"].items()},
            dict(checksums),
        )


def is_compressed_directory(path: str) -> bool:
    """Whether ``path`` holds the manifest of a compressed checkpoint."""
    manifest = read_json_object(os.path.join(path, MANIFEST))
    return manifest is not None and manifest.get("format") == COMPRESSED_FORMAT


def compressed_directory(path: str) -> str | None:
    """The compressed directory ``path`` names, or None.

    ``path`` is the directory itself, or ``<directory>/checkpoint_<step>`` with
    the directory's step (§4 of docs/gin.md): T5X names a checkpoint by its step,
    and ``t5x.eval`` reads the step from the end of ``CHECKPOINT_PATH`` when it
    records what it evaluated, so that form suits T5X's flags.
    """
    path = os.path.abspath(str(path).rstrip("/"))
    if is_compressed_directory(path):
        return path
    parent, name = os.path.split(path)
    match = STEP_NAME.fullmatch(name)
    if match is None or not is_compressed_directory(parent):
        return None
    from qmoe_jax.interop.steps import checkpoint_step

    step = checkpoint_step(parent)
    if int(match.group(1)) != step:
        raise LayoutError(
            f"{path} names step {match.group(1)} of the compressed checkpoint {parent}, whose step "
            f"is {step}; use {os.path.join(parent, f'checkpoint_{step}')} or {parent}"
        )
    return parent


def has_sidecar(path: str) -> bool:
    """Whether ``path`` is a T5X step directory with qmoe_jax's layout of its compressed experts."""
    return os.path.isfile(os.path.join(path, SIDECAR, SIDECAR_LAYOUT))


def read_layout(path: str) -> CompressedLayout:
    """The layout at ``path``: a compressed directory (or ``<it>/checkpoint_<step>``,
    ``compressed_directory``), or a T5X checkpoint with ``qmoe_jax/``.

    Cached per path and manifest modification time, so every layer of a model
    shares one read.
    """
    path = compressed_directory(path) or os.path.abspath(str(path).rstrip("/"))
    for marker in (os.path.join(path, MANIFEST), os.path.join(path, SIDECAR, SIDECAR_LAYOUT)):
        if os.path.isfile(marker):
            return _read_layout(path, os.stat(marker).st_mtime_ns)
    raise LayoutError(
        f"{path} holds no compressed experts: expected a directory written by "
        "`python -m qmoe_jax.compress` (with its manifest.json) or a T5X checkpoint written by "
        f"t5x.train with qmoe_jax's compressed experts (with {SIDECAR}/{SIDECAR_LAYOUT}); set "
        "QMOE_CHECKPOINT to the compressed directory"
    )


@functools.lru_cache(maxsize=16)
def _read_layout(path: str, mtime_ns: int) -> CompressedLayout:
    del mtime_ns  # part of the cache key only
    if is_compressed_directory(path):
        return _layout_of_compressed(path)
    record = read_json_object(os.path.join(path, SIDECAR, SIDECAR_LAYOUT))
    if (
        record is None
        or record.get("format") != SIDECAR_FORMAT
        or record.get("format_version") != SIDECAR_VERSION
    ):
        raise LayoutError(
            f"{os.path.join(path, SIDECAR, SIDECAR_LAYOUT)} is not a layout this qmoe_jax reads "
            f"(expected format {SIDECAR_FORMAT!r}, version {SIDECAR_VERSION})"
        )
    return CompressedLayout.from_json(path, record["layout"], record.get("checksums", {}))


def _stored_shapes(directory: str) -> dict:
    """``{kernel: {array: shape}}`` of one layer's Orbax tree, from its metadata alone."""
    import orbax.checkpoint as ocp
    from etils import epath

    try:
        tree = ocp.PyTreeCheckpointHandler().metadata(epath.Path(directory)).tree
    except Exception as error:  # orbax raises many types for a damaged tree
        raise CompressedCheckpointError(
            f"cannot read the Orbax metadata of {directory}: {error}"
        ) from error
    return {
        kernel: {name: tuple(meta.shape) for name, meta in arrays.items()}
        for kernel, arrays in tree.items()
    }


def _layout_of_compressed(path: str) -> CompressedLayout:
    from qmoe_jax.interop.steps import checkpoint_step

    checkpoint = CompressedCheckpoint(path)
    if not checkpoint.complete:
        raise CompressedCheckpointError(
            f"{path} is unfinished ({len(checkpoint.layer_names())} layers done); re-run the same "
            "`python -m qmoe_jax.compress` command to finish it"
        )
    header = checkpoint.header
    grid = header["grid"] if "grid" in header else header["settings"]["grid"]
    if grid.get("kind") != "ternary":
        raise LayoutError(
            f"{path} was quantized to {grid}; only ternary checkpoints run on the fused kernels "
            "inside T5X (use `python -m qmoe_jax.export` for a dense T5X checkpoint)"
        )
    if checkpoint.adapters() is not None:
        raise LayoutError(
            f"{path} carries expert LoRA adapters, which the compressed layer inside T5X does not "
            "apply; evaluate it with `python -m qmoe_jax.evaluate`"
        )
    model = header["model"]
    layers = {}
    for name in sorted(checkpoint.layer_names()):
        record = checkpoint.manifest["layers"][name]
        shapes = _stored_shapes(os.path.join(path, "layers", name, "arrays"))
        kernels = []
        for kernel in record["stats"]["kernels"]:
            stored = shapes.get(kernel, {})
            if set(stored) != set(TERNARY_DTYPES):
                raise CompressedCheckpointError(
                    f"{path}/layers/{name}/{kernel} holds arrays {sorted(stored)}, expected "
                    f"{sorted(TERNARY_DTYPES)}"
                )
            experts, rows, _ = stored["minmax"]
            kernels.append(
                (
                    kernel,
                    KernelLayout(
                        rows,
                        kernel_cols(kernel, model["d_model"], model["d_ff"]),
                        stored["codes"][1],
                    ),
                )
            )
        layers[name] = LayerLayout(name, experts, tuple(kernels), record["stats"]["dictionary"])
    p0 = {fp: float(record["p0"]) for fp, record in checkpoint.manifest["dictionaries"].items()}
    return CompressedLayout(path, path, model, grid, checkpoint_step(path), layers, p0)


@functools.lru_cache(maxsize=16)
def _dictionary(path: str, fingerprint: str, p0: float) -> Dictionary:
    if is_compressed_directory(path):
        return CompressedCheckpoint(path).dictionary(fingerprint)
    import orbax.checkpoint as ocp

    folder = os.path.join(path, SIDECAR, "dictionaries", fingerprint[:16])
    if not os.path.isdir(folder):
        raise LayoutError(f"dictionary {fingerprint[:16]}… of {path} is missing ({folder})")
    entries = np.asarray(ocp.PyTreeCheckpointer().restore(folder)["entries"])
    if fingerprint_of(entries) != fingerprint:
        raise LayoutError(f"{folder} does not match its fingerprint (the file is corrupt)")
    return Dictionary.from_entries(entries, p0)


def write_sidecar(step_directory: str, layout: CompressedLayout, codes: dict) -> None:
    """Writes ``<step_directory>/qmoe_jax/`` for a T5X checkpoint of a compressed model.

    Args:
      step_directory: T5X's ``checkpoint_<step>`` directory, already written.
      layout: the layout the model was built with.
      codes: the ``qmoe_experts`` collection as saved, ``{layer path...: {kernel: {array:
        np.ndarray}}}`` nested as in the variables; its SHA-256s are recorded, so that a reader
        can tell the codes are the source's.
    """
    from flax import traverse_util

    checksums = {
        "/".join(key): array_checksum(np.asarray(value))
        for key, value in sorted(traverse_util.flatten_dict(codes).items())
    }
    folder = os.path.join(step_directory, SIDECAR)
    staging = folder + ".partial"
    if os.path.exists(staging):
        shutil.rmtree(staging)
    os.makedirs(os.path.join(staging, "dictionaries"))
    for fingerprint in sorted({layer.dictionary for layer in layout.layers.values()}):
        source = _dictionary_folder(layout, fingerprint)
        shutil.copytree(source, os.path.join(staging, "dictionaries", fingerprint[:16]))
    write_json_atomic(
        os.path.join(staging, SIDECAR_LAYOUT),
        {
            "format": SIDECAR_FORMAT,
            "format_version": SIDECAR_VERSION,
            "collection": COLLECTION,
            "layout": layout.to_json(),
            "checksums": checksums,
        },
    )
    if os.path.exists(folder):
        shutil.rmtree(folder)
    os.replace(staging, folder)


def _dictionary_folder(layout: CompressedLayout, fingerprint: str) -> str:
    if is_compressed_directory(layout.path):
        record = CompressedCheckpoint(layout.path).manifest["dictionaries"][fingerprint]
        return os.path.join(layout.path, "dictionaries", record["directory"])
    return os.path.join(layout.path, SIDECAR, "dictionaries", fingerprint[:16])


def codes_path(layer: str, kernel: str, array: str) -> tuple[str, ...]:
    """Key path of one code array in the ``qmoe_experts`` collection."""
    return (*layer.split("."), kernel, array)
