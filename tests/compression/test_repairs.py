"""A re-run repairs a damaged or incomplete output, or refuses to touch it, and never prints success
over an output that does not load (docs/recovery.md, "Repaired")."""

import os
import shutil

import numpy as np
import pytest
from flax.traverse_util import flatten_dict
from helpers.compression_runs import all_arrays, assert_same_arrays, options
from helpers.switch_fixtures import TINY

from qmoe_jax.checkpoints.format_v1 import CompressedCheckpoint
from qmoe_jax.compression.job import compress_checkpoint
from qmoe_jax.inference.compressed_params import load_compressed_model

QUIET = dict(log=lambda line: None, progress=False, config=TINY)


@pytest.fixture(scope="module")
def reference(tiny_setup, tmp_path_factory):
    """An uninterrupted run of the tiny model: what every repaired run must equal."""
    directory = tmp_path_factory.mktemp("reference") / "out"
    compress_checkpoint(options(tiny_setup, directory), **QUIET)
    return directory


def flip_bytes(tree) -> None:
    """Flips the middle byte of every data file of the Orbax tree ``tree``, leaving their sizes as
    they were."""
    data = os.path.join(tree, "ocdbt.process_0", "d")
    for name in os.listdir(data):
        with open(os.path.join(data, name), "r+b") as f:
            f.seek(os.path.getsize(f.name) // 2)
            byte = f.read(1)[0]
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte ^ 0x10]))


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
    assert any(
        line.startswith("repairing dense/: dense parameters: checksum mismatch") for line in lines
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
