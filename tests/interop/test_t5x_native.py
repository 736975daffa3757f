"""Stock t5x.eval, t5x.infer and t5x.train on the README main job's compressed checkpoint, with
configs/t5x/: no export, the experts on the fused kernels inside T5X.

Each test runs T5X's own command line in a child process, on qmoe_jax's
span-corruption task and on a user's seqio task (``helpers/t5x_user_tasks.py``),
and compares with qmoe_jax's own evaluation of the same examples.
"""

import hashlib
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
from helpers.child_process import child_env
from helpers.json_lines import read_json_lines
from helpers.t5x_env import main_job_output, skip_without_t5x, source_roots

skip_without_t5x()

from qmoe_jax import evaluate as evaluate_cli  # noqa: E402
from qmoe_jax.data import Tokenizer, bundled  # noqa: E402
from qmoe_jax.inference import open_model, validation_set  # noqa: E402
from qmoe_jax.inference.scoring import score_examples  # noqa: E402
from qmoe_jax.interop.gin_flags import CONFIGS_DIR  # noqa: E402

pytestmark = [pytest.mark.t5x, pytest.mark.slow]

SPAN = "qmoe_span_corruption"
USER = "user_quotes"
MIXTURE = "user_quotes_and_span_corruption"
EXAMPLES = 64
STEP = 6000
LENGTHS = {"inputs": 128, "targets": 32}
PAIRS = [
    ("To be, or not to be, that is the question.", "Whether tis nobler in the mind to suffer"),
    (
        "Friends, Romans, countrymen, lend me your ears.",
        "I come to bury Caesar, not to praise him.",
    ),
    ("What's in a name?", "That which we call a rose"),
    ("Now is the winter of our discontent", "Made glorious summer by this sun of York"),
    ("All the world's a stage,", "And all the men and women merely players"),
    ("If music be the food of love, play on;", "Give me excess of it"),
    ("Once more unto the breach, dear friends,", "Or close the wall up with our English dead."),
    ("The quality of mercy is not strained;", "It droppeth as the gentle rain from heaven"),
]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(compressed directory, working folder with the user task's data and its JSON-lines twin)."""
    compressed = main_job_output()
    work = tmp_path_factory.mktemp("t5x_native")
    data = work / "data"
    data.mkdir()
    for split in ("train", "validation", "test"):
        (data / f"{split}.tsv").write_text("".join(f"{a}\t{b}\n" for a, b in PAIRS))
    (work / "pairs.jsonl").write_text(
        "".join(json.dumps({"inputs": a, "targets": b}) + "\n" for a, b in PAIRS)
    )
    return compressed, work


def run_t5x(script: str, gin_file: str, bindings: dict, work, devices: int = 1, more_gin=()):
    """``python -m t5x.<script>`` with qmoe_jax's gin file, T5X's flags and a user task module."""
    flaxformer_root, t5x_root = source_roots()
    command = [
        sys.executable,
        "-m",
        f"t5x.{script}",
        f"--gin_search_paths={flaxformer_root},{t5x_root},{CONFIGS_DIR}",
        f"--gin_file={gin_file}",
        *(f"--gin_file={path}" for path in more_gin),
        f"--gin.VOCABULARY_FILE='{bundled.tokenizer_path()}'",
        "--gin.MIXTURE_OR_TASK_MODULE='helpers.t5x_user_tasks'",
        f"--gin.TASK_FEATURE_LENGTHS={LENGTHS}",
        *(f"--gin.{name}={value}" for name, value in bindings.items()),
    ]
    env = child_env(QMOE_USER_TASK_DATA=str(work / "data"))
    if devices > 1:
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=1800, cwd=str(work), env=env
    )
    assert result.returncode == 0, result.stderr[-6000:]
    return result


def tree_digest(directory: str) -> dict[str, str]:
    """SHA-256 of every file under ``directory``."""
    digests = {}
    for folder, _, files in os.walk(directory):
        for name in files:
            path = os.path.join(folder, name)
            with open(path, "rb") as f:
                digests[os.path.relpath(path, directory)] = hashlib.sha256(f.read()).hexdigest()
    return digests


def t5x_eval(setup, name: str, checkpoint: str, devices: int = 1, task: str = MIXTURE):
    _, work = setup
    out = work / name
    bindings = {
        "CHECKPOINT_PATH": f"'{checkpoint}'",
        "EVAL_OUTPUT_DIR": f"'{out}'",
        "MIXTURE_OR_TASK_NAME": f"'{task}'",
        "QMOE_NUM_EXAMPLES": EXAMPLES,
    }
    if devices > 1:
        # T5X's default CPU mesh puts every device on its model axis; a one-device model
        # submesh makes them data devices, which T5X's MoE partitioner turns into expert devices.
        bindings.update({"MODEL_PARALLEL_SUBMESH": "(1, 1, 1, 1)", "NUM_MODEL_PARTITIONS": None})
    result = run_t5x("eval", "t5x/switch_mini_8_compressed_eval.gin", bindings, work, devices)
    return out / "inference_eval", result


