"""Gin-driven evaluation (python -m qmoe_jax.evaluate --gin_file ...): T5X's flags, tasks, output
layout, errors."""

import dataclasses
import itertools
import json
import os
import subprocess
import sys

import gin
import numpy as np
import pytest
from helpers.child_process import TESTS_DIR, child_env
from helpers.gin_runs import span_corruption_flags, write_tiny_gin
from helpers.json_lines import read_json_lines
from helpers.switch_fixtures import write_c4_shard, write_calibration_text
from helpers.text import synthetic_sentences

from qmoe_jax import evaluate as evaluate_cli
from qmoe_jax.checkpoints.output_dir import OutputDirectoryError
from qmoe_jax.inference import open_model, validation_set
from qmoe_jax.inference.generation import generate_texts
from qmoe_jax.inference.scoring import score_examples
from qmoe_jax.inference.strategies import DecodingConfig
from qmoe_jax.interop import gin_eval  # noqa: F401  (registers the configurables)
from qmoe_jax.interop.gin_flags import CONFIGS_DIR
from qmoe_jax.models import config_names, get_config


@pytest.fixture(scope="module")
def setup(compressed_tiny, tmp_path_factory):
    """(compressed dir, gin folder with tiny.gin, text glob, jsonl file, tokenizer)."""
    _, directory, tokenizer = compressed_tiny
    root = tmp_path_factory.mktemp("gin")
    write_tiny_gin(root / "tiny.gin")
    text = write_calibration_text(root / "validation.txt", sentences=300, seed=7)
    jsonl = root / "pairs.jsonl"
    sentences = synthetic_sentences(10, seed=3)
    jsonl.write_text(
        "".join(
            json.dumps({"inputs": a, "targets": b}) + "\n" for a, b in itertools.pairwise(sentences)
        )
    )
    return directory, str(root), text, str(jsonl), tokenizer


def run(setup, output_dir, *extra, task="text_span_corruption"):
    directory, root, text, jsonl, tokenizer = setup
    argv = span_corruption_flags(
        directory, root, text, tokenizer.model_path, output_dir, task=task
    ) + [f"--gin.JSONL_FILE='{jsonl}'", *extra]
    evaluate_cli.evaluate(argv)


