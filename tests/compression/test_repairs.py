"""A re-run repairs a damaged or incomplete output, or refuses to touch it, and never prints success
over an output that does not load (docs/recovery.md, "Repaired")."""

import json
import os
import re
import shutil

import numpy as np
import pytest
from flax.traverse_util import flatten_dict
from helpers.compression_runs import all_arrays, assert_same_arrays, flip_bytes, options
from helpers.switch_fixtures import TINY

from qmoe_jax import evaluate, generate
from qmoe_jax.checkpoints.format_v1 import CompressedCheckpoint, CompressedCheckpointError
from qmoe_jax.compression.job import compress_checkpoint
from qmoe_jax.compression.resume import ResumeRefusedError
from qmoe_jax.compression.source_check import SourceChangedError
from qmoe_jax.inference.compressed_params import load_compressed_model

QUIET = dict(log=lambda line: None, progress=False, config=TINY)


@pytest.fixture(scope="module")
def reference(tiny_setup, tmp_path_factory):
    """An uninterrupted run of the tiny model: what every repaired run must equal."""
    directory = tmp_path_factory.mktemp("reference") / "out"
    compress_checkpoint(options(tiny_setup, directory), **QUIET)
    return directory


def assert_same_output(output, reference) -> None:
    """``output`` loads, and holds the arrays of ``reference``: the same model, hence the same
    loss."""
    load_compressed_model(str(output))
    assert_same_arrays(all_arrays(output), all_arrays(reference))
    repaired = flatten_dict(CompressedCheckpoint(str(output)).dense_params())
    original = flatten_dict(CompressedCheckpoint(str(reference)).dense_params())
    assert repaired.keys() == original.keys()
    for key in original:
        np.testing.assert_array_equal(
            np.asarray(repaired[key]), np.asarray(original[key]), err_msg=str(key)
        )


def rerun(tiny_setup, output, **overrides) -> list[str]:
    lines = []
    compress_checkpoint(
        options(tiny_setup, output, **overrides), log=lines.append, progress=False, config=TINY
    )
    return lines


@pytest.mark.parametrize("verify", ["quick", "full"])
def test_same_size_damage_in_dense_is_repaired_by_a_re_run(tiny_setup, reference, tmp_path, verify):
    output = tmp_path / "out"
    shutil.copytree(reference, output)
    flip_bytes(output / "dense")
    lines = rerun(tiny_setup, output, verify=verify)
    # A checksum mismatch or an unreadable chunk, depending on where the flips landed.
    assert any(
        line.startswith("repairing dense/: ") and line.endswith("; it is rewritten from the source")
        for line in lines
    ), lines
    assert_same_output(output, reference)


def test_same_size_damage_in_a_dictionary_is_repaired_without_recompressing(
    tiny_setup, reference, tmp_path
):
    output = tmp_path / "out"
    shutil.copytree(reference, output)
    (dictionary,) = os.listdir(output / "dictionaries")
    flip_bytes(output / "dictionaries" / dictionary)
    lines = rerun(tiny_setup, output)
    assert f"repairing dictionary {dictionary}: " in "\n".join(lines), lines
    assert not any("compressing it again" in line for line in lines), lines
    assert sum("replayed from disk" in line for line in lines) == 2, lines
    assert_same_output(output, reference)


def test_a_dictionary_damaged_after_the_check_is_rebuilt_when_its_layer_is_replayed(
    tiny_setup, reference, tmp_path, monkeypatch
):
    output = tmp_path / "out"
    shutil.copytree(reference, output)
    (dictionary,) = os.listdir(output / "dictionaries")
    verify = CompressedCheckpoint.dictionary

    def damaged_once_checked(checkpoint, fingerprint):
        """The dictionary passes the checks before any work, then is damaged on disk."""
        found = verify(checkpoint, fingerprint)
        monkeypatch.setattr(CompressedCheckpoint, "dictionary", verify)
        flip_bytes(output / "dictionaries" / dictionary)
        return found

    monkeypatch.setattr(CompressedCheckpoint, "dictionary", damaged_once_checked)
    lines = rerun(tiny_setup, output)
    assert any(line.endswith("rebuilding the dictionary from its p0") for line in lines), lines
    assert not any("compressing it again" in line for line in lines), lines
    assert_same_output(output, reference)