@pytest.fixture(scope="module")
def one_device(setup):
    """t5x.eval of the mixture on the compressed checkpoint, and the checkpoint's files before."""
    compressed, _ = setup
    before = tree_digest(compressed)
    # T5X names a checkpoint by its step: <compressed dir>/checkpoint_<step> is the directory.
    out, _ = t5x_eval(setup, "eval_1_device", os.path.join(compressed, f"checkpoint_{STEP}"))
    return out, before


def qmoe_scores(checkpoint: str) -> np.ndarray:
    """qmoe_jax's fused-kernel scores of the span-corruption examples T5X evaluates."""
    model = open_model(checkpoint)
    found = validation_set("bundled", Tokenizer(bundled.tokenizer_path()), EXAMPLES)
    scored = score_examples(
        model.module, model.params, found.examples, 32, found.encoder_length, found.decoder_length
    )
    return found, scored.log_likelihoods


def unspaced(text: str) -> str:
    """seqio's decoder puts spaces around sentinels, qmoe_jax's does not."""
    return re.sub(r"\s*(<extra_id_\d+>)\s*", r"\1", text)


def test_t5x_eval_on_the_compressed_checkpoint_scores_as_qmoe_jax_evaluate(setup, one_device):
    compressed, work = setup
    out, before = one_device
    # Span corruption: the per-example log-likelihoods T5X writes are qmoe_jax's.
    records = read_json_lines(out / f"{SPAN}-{STEP:06d}.jsonl")
    found, ours = qmoe_scores(compressed)
    assert [r["input"]["targets"] for r in records] == [t.tolist() for _, t in found.examples]
    theirs = np.array([r["score"] for r in records])
    assert np.abs(theirs - ours).max() <= 1e-4, np.abs(theirs - ours).max()
    metrics = read_json_lines(out / f"{SPAN}-metrics.jsonl")[-1]
    assert metrics["step"] == STEP
    assert metrics["mean_log_likelihood"] == pytest.approx(ours.mean(), abs=1e-4)

    # The user's task: the same scores and greedy predictions as python -m qmoe_jax.evaluate.
    user = read_json_lines(out / f"{USER}-{STEP:06d}.jsonl")
    evaluate_cli.evaluate(
        [
            "--gin_file=runs/eval.gin",
            "--gin_file=models/switch_mini_8.gin",
            f"--gin.CHECKPOINT_PATH='{compressed}'",
            f"--gin.EVAL_OUTPUT_DIR='{work / 'qmoe_eval'}'",
            "--gin.MIXTURE_OR_TASK_NAME='jsonl_seq2seq'",
            f"--gin.JSONL_FILE='{work / 'pairs.jsonl'}'",
            f"--gin.TASK_FEATURE_LENGTHS={LENGTHS}",
        ]
    )
    mine = read_json_lines(
        work / "qmoe_eval" / "inference_eval" / f"jsonl_seq2seq-{STEP:06d}.jsonl"
    )
    assert [u["input"]["targets"] for u in user] == [m["input"]["targets"] for m in mine]
    scores = np.array([u["score"] for u in user]), np.array([m["score"] for m in mine])
    assert np.abs(scores[0] - scores[1]).max() <= 1e-4, scores
    assert [unspaced(u["prediction"]) for u in user] == [unspaced(m["prediction"]) for m in mine]
    user_metrics = read_json_lines(out / f"{USER}-metrics.jsonl")[-1]
    assert user_metrics["mean_score"] == pytest.approx(scores[1].mean(), abs=1e-4)
    assert "sequence_accuracy" in user_metrics  # the user's metric function ran

    # T5X read the compressed directory as it is: nothing written or changed there.
    assert tree_digest(compressed) == before


def test_t5x_eval_on_four_host_devices_equals_one_device(setup, one_device):
    compressed, _ = setup
    out, _ = one_device
    four, result = t5x_eval(setup, "eval_4_devices", compressed, devices=4)
    # T5X's MoE partitioner put the 8 experts on a 4-device expert axis (2 per device), and each
    # device ran the kernels on its own experts.
    assert re.search(r"global_mesh shape: \(1, 4, 1\)", result.stderr), result.stderr[-3000:]
    assert "encoder.layers_0.mlp run expert-locally over mesh axes expert (4 devices)" in (
        result.stderr
    )
    for task in (SPAN, USER):
        one = read_json_lines(out / f"{task}-{STEP:06d}.jsonl")
        many = read_json_lines(four / f"{task}-{STEP:06d}.jsonl")
        assert [r["input"] for r in one] == [r["input"] for r in many]
        diff = np.abs(np.array([r["score"] for r in one]) - np.array([r["score"] for r in many]))
        assert diff.max() <= 1e-4, (task, diff.max())
        if task == USER:
            assert [r["prediction"] for r in one] == [r["prediction"] for r in many]


