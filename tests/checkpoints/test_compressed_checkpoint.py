import json
import os
import re

import ml_dtypes
import numpy as np
import pytest

from qmoe_jax.checkpoints.format_v1 import (
    CompressedCheckpoint,
    CompressedCheckpointError,
    CompressedCheckpointWriter,
)

HEADER = {
    "model": {"name": "tiny"},
    "source": "memory",
    "settings": {"grid": {"kind": "ternary", "bits": None}},
}


def layer_arrays(seed):
    rng = np.random.default_rng(seed)
    return {
        "wi": {
            "codes": rng.integers(0, 65535, (2, 40), dtype=np.uint16),
            "row_offsets": np.tile(np.arange(5, dtype=np.int32) * 10, (2, 1)),
            "minmax": rng.normal(size=(2, 4, 2)).astype(ml_dtypes.bfloat16),
        },
        "wo": {
            "codes": rng.integers(0, 65535, (2, 30), dtype=np.uint16),
            "row_offsets": np.tile(np.arange(4, dtype=np.int32) * 10, (2, 1)),
            "minmax": rng.normal(size=(2, 3, 2)).astype(ml_dtypes.bfloat16),
        },
    }


def assert_tree_equal(a, b):
    assert a.keys() == b.keys()
    for key in a:
        if isinstance(a[key], dict):
            assert_tree_equal(a[key], b[key])
        else:
            assert np.asarray(a[key]).dtype == np.asarray(b[key]).dtype
            np.testing.assert_array_equal(np.asarray(a[key]), np.asarray(b[key]))


@pytest.mark.slow
def test_round_trip(tmp_path, dictionary):
    writer = CompressedCheckpointWriter(str(tmp_path), HEADER)
    dense = {
        "encoder": {
            "layers_0": {"attention": {"query": {"kernel": np.ones((4, 4), ml_dtypes.bfloat16)}}}
        }
    }
    writer.write_dense(dense)
    fingerprint = writer.write_dictionary(dictionary)
    writer.write_layer("encoder.layers_1.mlp", layer_arrays(0), {"dictionary": fingerprint})
    writer.finalize({"done": True})
    checkpoint = CompressedCheckpoint(str(tmp_path))
    assert checkpoint.complete and checkpoint.layer_names() == ["encoder.layers_1.mlp"]
    assert_tree_equal(checkpoint.dense_params(), dense)
    arrays, stats = checkpoint.layer("encoder.layers_1.mlp")
    assert_tree_equal(arrays, layer_arrays(0))
    assert checkpoint.dictionary(stats["dictionary"]).fingerprint == dictionary.fingerprint


def test_relative_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    writer = CompressedCheckpointWriter("out", HEADER)
    writer.write_layer("encoder.layers_1.mlp", layer_arrays(2), {"dictionary": None})
    assert_tree_equal(CompressedCheckpoint("out").layer("encoder.layers_1.mlp")[0], layer_arrays(2))


def test_corrupt_byte_names_the_array(tmp_path):
    writer = CompressedCheckpointWriter(str(tmp_path), HEADER)
    writer.write_layer("decoder.layers_3.mlp", layer_arrays(1), {"dictionary": None})
    record = writer.manifest["layers"]["decoder.layers_3.mlp"]
    record["checksums"]["wo/minmax"] = "0" * 64  # as if the stored bytes had changed
    writer._commit()
    with pytest.raises(CompressedCheckpointError, match="checksum mismatch for array wo/minmax"):
        CompressedCheckpoint(str(tmp_path)).layer("decoder.layers_3.mlp")


def test_flipped_byte_on_disk_names_the_array(tmp_path):
    # Entropy-coded streams are incompressible, like these random codes, so a
    # flipped byte survives Orbax's compression and only the checksum sees it.
    writer = CompressedCheckpointWriter(str(tmp_path), HEADER)
    rng = np.random.default_rng(0)
    arrays = {
        "wi": {"codes": rng.integers(0, 65535, (4, 4096), dtype=np.uint16)},
        "wo": {"codes": rng.integers(0, 65535, (4, 4096), dtype=np.uint16)},
    }
    writer.write_layer("encoder.layers_1.mlp", arrays, {"dictionary": None})
    data = tmp_path / "layers" / "encoder.layers_1.mlp" / "arrays" / "ocdbt.process_0" / "d"
    largest = max(data.iterdir(), key=lambda p: p.stat().st_size)
    blob = bytearray(largest.read_bytes())
    blob[len(blob) // 3] ^= 0x10
    largest.write_bytes(bytes(blob))
    with pytest.raises(CompressedCheckpointError, match=r"checksum mismatch for array w[io]/codes"):
        CompressedCheckpoint(str(tmp_path)).layer("encoder.layers_1.mlp")


def test_resume_keeps_finished_layers_and_drops_partial_ones(tmp_path):
    writer = CompressedCheckpointWriter(str(tmp_path), HEADER)
    writer.write_layer("encoder.layers_1.mlp", layer_arrays(0), {"dictionary": None})
    os.makedirs(tmp_path / "layers" / "encoder.layers_3.mlp.partial" / "arrays")
    resumed = CompressedCheckpointWriter(str(tmp_path), json.loads(json.dumps(HEADER)))
    assert resumed.finished_layers() == ["encoder.layers_1.mlp"]
    assert os.listdir(tmp_path / "layers") == ["encoder.layers_1.mlp"]


def test_resume_with_another_header_refused_once_a_part_is_finished(tmp_path):
    CompressedCheckpointWriter(str(tmp_path), HEADER)
    other = dict(HEADER, settings={"grid": {"kind": "minmax", "bits": 2}})
    CompressedCheckpointWriter(str(tmp_path), other).write_layer(
        "encoder.layers_1.mlp", layer_arrays(0), {"dictionary": None}
    )  # nothing finished: replaced
    with pytest.raises(CompressedCheckpointError, match="another run"):
        CompressedCheckpointWriter(str(tmp_path), HEADER)


def test_not_a_checkpoint_and_wrong_version(tmp_path):
    with pytest.raises(CompressedCheckpointError, match="not a qmoe_jax compressed checkpoint"):
        CompressedCheckpoint(str(tmp_path))
    (tmp_path / "manifest.json").write_text(
        json.dumps({"format_version": 1, "name": "another tool"})
    )
    with pytest.raises(
        CompressedCheckpointError, match="not the manifest of a qmoe_jax compressed checkpoint"
    ):
        CompressedCheckpoint(str(tmp_path))
    (tmp_path / "manifest.json").write_text(
        json.dumps({"format": "qmoe_jax.compressed", "format_version": 99})
    )
    with pytest.raises(CompressedCheckpointError, match="format version 99"):
        CompressedCheckpoint(str(tmp_path))


def test_missing_layer_is_named(tmp_path):
    CompressedCheckpointWriter(str(tmp_path), HEADER)
    with pytest.raises(
        CompressedCheckpointError, match=re.escape("layer encoder.layers_5.mlp is not in")
    ):
        CompressedCheckpoint(str(tmp_path)).layer("encoder.layers_5.mlp")
