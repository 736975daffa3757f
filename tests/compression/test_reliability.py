"""The compressor as a hostile user meets it: foreign output directories, changed sources and
settings, non-finite weights, damaged output, bad flags, interrupts and a second writer
(docs/recovery.md)."""

import dataclasses
import json
import os
import pathlib
import re
import select
import shutil
import signal
import time

import numpy as np
import pytest
from flax.traverse_util import flatten_dict
from helpers.child_process import popen_python, run_python
from helpers.compression_runs import (
    all_arrays,
    assert_same_arrays,
    cli_flags,
    flip_bytes,
    options,
)
from helpers.switch_fixtures import TINY, random_params, write_c4_shard, write_tiny_checkpoint
from helpers.text import synthetic_sentences

from qmoe_jax import compress, evaluate
from qmoe_jax.checkpoints import write_t5x_checkpoint
from qmoe_jax.checkpoints.format_v1 import (
    CompressedCheckpoint,
    CompressedCheckpointError,
    CompressedCheckpointWriter,
)
from qmoe_jax.checkpoints.nonfinite import NonFiniteWeightsError
from qmoe_jax.checkpoints.output_dir import locked
from qmoe_jax.compression.job import compress_checkpoint
from qmoe_jax.compression.resume import ResumeRefusedError, header_differences
from qmoe_jax.inference.compressed_params import load_compressed_model

QUIET = dict(log=lambda line: None, progress=False, config=TINY)
EXPERT_WI = "encoder/layers_1/mlp/expert/wi/kernel"


@pytest.fixture(scope="module")
def reference(compressed_tiny):
    """An uninterrupted run of the tiny model with ``options(tiny_setup, ...)``: what every
    repaired run must equal."""
    return pathlib.Path(compressed_tiny[1])


@pytest.fixture(scope="module")
def config_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("config") / "tiny.json"
    path.write_text(json.dumps(dataclasses.asdict(TINY)))
    return str(path)


def cli_error(argv, capsys, main=compress.main) -> str:
    """What a CLI prints for ``argv`` on standard error, checked to be an error message: exit code
    1, no traceback."""
    with pytest.raises(SystemExit) as exited:
        main(argv)
    err = capsys.readouterr().err
    assert exited.value.code == 1, err
    assert "Traceback" not in err and err.startswith("error: "), err
    return err


def test_unrelated_directory_is_refused_with_its_files_intact(
    tiny_setup, config_file, tmp_path, capsys
):
    output = tmp_path / "o"
    (output / "layers" / "exp1").mkdir(parents=True)
    (output / "dense").mkdir()
    (output / "layers" / "exp1" / "r.csv").write_text("r")
    (output / "dense" / "important.bin").write_text("w")
    err = cli_error(cli_flags(tiny_setup, output, config_file), capsys)
    assert (
        f"{output} is not empty and is not a qmoe_jax compressed checkpoint (it holds dense/, "
        "layers/)" in err
    )
    assert (output / "layers" / "exp1" / "r.csv").read_text() == "r"
    assert (output / "dense" / "important.bin").read_text() == "w"
    assert sorted(os.listdir(output)) == ["dense", "layers"]


def test_a_second_writer_is_refused_while_the_lock_is_held(
    tiny_setup, config_file, tmp_path, capsys
):
    output = tmp_path / "out"
    output.mkdir()
    with locked(str(output)):
        err = cli_error(cli_flags(tiny_setup, output, config_file), capsys)
    assert f"{output} is being written by qmoe_jax process {os.getpid()}" in err
    assert os.listdir(output) == [".qmoe_jax.lock"]