def test_t5x_infer_writes_predictions_in_t5x_layout(setup, one_device):
    compressed, work = setup
    out = work / "infer"
    run_t5x(
        "infer",
        "t5x/switch_mini_8_compressed_infer.gin",
        {
            "CHECKPOINT_PATH": f"'{compressed}'",
            "INFER_OUTPUT_DIR": f"'{out}'",
            "MIXTURE_OR_TASK_NAME": f"'{USER}'",
        },
        work,
    )
    name = f"{USER}-predict.jsonl-00000-of-00001"
    assert {name, f"{name}.COMPLETED"} <= set(os.listdir(out)), os.listdir(out)
    records = read_json_lines(out / name)
    assert [r["inputs"]["inputs_pretokenized"] for r in records] == [a for a, _ in PAIRS]
    # t5x.infer restores in bfloat16 (T5X's infer.gin); its greedy predictions are t5x.eval's.
    evaluated = read_json_lines(one_device[0] / f"{USER}-{STEP:06d}.jsonl")
    same = sum(r["prediction"] == e["prediction"] for r, e in zip(records, evaluated))
    assert same >= len(PAIRS) - 1, [
        (r["prediction"], e["prediction"]) for r, e in zip(records, evaluated)
    ]


def train_losses(model_dir) -> list[float]:
    """T5X's per-step training loss from its TensorBoard summaries (``stats_period = 1``)."""
    import tensorflow as tf

    losses = {}
    folder = model_dir / "train"
    for name in sorted(os.listdir(folder)):
        for event in tf.compat.v1.train.summary_iterator(str(folder / name)):
            for value in event.summary.value:
                if value.tag == "loss":
                    losses[event.step] = float(tf.make_ndarray(value.tensor))
    return [losses[step] for step in sorted(losses)]


def test_t5x_train_fine_tunes_with_frozen_experts(setup):
    compressed, work = setup
    model_dir = work / "train"
    steps = 4
    # The user's own gin: T5X's training summaries every step.
    every_step = work / "every_step.gin"
    every_step.write_text(
        "from __gin__ import dynamic_registration\n"
        "import __main__ as train_script\n"
        "train_script.train.stats_period = 1\n"
    )
    run_t5x(
        "train",
        "t5x/switch_mini_8_compressed_train.gin",
        {
            "INITIAL_CHECKPOINT_PATH": f"'{compressed}'",
            "MODEL_DIR": f"'{model_dir}'",
            "MIXTURE_OR_TASK_NAME": f"'{USER}'",
            "TRAIN_STEPS": STEP + steps,
            "DROPOUT_RATE": 0.0,
            "t5x.utils.create_learning_rate_scheduler.base_learning_rate": 0.01,
        },
        work,
        more_gin=[str(every_step)],
    )
    result = model_dir / f"checkpoint_{STEP + steps}"
    # The codes are the compressed checkpoint's, bit for bit: same SHA-256 as in its manifest.
    saved = json.loads((result / "qmoe_jax" / "layout.json").read_text())["checksums"]
    with open(os.path.join(compressed, "manifest.json")) as f:
        source = json.load(f)["layers"]
    expected = {
        "/".join(layer.split(".")) + "/" + name: digest
        for layer, record in source.items()
        for name, digest in record["checksums"].items()
    }
    assert saved == expected
    # They are not parameters: T5X's optimizer holds no state for them.
    info = (model_dir / "model-info.txt").read_text()
    assert "router_weights" in info and "codes" not in info
    losses = train_losses(model_dir)
    assert len(losses) == steps and losses[-1] < losses[0], losses

    # qmoe_jax reads T5X's checkpoint (with its qmoe_jax/ folder): the fine-tuned model scores the
    # training pairs higher than the compressed checkpoint it started from.
    def mean_score(checkpoint, name):
        evaluate_cli.evaluate(
            [
                "--gin_file=runs/eval.gin",
                "--gin_file=models/switch_mini_8.gin",
                f"--gin.CHECKPOINT_PATH='{checkpoint}'",
                f"--gin.EVAL_OUTPUT_DIR='{work / name}'",
                "--gin.MIXTURE_OR_TASK_NAME='jsonl_seq2seq'",
                f"--gin.JSONL_FILE='{work / 'pairs.jsonl'}'",
                f"--gin.TASK_FEATURE_LENGTHS={LENGTHS}",
            ]
        )
        return read_json_lines(work / name / "inference_eval" / "jsonl_seq2seq-metrics.jsonl")[-1]

    before = mean_score(compressed, "before")
    after = mean_score(result, "after")
    assert after["step"] == STEP + steps
    assert after["mean_log_likelihood"] > before["mean_log_likelihood"]

    # t5x.eval reads it with the same gin as the compressed directory, and scores it as qmoe_jax.
    out, _ = t5x_eval(setup, "eval_trained", str(result), task=SPAN)
    records = read_json_lines(out / f"{SPAN}-{STEP + steps:06d}.jsonl")
    _, ours = qmoe_scores(str(result))
    theirs = np.array([r["score"] for r in records])
    assert np.abs(theirs - ours).max() <= 1e-4, np.abs(theirs - ours).max()
