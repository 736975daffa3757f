"""python -m qmoe_jax.export: a compressed checkpoint as a dequantized bfloat16 T5X checkpoint.

The last test runs stock t5x.eval (google-research/t5x with flaxformer) on an
export; it needs an environment where ``import t5x, flaxformer`` works (docs/gin.md
§9 says how to build one) and is skipped elsewhere (``t5x`` marker).
"""

import json
import re
import subprocess
import sys

import jax
import ml_dtypes
import numpy as np
import pytest
from flax import traverse_util
from helpers.child_process import child_env
from helpers.json_lines import read_json_lines
from helpers.t5x_env import main_job_output, missing_reason, source_roots

from qmoe_jax import evaluate as evaluate_cli
from qmoe_jax import export as export_cli
from qmoe_jax.checkpoints import open_t5x_checkpoint
from qmoe_jax.checkpoints.output_dir import OutputDirectoryError
from qmoe_jax.data import Tokenizer, bundled
from qmoe_jax.inference import open_model, validation_set
from qmoe_jax.inference.compressed_params import load_compressed_model
from qmoe_jax.inference.scoring import score_examples
from qmoe_jax.interop.gin_flags import CONFIGS_DIR
from qmoe_jax.interop.t5x_export import export_t5x


def flat(tree):
    return {
        path: np.asarray(value) for path, value in traverse_util.flatten_dict(tree, sep="/").items()
    }


@pytest.mark.parametrize("format", ["legacy", "orbax"])
def test_export_holds_the_dequantized_model_in_bfloat16(compressed_tiny, tmp_path, format):
    _, directory, _ = compressed_tiny
    written = export_t5x(directory, str(tmp_path / "export"), format, log=lambda _: None)
    assert written.rstrip("/").endswith("checkpoint_1")  # the source's step
    manifest = json.loads((tmp_path / "export" / "manifest.json").read_text())
    assert (manifest["format"], manifest["step"], manifest["t5x_format"]) == (
        "qmoe_jax.t5x_export",
        1,
        format,
    )
    checkpoint = open_t5x_checkpoint(written)
    assert checkpoint.step == 1
    stored = flat(checkpoint.read_params(checkpoint.keys()))
    expected = flat(jax.device_get(load_compressed_model(directory, experts="dense").params))
    assert sorted(stored) == sorted(expected)
    for path, array in stored.items():
        assert array.dtype == ml_dtypes.bfloat16, path
        np.testing.assert_array_equal(
            array, expected[path].astype(ml_dtypes.bfloat16), err_msg=path
        )
    # Ternary weights are 0 or a row's bfloat16 min or max, so the experts survive bfloat16 exactly.
    kernel = "encoder/layers_1/mlp/expert/wi/kernel"
    np.testing.assert_array_equal(stored[kernel].astype(np.float32), expected[kernel])


def test_export_cli_follows_the_output_rules(compressed_tiny, tmp_path, capsys):
    _, directory, _ = compressed_tiny
    out = tmp_path / "export"
    export_cli.main(["--checkpoint", directory, "--output_dir", str(out)])
    assert capsys.readouterr().out.strip().rstrip("/").endswith("checkpoint_1")
    for argv, message in [
        (["--checkpoint", directory, "--output_dir", str(out)], "checkpoint_1 already exists"),
        (
            ["--checkpoint", str(out / "checkpoint_1"), "--output_dir", str(tmp_path / "x")],
            "needs no export",
        ),
        (
            ["--checkpoint", directory, "--output_dir", str(tmp_path / "x"), "--format", "zarr3"],
            "invalid choice",
        ),
    ]:
        with pytest.raises(SystemExit):
            export_cli.main(argv)
        assert message in capsys.readouterr().err
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "notes.txt").write_text("keep")
    with pytest.raises(OutputDirectoryError, match="is not empty"):
        export_t5x(directory, str(tmp_path / "foreign"), log=lambda _: None)
    assert (tmp_path / "foreign" / "notes.txt").read_text() == "keep"


