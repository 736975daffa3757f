"""The layout of a compressed model's codes for T5X (interop/t5x_layout.py) and T5X checkpoints of a
compressed model read back by qmoe_jax (interop/t5x_state.py); no T5X needed.

A T5X checkpoint like the ones t5x.train writes with configs/t5x/compressed_train.gin is made
here with Orbax directly: ``checkpoint_<step>/state/`` holding ``target``, ``state/step`` and
``flax_mutables/qmoe_experts``, plus the ``qmoe_jax/`` folder of ``write_sidecar``.
"""

import json
import os
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import traverse_util

from qmoe_jax.checkpoints.format_v1 import CompressedCheckpoint, CompressedCheckpointError
from qmoe_jax.inference import open_model
from qmoe_jax.inference.compressed_params import load_compressed_model
from qmoe_jax.interop.t5x_layout import (
    COLLECTION,
    SIDECAR,
    SIDECAR_LAYOUT,
    LayoutError,
    compressed_directory,
    has_sidecar,
    read_layout,
    write_sidecar,
)


def test_layout_of_a_compressed_directory_has_every_layers_code_shapes(compressed_tiny):
    _, directory, _ = compressed_tiny
    layout = read_layout(directory)
    checkpoint = CompressedCheckpoint(directory)
    assert sorted(layout.layers) == sorted(checkpoint.layer_names())
    assert layout.step == 1 and layout.grid["kind"] == "ternary"
    for name, layer in layout.layers.items():
        arrays, stats = checkpoint.layer(name)
        assert layer.dictionary == stats["dictionary"]
        assert layout.dictionary(layer.dictionary).fingerprint == stats["dictionary"]
        for kernel, shape in layer.kernels:
            stored = {k: np.asarray(v).shape for k, v in arrays[kernel].items()}
            assert stored == shape.shapes(layer.num_experts)
    assert read_layout(directory + "/") is layout  # read once per process
    with pytest.raises(
        LayoutError, match=r"has no compressed sparse layer 'encoder\.layers_0\.mlp'"
    ):
        layout.layer("encoder.layers_0.mlp")
    with pytest.raises(LayoutError, match="holds no compressed experts"):
        read_layout(os.path.dirname(directory))
    # T5X's form, <directory>/checkpoint_<step>, names the directory at its own step only.
    assert compressed_directory(os.path.join(directory, "checkpoint_1")) == directory
    assert read_layout(os.path.join(directory, "checkpoint_1")) is layout
    assert compressed_directory(os.path.dirname(directory)) is None
    with pytest.raises(LayoutError, match="names step 2 of the compressed checkpoint"):
        compressed_directory(os.path.join(directory, "checkpoint_2"))


def write_t5x_state(directory: str, compressed: str, step: int = 7) -> str:
    """A T5X step directory of the compressed model, as t5x.train writes it; returns its path."""
    model = load_compressed_model(compressed, experts="compressed")
    params = jax.tree.map(np.asarray, model.params)
    codes, target = {}, {}
    for path, value in traverse_util.flatten_dict(params).items():
        if "expert" in path:
            layer, kernel = path[: path.index("expert")], path[-1]
            for array in ("codes", "row_offsets", "minmax"):
                codes[(*layer, kernel, array)] = np.asarray(getattr(value, array))
        else:
            target[path] = value
    collection = traverse_util.unflatten_dict(codes)
    step_dir = os.path.join(directory, f"checkpoint_{step}")
    ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_ocdbt=True)).save(
        os.path.join(step_dir, "state"),
        {
            "target": traverse_util.unflatten_dict(target),
            "state": {"step": np.int32(step)},
            "flax_mutables": {COLLECTION: collection},
        },
    )
    write_sidecar(step_dir, read_layout(compressed), collection)
    return step_dir


def test_a_t5x_checkpoint_of_the_compressed_model_opens_as_the_compressed_directory(
    compressed_tiny, tmp_path
):
    _, directory, tokenizer = compressed_tiny
    step_dir = write_t5x_state(str(tmp_path / "train"), directory)
    assert has_sidecar(step_dir) and not has_sidecar(directory)
    record = json.loads(Path(step_dir, SIDECAR, SIDECAR_LAYOUT).read_text())
    source = CompressedCheckpoint(directory).manifest["layers"]
    assert record["checksums"] == {
        "/".join(layer.split(".")) + "/" + name: digest
        for layer, layer_record in source.items()
        for name, digest in layer_record["checksums"].items()
    }
    layout = read_layout(step_dir)
    assert (
        layout.source == os.path.abspath(directory)
        and layout.layers == read_layout(directory).layers
    )

    tokens = np.asarray(tokenizer.encode("the quick brown fox") + [1], np.int32)[None]
    decoder = np.concatenate([np.zeros_like(tokens[:, :1]), tokens[:, :-1]], axis=1)
    for experts in ("compressed", "dense"):
        theirs, ours = open_model(step_dir, experts=experts), open_model(directory, experts=experts)
        assert theirs.kind == "compressed" and theirs.experts == experts
        assert theirs.config == ours.config
        logits = [
            m.module.apply({"params": m.params}, tokens, decoder, tokens) for m in (theirs, ours)
        ]
        np.testing.assert_array_equal(logits[0], logits[1])


def test_damaged_codes_in_a_t5x_checkpoint_are_refused(compressed_tiny, tmp_path):
    _, directory, _ = compressed_tiny
    step_dir = write_t5x_state(str(tmp_path / "train"), directory)
    path = Path(step_dir, SIDECAR, SIDECAR_LAYOUT)
    record = json.loads(path.read_text())
    key = next(k for k in record["checksums"] if k.endswith("/codes"))
    record["checksums"][key] = "0" * 64
    path.write_text(json.dumps(record))
    with pytest.raises(CompressedCheckpointError, match=f"the codes {key} do not match"):
        open_model(step_dir)
