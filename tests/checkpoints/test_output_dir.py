import json
import os

import pytest

from qmoe_jax.checkpoints.format_v1 import (
    COMPRESSED_OUTPUT,
    CompressedCheckpointError,
    CompressedCheckpointWriter,
)
from qmoe_jax.checkpoints.output_dir import (
    LOCK_FILE,
    OutputDirectoryError,
    check_writable,
    claimed,
    locked,
)

HEADER = {"model": {"name": "tiny"}, "source": "memory", "settings": {}}


def test_new_empty_and_own_directories_are_writable(tmp_path):
    check_writable(str(tmp_path / "new"), COMPRESSED_OUTPUT)
    check_writable(str(tmp_path), COMPRESSED_OUTPUT)
    (tmp_path / LOCK_FILE).write_text("")  # a run that stopped right after taking its lock
    check_writable(str(tmp_path), COMPRESSED_OUTPUT)
    CompressedCheckpointWriter(str(tmp_path), HEADER)
    check_writable(str(tmp_path), COMPRESSED_OUTPUT)
    assert json.loads((tmp_path / "manifest.json").read_text())["format"] == "qmoe_jax.compressed"


def test_outputs_written_before_the_marker_are_recognized(tmp_path):
    (tmp_path / "layers").mkdir()
    (tmp_path / "manifest.json").write_text(
        json.dumps({"format_version": 1, "header": HEADER, "layers": {}})
    )
    check_writable(str(tmp_path), COMPRESSED_OUTPUT)


def test_unrelated_directory_is_refused_naming_what_it_holds(tmp_path):
    (tmp_path / "layers" / "exp1").mkdir(parents=True)
    (tmp_path / "layers" / "exp1" / "r.csv").write_text("r")
    (tmp_path / "report.json").write_text("{}")
    with pytest.raises(
        OutputDirectoryError, match=rf"{tmp_path} is not empty .* \(it holds layers/, report.json\)"
    ):
        check_writable(str(tmp_path), COMPRESSED_OUTPUT)
    with pytest.raises(OutputDirectoryError, match="not empty"):
        CompressedCheckpointWriter(str(tmp_path), HEADER)
    assert (tmp_path / "layers" / "exp1" / "r.csv").read_text() == "r"
    assert (tmp_path / "report.json").read_text() == "{}"


def test_another_tools_manifest_is_refused(tmp_path):
    (tmp_path / "manifest.json").write_text(json.dumps({"format_version": 1, "files": []}))
    with pytest.raises(
        OutputDirectoryError, match=r'holds a manifest\.json that is not .* "qmoe_jax\.compressed"'
    ):
        check_writable(str(tmp_path), COMPRESSED_OUTPUT)


def test_a_file_is_refused(tmp_path):
    (tmp_path / "out").write_text("x")
    with pytest.raises(OutputDirectoryError, match="is a file, not a directory"):
        check_writable(str(tmp_path / "out"), COMPRESSED_OUTPUT)


def test_the_lock_refuses_a_second_writer(tmp_path):
    with (
        claimed(str(tmp_path / "out"), COMPRESSED_OUTPUT) as directory,
        pytest.raises(
            OutputDirectoryError, match=rf"is being written by qmoe_jax process {os.getpid()}"
        ),
        locked(directory),
    ):
        pass
    with locked(str(tmp_path / "out")):  # released at the end of the run
        pass


def test_writer_deletes_only_its_own_leftovers(tmp_path):
    CompressedCheckpointWriter(str(tmp_path), HEADER)
    (tmp_path / "layers" / "encoder.layers_3.mlp.partial").mkdir()
    (tmp_path / "layers" / "decoder.layers_1.mlp").mkdir()
    (tmp_path / "layers" / "notes").mkdir()
    (tmp_path / "dictionaries" / "0123456789abcdef").mkdir()
    (tmp_path / "dictionaries" / "README").write_text("mine")
    CompressedCheckpointWriter(str(tmp_path), HEADER)
    assert sorted(os.listdir(tmp_path / "layers")) == ["notes"]
    assert os.listdir(tmp_path / "dictionaries") == ["README"]


def test_a_compressed_checkpoint_that_lost_its_manifest_is_recognized_by_its_names(tmp_path):
    layer = tmp_path / "layers" / "encoder.layers_1.mlp"
    layer.mkdir(parents=True)
    (layer / "layer.json").write_text("{}")
    (tmp_path / "dense").mkdir()
    (tmp_path / "report.json").write_text("{}")
    check_writable(str(tmp_path), COMPRESSED_OUTPUT)
    with pytest.raises(CompressedCheckpointError, match=r"manifest\.json is missing; rebuild it"):
        CompressedCheckpointWriter(str(tmp_path), HEADER)  # never starts over on top of it
    assert (layer / "layer.json").read_text() == "{}"
    (tmp_path / "layers" / "notes").mkdir()  # something the writer does not write
    with pytest.raises(OutputDirectoryError, match="not empty"):
        check_writable(str(tmp_path), COMPRESSED_OUTPUT)