def test_interrupt_notes_where_to_resume_and_a_changed_source_is_refused(
    tiny_setup, tmp_path, monkeypatch
):
    source = tmp_path / "source"
    path = write_tiny_checkpoint(source, seed=0)
    run = options(tiny_setup, tmp_path / "out", checkpoint=path)
    write_layer = CompressedCheckpointWriter.write_layer

    def write_then_interrupt(writer, *args):
        write_layer(writer, *args)
        raise KeyboardInterrupt

    monkeypatch.setattr(CompressedCheckpointWriter, "write_layer", write_then_interrupt)
    with pytest.raises(KeyboardInterrupt) as interrupted:
        compress_checkpoint(run, **QUIET)
    assert interrupted.value.__notes__ == [
        "re-run the same command to resume from layer decoder.layers_1.mlp (1 of 2 sparse layers "
        "done)"
    ]
    monkeypatch.undo()

    manifest = (tmp_path / "out" / "manifest.json").read_text()
    shutil.rmtree(path)
    assert write_tiny_checkpoint(source, seed=1) == path  # another model at the same path
    with pytest.raises(
        ResumeRefusedError,
        match=f"the checkpoint at {re.escape(path)} changed since this run "
        "started.*choose a new --output_dir",
    ):
        compress_checkpoint(run, **QUIET)
    assert (tmp_path / "out" / "manifest.json").read_text() == manifest


def test_a_changed_setting_is_named(tiny_setup, reference, tmp_path):
    output = tmp_path / "out"
    shutil.copytree(reference, output)
    with pytest.raises(
        ResumeRefusedError,
        match="--num_samples was 24, now 32; --seed was 1, now 2; re-run with "
        "the checkpoint, tokenizer and settings it started with",
    ):
        compress_checkpoint(options(tiny_setup, output, num_samples=32, seed=2), **QUIET)


def test_the_tokenizer_is_compared_by_content_not_by_name():
    header = {
        "source": "a",
        "source_fingerprint": {"arrays": "1", "content": "2"},
        "tokenizer_sha256": "t",
        "model": {"d_model": 8},
        "settings": {"tokenizer": "spm.model", "seed": 1},
    }
    moved = dict(header, source="b", settings={"tokenizer": "copy.model", "seed": 1})
    assert header_differences(header, moved) == []
    assert header_differences(header, dict(header, tokenizer_sha256="u")) == [
        "the tokenizer spm.model changed since this run started"
    ]
    assert header_differences(header, dict(moved, model={"d_model": 16})) == [
        "the model config differs (d_model 8 -> 16)"
    ]


def write_with(directory, **changes) -> str:
    """The tiny model as a bfloat16 T5X checkpoint, with ``changes[path] = (index, value)``
    applied."""
    params = random_params(TINY)
    for path, (index, value) in changes.items():
        *parents, leaf = path.split("/")
        node = params
        for key in parents:
            node = node[key]
        node[leaf] = np.array(node[leaf])
        node[leaf][index] = value
    return write_t5x_checkpoint(str(directory), params, step=1, dtype="bfloat16")


def test_nonfinite_weights_are_refused_or_zeroed_and_counted(tiny_setup, tmp_path):
    nans = write_with(
        tmp_path / "nans", **{EXPERT_WI: ((1, slice(0, 3), 0), np.nan)}
    )  # expert 1: three NaNs
    output = tmp_path / "out"
    with pytest.raises(
        NonFiniteWeightsError,
        match=f"{EXPERT_WI}, expert 1, of the checkpoint .* holds 3 NaN or "
        "infinite values; .*--nonfinite zero",
    ):
        compress_checkpoint(options(tiny_setup, output, checkpoint=nans, verify="full"), **QUIET)
    before = CompressedCheckpoint(str(output))
    assert before.manifest["dense"] is None and not before.layer_names()  # found before any work

    infinity = write_with(
        tmp_path / "inf", **{EXPERT_WI: ((2, 0, 5), np.inf)}
    )  # expert 2, W's row 5, column 0
    report = compress_checkpoint(
        options(tiny_setup, output, checkpoint=infinity, nonfinite="zero"), **QUIET
    )
    assert report["nonfinite_zeroed"] == {f"{EXPERT_WI}[2]": 1}
    arrays = CompressedCheckpoint(str(output)).layer("encoder.layers_1.mlp")[0]
    minmax = np.asarray(arrays["wi"]["minmax"], np.float32)
    assert np.isfinite(minmax).all()
    assert minmax[2, 5, 1] > 0  # the row whose max was +inf keeps its positive weights

    dense = write_with(
        tmp_path / "nan_dense", **{"encoder/layers_0/attention/query/kernel": ((0, 0), np.nan)}
    )
    with pytest.raises(
        NonFiniteWeightsError, match="encoder/layers_0/attention/query/kernel of the checkpoint"
    ):
        compress_checkpoint(options(tiny_setup, tmp_path / "dense_out", checkpoint=dense), **QUIET)


