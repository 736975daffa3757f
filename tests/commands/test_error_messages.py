"""Errors say what is wrong and what to do, in one line, and never ask for the impossible
(docs/recovery.md, "Reading an error")."""

import json
import os
import shutil

import pytest

from qmoe_jax import compress, evaluate, generate
from qmoe_jax.checkpoints.format_v1 import CompressedCheckpointError
from qmoe_jax.inference import model_directory, open_model
from qmoe_jax.inference.compressed_params import load_compressed_model
from qmoe_jax.interop import eval_run, t5x_export
from qmoe_jax.training import run_directory


def one_line_error(main, argv, capsys) -> str:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    err = capsys.readouterr().err
    assert exited.value.code == 1, err
    assert err.startswith("error: ") and len(err.strip().splitlines()) == 1, err
    return err


@pytest.mark.parametrize("main", [compress.main, evaluate.main])
def test_a_wrong_config_is_one_line_naming_the_config_that_fits(main, tmp_path, capsys):
    """The bundled model is switch-mini-8."""
    argv = ["--config", "switch-base-8"]
    if main is compress.main:
        argv += ["--output_dir", str(tmp_path / "out")]
    err = one_line_error(main, argv, capsys)
    assert "does not match the config switch-base-8: " in err
    assert "arrays differ, e.g. " in err and "likely cause: " in err
    assert err.strip().endswith(
        "its shapes fit the config switch-mini-8: pass --config switch-mini-8, or leave --config "
        "out to infer it"
    )
    assert not (tmp_path / "out").exists()


def test_a_config_that_no_registered_one_fits_says_so(compressed_tiny, capsys):
    checkpoint, _, tokenizer = compressed_tiny
    err = one_line_error(
        generate.main,
        ["--checkpoint", checkpoint, "--config", "switch-mini-8", "--prompt", "a"]
        + ["--tokenizer", tokenizer.model_path],
        capsys,
    )
    assert "does not match the config switch-mini-8" in err
    assert err.strip().endswith("no registered config fits its shapes")


@pytest.mark.parametrize(
    "part, advice",
    [
        ("dense", "rewrites it from the source checkpoint"),
        ("layers/decoder.layers_1.mlp", "recomputes that layer"),
    ],
)
def test_a_missing_part_is_not_to_be_deleted_again(compressed_tiny, part, advice, tmp_path):
    output = tmp_path / "out"
    shutil.copytree(compressed_tiny[1], output)
    shutil.rmtree(output / part)
    with pytest.raises(CompressedCheckpointError) as missing:
        load_compressed_model(str(output))
    assert str(missing.value) == (
        f"{output / part} is missing; re-run the same `python -m qmoe_jax.compress` command that "
        f"wrote it, which {advice}"
    )


def test_the_markers_named_for_other_outputs_are_theirs():
    assert run_directory.FINETUNE_OUTPUT.marker == model_directory.FINETUNE_FORMAT
    assert t5x_export.EXPORT_OUTPUT.marker == model_directory.EXPORT_FORMAT
    assert eval_run.EVAL_OUTPUT.marker == model_directory.EVALUATION_FORMAT


def fine_tuning_run(directory, complete: bool) -> str:
    """A fine-tuning run directory as ``RunDirectory`` leaves it (manifest and model), without
    training."""
    os.makedirs(directory)
    manifest = {
        "format": run_directory.FORMAT,
        "format_version": run_directory.FORMAT_VERSION,
        "settings": {},
        "source": {},
        "complete": complete,
        "model": "model" if complete else None,
    }
    with open(os.path.join(directory, "manifest.json"), "w") as f:
        json.dump(manifest, f)
    return str(directory)


def test_evaluate_on_a_fine_tuning_run_points_to_its_model(tmp_path, capsys):
    run = fine_tuning_run(tmp_path / "run", complete=True)
    err = one_line_error(evaluate.main, ["--checkpoint", run], capsys)
    assert (
        f"{run} is a fine-tuning run directory, not a model; its fine-tuned model is {run}/model: "
        f"pass --checkpoint {run}/model"
    ) in err
    unfinished = fine_tuning_run(tmp_path / "unfinished", complete=False)
    with pytest.raises(model_directory.NotAModelError, match="re-run the same `python -m"):
        open_model(unfinished)