@pytest.mark.slow
def test_span_corruption_writes_t5x_layout_and_dense_matches_compressed(setup, tmp_path):
    directory, _, text, _, tokenizer = setup
    out = tmp_path / "eval"
    run(setup, out)
    run(setup, out, "--gin.EXPERTS='dense'")
    config = (out / "config.gin").read_text()
    assert (
        "CHECKPOINT_PATH = " in config
        and "EXPERTS = 'dense'" in config
        and "qmoe_jax.SwitchConfig" in config
    )
    metrics = read_json_lines(out / "inference_eval" / "text_span_corruption-metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 1]  # the source checkpoint_1, one line per run
    compressed, dense = (m["loss"] for m in metrics)
    assert abs(compressed - dense) < 1e-4
    examples = read_json_lines(out / "inference_eval" / "text_span_corruption-000001.jsonl")
    assert len(examples) == metrics[0]["examples"] == 20
    assert set(examples[0]) == {"input", "target", "score"} and set(examples[0]["input"]) == {
        "inputs",
        "targets",
    }
    # The per-example scores are the target log-likelihoods; their length-weighted mean is the
    # library's loss.
    scores = np.array([e["score"] for e in examples])
    lengths = np.array([len(e["input"]["targets"]) for e in examples])
    assert (scores < 0).all() and abs(-scores.sum() / lengths.sum() - dense) < 1e-5
    opened = open_model(directory, experts="dense")
    found = validation_set(f"text:{text}", tokenizer, 20, 32)
    assert [e["input"]["targets"] for e in examples] == [t.tolist() for _, t in found.examples]
    expected = score_examples(
        opened.module, opened.params, found.examples, 8, 32, found.decoder_length
    )
    np.testing.assert_allclose(scores, expected.log_likelihoods, rtol=1e-5)


@pytest.mark.slow
def test_seq2seq_task_scores_and_predicts(setup, tmp_path):
    directory, _, _, jsonl, tokenizer = setup
    out = tmp_path / "eval"
    run(setup, out, "--gin.TASK_FEATURE_LENGTHS=None", task="jsonl_seq2seq")
    (metrics,) = read_json_lines(out / "inference_eval" / "jsonl_seq2seq-metrics.jsonl")
    assert set(metrics) == {
        "step",
        "exact_match",
        "loss",
        "examples",
        "target_tokens",
        "mean_log_likelihood",
    }
    assert metrics["examples"] == 9 and 0 <= metrics["exact_match"] <= 100
    examples = read_json_lines(out / "inference_eval" / "jsonl_seq2seq-000001.jsonl")
    pairs = read_json_lines(jsonl)
    assert [e["input"]["inputs_pretokenized"] for e in examples] == [p["inputs"] for p in pairs]
    assert [e["target"] for e in examples] == [p["targets"] for p in pairs]
    assert all(e["score"] < 0 and e["output"] == e["prediction"] for e in examples)
    assert metrics["exact_match"] == pytest.approx(
        100 * np.mean([e["prediction"] == e["target"] for e in examples])
    )
    # Predictions are greedy decoding of the compressed model, as python -m qmoe_jax.generate gives
    # them.
    opened = open_model(directory)
    decoder_length = -(-max(len(e["input"]["targets"]) for e in examples) // 8) * 8
    generated = generate_texts(
        opened.module,
        opened.params,
        tokenizer,
        [p["inputs"] for p in pairs],
        DecodingConfig(max_decode_length=decoder_length),
        batch_size=8,
        inputs_length=-(-max(len(e["input"]["inputs"]) for e in examples) // 8) * 8,
    )
    assert [g.text for g in generated] == [e["prediction"] for e in examples]


@pytest.mark.slow
def test_mixture_from_a_user_gin_file_and_flag_precedence(setup, tmp_path):
    (tmp_path / "mine.gin").write_text(
        "BATCH_SIZE = 2\n"
        "qmoe_jax.evaluate.extra_tasks = [@both/qmoe_jax.Mixture()]\n"
        "both/qmoe_jax.Mixture.name = 'both'\n"
        "both/qmoe_jax.Mixture.tasks = ['text_span_corruption', 'jsonl_seq2seq']\n"
    )
    out = tmp_path / "eval"
    run(setup, out, f"--gin_file={tmp_path / 'mine.gin'}", task="both")
    written = sorted(os.listdir(out / "inference_eval"))
    assert written == [
        "jsonl_seq2seq-000001.jsonl",
        "jsonl_seq2seq-metrics.jsonl",
        "text_span_corruption-000001.jsonl",
        "text_span_corruption-metrics.jsonl",
    ]
    # Files parse first, then bindings: run()'s --gin.BATCH_SIZE=8 wins over mine.gin's 2.
    assert "BATCH_SIZE = 8" in (out / "config.gin").read_text()


def test_c4_task_reads_the_validation_shards_and_names_its_macro(setup, tmp_path, capsys):
    c4 = tmp_path / "c4"
    c4.mkdir()
    write_c4_shard(c4 / "c4-validation.00000-of-00008.json.gz", synthetic_sentences(200, seed=5))
    write_c4_shard(c4 / "c4-train.00000-of-01024.json.gz", ["never read"] * 10)
    out = tmp_path / "eval"
    run(
        setup,
        out,
        f"--gin.C4_DIR='{c4}'",
        "--gin_bindings=c4_span_corruption/qmoe_jax.SpanCorruptionTask.num_examples = 4",
        task="c4_span_corruption",
    )
    (metrics,) = read_json_lines(out / "inference_eval" / "c4_span_corruption-metrics.jsonl")
    assert metrics["examples"] == 4 and metrics["loss"] > 0
    with pytest.raises(ValueError, match="C4_DIR"):
        run(setup, tmp_path / "other", task="c4_span_corruption")


@gin.configurable("take_model")
def take_model(model=gin.REQUIRED):
    return model


@pytest.mark.parametrize("name", config_names())
def test_every_model_gin_builds_its_named_config(name):
    gin.clear_config()
    try:
        gin.parse_config_files_and_bindings(
            [os.path.join(CONFIGS_DIR, "models", name.replace("-", "_") + ".gin")],
            ["take_model.model = %MODEL"],
        )
        built = take_model()
    finally:
        gin.clear_config()
    expected = get_config(name)
    assert built.dtype == "float32"
    assert (
        dataclasses.replace(
            built,
            checkpoint_path=expected.checkpoint_path,
            checkpoint_step=expected.checkpoint_step,
        )
        == expected
    )


def error_of(argv, capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        evaluate_cli.main(argv)
    assert exit_info.value.code == 1
    return capsys.readouterr().err


def test_bad_gin_input_names_the_problem_and_the_file(setup, compressed_tiny, tmp_path, capsys):
    directory, root, text, _, tokenizer = setup
    t5x_checkpoint = compressed_tiny[0]
    base = [
        "--gin_file=runs/eval.gin",
        "--gin_file=tiny.gin",
        f"--gin_search_paths={root}",
        f"--gin.CHECKPOINT_PATH='{directory}'",
        f"--gin.EVAL_OUTPUT_DIR='{tmp_path / 'out'}'",
        f"--gin.TOKENIZER='{tokenizer.model_path}'",
        f"--gin.TEXT_FILES='{text}'",
    ]
    named = base + ["--gin.MIXTURE_OR_TASK_NAME='text_span_corruption'"]

    err = error_of(base, capsys)
    assert "missing required gin macro MIXTURE_OR_TASK_NAME" in err and "runs/eval.gin:" in err

    err = error_of(base + ["--gin.MIXTURE_OR_TASK_NAME='no_such_task'"], capsys)
    assert "unknown task or mixture 'no_such_task'" in err and "--gin.MIXTURE_OR_TASK_NAME" in err
    assert "bundled_span_corruption" in err and "builtin.gin" in err

    err = error_of(named + ["--gin.NO_SUCH_MACRO=1"], capsys)
    assert "unknown gin macro NO_SUCH_MACRO" in err and "--gin.NO_SUCH_MACRO" in err

    (tmp_path / "typo.gin").write_text(
        "BATCH_SIZE = 4\nqmoe_jax.evaluate.batch_size = %BATCH_SIZ\n"
    )
    err = error_of(named + [f"--gin_file={tmp_path / 'typo.gin'}"], capsys)
    assert "unknown gin macro %BATCH_SIZ" in err and "typo.gin:2" in err

    (tmp_path / "unknown.gin").write_text("\nqmoe_jax.NoSuchThing.x = 1\n")
    err = error_of(named + [f"--gin_file={tmp_path / 'unknown.gin'}"], capsys)
    assert (
        "No configurable matching 'qmoe_jax.NoSuchThing'" in err
        and "unknown.gin" in err
        and "line 2" in err
    )

    err = error_of(named + ["--gin_file=models/nope.gin"], capsys)
    assert "gin file 'models/nope.gin' not found" in err

    # The bundled model's gin on the tiny checkpoint: each differing shape is named, with the file.
    err = error_of(
        ["--gin_file=runs/eval.gin", "--gin_file=models/switch_mini_8.gin"] + named[2:], capsys
    )
    assert (
        "switch_mini_8.gin" in err and "EMBED_DIM (d_model) is 128 in the gin config but 32" in err
    )
    err = error_of(
        [
            "--gin_file=runs/eval.gin",
            "--gin_file=models/switch_mini_8.gin",
            f"--gin.CHECKPOINT_PATH='{t5x_checkpoint}'",
            "--gin.EXPERTS='dense'",
        ]
        + named[4:],
        capsys,
    )
    assert "switch_mini_8.gin) disagrees with" in err and "has shape (32,) in the checkpoint" in err
    assert not (tmp_path / "out").exists()  # nothing is written before the input is checked

    err = error_of(
        [arg for arg in named if not arg.startswith("--gin.TOKENIZER")], capsys
    )  # the bundled tokenizer
    assert "has 4100 ids but the model" in err and "embeds only 192" in err and "TOKENIZER" in err

    err = error_of(named + ["--gin.TASK_FEATURE_LENGTHS={'inputs': 32, 'target': 8}"], capsys)
    assert "TASK_FEATURE_LENGTHS has unknown features ['target']" in err

    err = error_of(["--gin.EXPERTS='dense'"], capsys)
    assert "--gin.EXPERTS needs --gin_file" in err


def test_refuses_an_output_directory_it_does_not_own(setup, tmp_path):
    (tmp_path / "other.txt").write_text("not ours")
    with pytest.raises(
        OutputDirectoryError, match="is not empty and is not a qmoe_jax evaluation output directory"
    ):
        run(setup, tmp_path)
    assert (tmp_path / "other.txt").read_text() == "not ours"


@pytest.mark.slow
def test_readme_command_on_the_main_job_output(tmp_path):
    """The README's gin command, run from the repository root on the main job's output, then with
    dense experts, gives the loss of the plain `python -m qmoe_jax.evaluate --checkpoint` to 1e-4.
    """
    repo = os.path.dirname(TESTS_DIR)
    compressed = os.path.join("runs", "compressed", "switch-mini-8")
    if not os.path.isfile(os.path.join(repo, compressed, "manifest.json")):
        pytest.skip(
            f"{compressed} is missing: run the README's main job (python -m qmoe_jax.compress) "
            "first"
        )
    out = tmp_path / "eval"
    command = [
        sys.executable,
        "-m",
        "qmoe_jax.evaluate",
        "--gin_file=runs/eval.gin",
        "--gin_file=models/switch_mini_8.gin",
        f"--gin.CHECKPOINT_PATH='{compressed}'",
        f"--gin.EVAL_OUTPUT_DIR='{out}'",
        "--gin.MIXTURE_OR_TASK_NAME='bundled_span_corruption'",
    ]
    for extra in ([], ["--gin.EXPERTS='dense'"]):
        result = subprocess.run(
            command + extra, cwd=repo, env=child_env(), capture_output=True, text=True, timeout=900
        )
        assert result.returncode == 0, result.stderr[-3000:]
    assert "MIXTURE_OR_TASK_NAME = 'bundled_span_corruption'" in (out / "config.gin").read_text()
    compressed_line, dense_line = read_json_lines(
        out / "inference_eval" / "bundled_span_corruption-metrics.jsonl"
    )
    assert (
        compressed_line["step"] == 6000 and abs(compressed_line["loss"] - dense_line["loss"]) < 1e-4
    )
    assert (
        len(read_json_lines(out / "inference_eval" / "bundled_span_corruption-006000.jsonl"))
        == dense_line["examples"]
    )
    plain = subprocess.run(
        [sys.executable, "-m", "qmoe_jax.evaluate", "--checkpoint", compressed],
        cwd=repo,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert plain.returncode == 0, plain.stderr[-3000:]
    assert abs(json.loads(plain.stdout)["validation_loss"] - compressed_line["loss"]) < 1e-5