def test_evaluate_reports_a_nonfinite_loss_as_an_error(
    tiny_setup, reference, tmp_path, capsys, monkeypatch
):
    c4 = tmp_path / "c4"
    c4.mkdir()
    write_c4_shard(
        c4 / "c4-validation.00000-of-00001.json.gz",
        [" ".join(synthetic_sentences(20, seed)) for seed in range(4)],
    )
    monkeypatch.setattr(evaluate, "mean_cross_entropy", lambda *args, **kwargs: float("nan"))
    err = cli_error(
        [
            "--checkpoint",
            str(reference),
            "--tokenizer",
            tiny_setup[2],
            "--c4",
            str(c4),
            "--num_samples",
            "2",
            "--inputs_length",
            "32",
        ],
        capsys,
        main=evaluate.main,
    )
    assert "validation loss" in err and "is nan" in err
    assert capsys.readouterr().out == ""  # no JSON line with NaN in it


def test_deleted_and_damaged_parts_are_repaired_bit_identically(tiny_setup, reference, tmp_path):
    output = tmp_path / "out"
    shutil.copytree(reference, output)
    shutil.rmtree(output / "dense")
    shutil.rmtree(output / "layers" / "decoder.layers_1.mlp")
    flip_bytes(
        output / "layers" / "encoder.layers_1.mlp" / "arrays"
    )  # same size: only its checksums can tell
    lines = []
    compress_checkpoint(options(tiny_setup, output), log=lines.append, progress=False, config=TINY)
    assert any(line.startswith("repairing dense/: ") for line in lines), lines
    assert any(line.startswith("repairing layer decoder.layers_1.mlp: ") for line in lines), lines
    assert any(
        line.startswith("encoder.layers_1.mlp: ") and "compressing it again" in line
        for line in lines
    ), lines
    assert CompressedCheckpoint(str(output)).complete
    assert_same_arrays(all_arrays(output), all_arrays(reference))
    repaired = flatten_dict(CompressedCheckpoint(str(output)).dense_params())
    original = flatten_dict(CompressedCheckpoint(str(reference)).dense_params())
    assert repaired.keys() == original.keys()
    for key in original:
        np.testing.assert_array_equal(
            np.asarray(repaired[key]), np.asarray(original[key]), err_msg=str(key)
        )


def test_the_advice_of_a_checksum_error_works_as_written(tiny_setup, reference, tmp_path):
    output = tmp_path / "out"
    shutil.copytree(reference, output)
    flip_bytes(output / "dense")
    with pytest.raises(CompressedCheckpointError) as damaged:
        load_compressed_model(str(output))
    advice = re.search(
        r"; delete (\S+) and re-run the same `python -m qmoe_jax.compress` command",
        str(damaged.value),
    )
    assert advice and advice.group(1) == str(output / "dense"), str(damaged.value)
    shutil.rmtree(advice.group(1))
    compress_checkpoint(options(tiny_setup, output), **QUIET)
    load_compressed_model(str(output))
    assert_same_arrays(all_arrays(output), all_arrays(reference))


def damaged_copy(source: str, tmp_path, damage) -> str:
    """A copy of the checkpoint ``source`` in which ``damage(array directory)`` hit encoder layer
    1's ``wo``."""
    copy = tmp_path / "checkpoint_1"
    shutil.copytree(source, copy)
    damage(copy / "target.encoder.layers_1.mlp.expert.wo.kernel")
    return str(copy)


def missing_chunk(array) -> None:
    os.remove(array / "3.0.0")


def wrong_shape(array) -> None:
    metadata = json.loads((array / ".zarray").read_text())
    metadata["shape"][1] += 1
    (array / ".zarray").write_text(json.dumps(metadata))