@pytest.mark.slow
@pytest.mark.t5x
@pytest.mark.skipif(missing_reason() is not None, reason=str(missing_reason()))
def test_stock_t5x_eval_scores_the_export_as_the_compressed_model(tmp_path):
    """Exports the README main job's output, runs ``python -m t5x.eval`` on it with configs/t5x/,
    and compares its per-example scores with qmoe_jax's fused-kernel scores of the compressed
    checkpoint."""
    compressed = main_job_output()
    written = export_t5x(compressed, str(tmp_path / "export"), log=lambda _: None)
    examples = 64
    flaxformer_root, _ = source_roots()
    command = [
        sys.executable,
        "-m",
        "t5x.eval",
        f"--gin_search_paths={flaxformer_root},{CONFIGS_DIR}",
        "--gin_file=t5x/switch_mini_8_eval.gin",
        f"--gin.CHECKPOINT_PATH='{written.rstrip('/')}'",
        f"--gin.EVAL_OUTPUT_DIR='{tmp_path / 't5x_eval'}'",
        f"--gin.VOCABULARY_FILE='{bundled.tokenizer_path()}'",
        "--gin.MIXTURE_OR_TASK_NAME='qmoe_span_corruption'",
        f"--gin.QMOE_NUM_EXAMPLES={examples}",
    ]
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=900, cwd=str(tmp_path), env=child_env()
    )
    assert result.returncode == 0, result.stderr[-4000:]
    out = tmp_path / "t5x_eval" / "inference_eval"
    metrics = read_json_lines(out / "qmoe_span_corruption-metrics.jsonl")
    records = read_json_lines(out / "qmoe_span_corruption-006000.jsonl")
    assert metrics[0]["step"] == 6000 and len(records) == examples
    t5x_scores = np.array([r["score"] for r in records])

    model = open_model(compressed)  # fused kernels
    found = validation_set("bundled", Tokenizer(bundled.tokenizer_path()), examples)
    assert [r["input"]["targets"] for r in records] == [t.tolist() for _, t in found.examples]
    ours = score_examples(
        model.module, model.params, found.examples, 32, found.encoder_length, found.decoder_length
    )
    np.testing.assert_allclose(t5x_scores, ours.log_likelihoods, rtol=1e-4)
    assert metrics[0]["mean_log_likelihood"] == pytest.approx(ours.log_likelihoods.mean(), rel=1e-4)
    print(
        f"span corruption, t5x.eval: {json.dumps(metrics[0])}; qmoe_jax compressed: mean "
        "log-likelihood "
        f"{ours.log_likelihoods.mean():.6f}; largest per-example difference "
        f"{np.abs(t5x_scores - ours.log_likelihoods).max():.2e}"
    )

    # A JSON-lines task, tokenized by seqio in T5X and by qmoe_jax here: same ids, scores and greedy
    # predictions.
    jsonl = tmp_path / "pairs.jsonl"
    jsonl.write_text(
        "".join(
            json.dumps({"inputs": a, "targets": b}) + "\n"
            for a, b in [
                (
                    "To be, or not to be, that is the question.",
                    "Whether tis nobler in the mind to suffer",
                ),
                (
                    "Friends, Romans, countrymen, lend me your ears.",
                    "I come to bury Caesar, not to praise him.",
                ),
                ("What's in a name?", "That which we call a rose"),
            ]
        )
    )
    lengths = "--gin.TASK_FEATURE_LENGTHS={'inputs': 32, 'targets': 16}"
    command = command[:-2] + [
        lengths,
        "--gin.MIXTURE_OR_TASK_NAME='qmoe_jsonl_seq2seq'",
        f"--gin.QMOE_JSONL_FILE='{jsonl}'",
    ]
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=900, cwd=str(tmp_path), env=child_env()
    )
    assert result.returncode == 0, result.stderr[-4000:]
    theirs = read_json_lines(out / "qmoe_jsonl_seq2seq-006000.jsonl")
    evaluate_cli.evaluate(
        [
            "--gin_file=runs/eval.gin",
            "--gin_file=models/switch_mini_8.gin",
            f"--gin.CHECKPOINT_PATH='{compressed}'",
            f"--gin.EVAL_OUTPUT_DIR='{tmp_path / 'ours'}'",
            "--gin.MIXTURE_OR_TASK_NAME='jsonl_seq2seq'",
            f"--gin.JSONL_FILE='{jsonl}'",
            lengths,
        ]
    )
    mine = read_json_lines(tmp_path / "ours" / "inference_eval" / "jsonl_seq2seq-006000.jsonl")
    assert [t["input"]["targets"] for t in theirs] == [m["input"]["targets"] for m in mine]
    np.testing.assert_allclose([t["score"] for t in theirs], [m["score"] for m in mine], rtol=1e-4)
    # seqio's decoder puts spaces around sentinels, qmoe_jax's does not.

    def unspaced(text):
        return re.sub(r"\s*(<extra_id_\d+>)\s*", r"\1", text)

    assert [unspaced(t["prediction"]) for t in theirs] == [unspaced(m["prediction"]) for m in mine]
    print(
        f"seq2seq, t5x.eval: {[round(t['score'], 4) for t in theirs]}; qmoe_jax compressed: "
        f"{[round(m['score'], 4) for m in mine]}; predictions equal"
    )