def one_line_error(main, argv, capsys) -> str:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    err = capsys.readouterr().err
    assert exited.value.code == 1, err
    assert err.startswith("error: ") and len(err.strip().splitlines()) == 1, err
    return err


def test_a_deleted_manifest_is_named_and_rebuilt_from_the_layer_records(
    tiny_setup, reference, tmp_path, capsys
):
    output = tmp_path / "out"
    shutil.copytree(reference, output)
    os.remove(output / "manifest.json")
    tokenizer = tiny_setup[2]
    for main, argv in [
        (evaluate.main, ["--checkpoint", str(output), "--tokenizer", tokenizer]),
        (generate.main, ["--checkpoint", str(output), "--tokenizer", tokenizer, "--prompt", "a"]),
    ]:
        err = one_line_error(main, argv, capsys)
        assert f"{output} is a qmoe_jax compressed checkpoint whose manifest.json is missing" in err
        assert "with --verify full, which rebuilds the manifest from the layers' records" in err
        assert "not a T5X checkpoint" not in err

    lines = []
    with pytest.raises(SourceChangedError, match=r"its manifest was rebuilt.*--verify full"):
        compress_checkpoint(
            options(tiny_setup, output), log=lines.append, progress=False, config=TINY
        )
    assert any(
        "manifest.json was missing: rebuilt it from the records of 2" in line for line in lines
    )
    lines = rerun(tiny_setup, output, verify="full")
    assert sum("replayed from disk" in line for line in lines) == 2, lines
    assert_same_output(output, reference)
    assert CompressedCheckpoint(str(output)).manifest["source_snapshot"]


def test_an_interrupted_run_without_its_manifest_resumes(tiny_setup, reference, tmp_path):
    output = tmp_path / "out"
    shutil.copytree(reference, output)
    shutil.rmtree(output / "layers" / "decoder.layers_1.mlp")  # as if stopped after one layer
    os.remove(output / "manifest.json")
    os.remove(output / "report.json")
    lines = rerun(tiny_setup, output, verify="full")
    assert "encoder.layers_1.mlp: finished earlier, replayed from disk" in lines, lines
    assert_same_output(output, reference)


def test_a_manifest_is_not_rebuilt_for_other_settings_or_from_old_records(
    tiny_setup, reference, tmp_path, capsys
):
    output = tmp_path / "out"
    shutil.copytree(reference, output)
    os.remove(output / "manifest.json")
    with pytest.raises(ResumeRefusedError, match="--num_samples was 24, now 32"):
        compress_checkpoint(options(tiny_setup, output, num_samples=32, verify="full"), **QUIET)

    old = tmp_path / "old"
    shutil.copytree(reference, old)
    os.remove(old / "manifest.json")
    for name in os.listdir(old / "layers"):  # layer records as an older qmoe_jax wrote them
        path = old / "layers" / name / "layer.json"
        record = json.loads(path.read_text())
        path.write_text(json.dumps({k: record[k] for k in ("stats", "checksums", "files")}))
    message = (
        f"{old} is a compressed checkpoint whose manifest.json is missing, and its layer records "
        "were written by an older qmoe_jax, without the run's settings, so it cannot be rebuilt; "
        f"delete {old} and re-run"
    )
    with pytest.raises(CompressedCheckpointError, match=re.escape(message)):
        compress_checkpoint(options(tiny_setup, old, verify="full"), **QUIET)
    err = one_line_error(evaluate.main, ["--checkpoint", str(old)], capsys)
    assert message in err
    assert sorted(os.listdir(old / "layers")) == ["decoder.layers_1.mlp", "encoder.layers_1.mlp"]