# what is wrong: (flag, its value from (tiny_setup, config file, tmp_path), the message)
BAD_INPUTS = {
    "plain file": (
        "--checkpoint",
        lambda setup, config, tmp: config,
        "is a file, not a T5X checkpoint: pass the checkpoint_<step> directory",
    ),
    "missing checkpoint": (
        "--checkpoint",
        lambda setup, config, tmp: str(tmp / "nowhere"),
        "is not a T5X checkpoint: expected a legacy T5X 'checkpoint' msgpack file",
    ),
    "missing chunk": (
        "--checkpoint",
        lambda setup, config, tmp: damaged_copy(setup[0], tmp, missing_chunk),
        "is incomplete: chunk files of encoder/layers_1/mlp/expert/wo/kernel are missing",
    ),
    "wrong .zarray shape": (
        "--checkpoint",
        lambda setup, config, tmp: damaged_copy(setup[0], tmp, wrong_shape),
        "its zarr metadata says (4, 65, 32) bfloat16 but the msgpack spec says (4, 64, 32)",
    ),
    "missing tokenizer": (
        "--tokenizer",
        lambda setup, config, tmp: str(tmp / "spm.model"),
        "does not exist",
    ),
    "missing calibration text": (
        "--calibration",
        lambda setup, config, tmp: "text:/nowhere/*.txt",
        "no text files match",
    ),
    "other config": (
        "--config",
        lambda setup, config, tmp: "switch-base-8",
        "does not match the config switch-base-8",
    ),
}


@pytest.mark.parametrize("bad", list(BAD_INPUTS))
def test_bad_inputs_are_refused_before_any_work(bad, tiny_setup, config_file, tmp_path, capsys):
    flag, value, message = BAD_INPUTS[bad]
    output = tmp_path / "out"
    flags = cli_flags(tiny_setup, output, config_file)
    flags[flags.index(flag) + 1] = value(tiny_setup, config_file, tmp_path)
    assert message in cli_error(flags, capsys)
    assert not output.exists()


@pytest.mark.slow
def test_errors_are_one_line_unless_debugging(tmp_path):
    argv = [
        "-m",
        "qmoe_jax.compress",
        "--checkpoint",
        str(tmp_path / "nowhere"),
        "--output_dir",
        str(tmp_path / "o"),
    ]
    short = run_python(argv, timeout=300)
    assert short.returncode == 1, short.stderr
    assert short.stderr.startswith("error: ") and len(short.stderr.strip().splitlines()) == 1, (
        short.stderr
    )
    debug = run_python(argv, timeout=300, QMOE_JAX_DEBUG="1")
    assert debug.returncode == 1 and "Traceback" in debug.stderr and "error: " in debug.stderr


def read_until(process, text: str, timeout: float) -> str:
    """The child's output up to the first line that contains ``text``."""
    output, deadline = b"", time.time() + timeout
    while text.encode() not in output:
        assert process.poll() is None and time.time() < deadline, output.decode()
        if select.select([process.stdout], [], [], 1.0)[0]:
            output += os.read(process.stdout.fileno(), 65536)
    return output.decode()


@pytest.mark.parametrize(
    "signal_number, code",
    [(signal.SIGINT, 130), pytest.param(signal.SIGTERM, 143, marks=pytest.mark.slow)],
)
def test_interrupts_say_how_to_resume(signal_number, code, tiny_setup, config_file, tmp_path):
    process = popen_python(
        ["-m", "qmoe_jax.compress"] + cli_flags(tiny_setup, tmp_path / "out", config_file)
    )
    try:
        read_until(process, "calibration samples", timeout=300)
        process.send_signal(signal_number)
        output = process.communicate(timeout=300)[0].decode()
    finally:
        process.kill()
    assert process.returncode == code, output
    assert re.fullmatch(
        r"interrupted; re-run the same command to resume from layer \S+\.mlp \([01] of 2 sparse "
        r"layers done\)",
        output.strip().splitlines()[-1],
    ), output
    assert "Traceback" not in output
