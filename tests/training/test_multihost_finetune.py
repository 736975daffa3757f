"""Fine-tuning as one run of 2 processes × 2 host devices (JAX's multi-process runtime on
127.0.0.1, gloo): data parallel over every process's devices, the loss curve of one process to
1e-4 per step, and one Orbax checkpoint from which the same command resumes after a process is
killed, to the parameters of a run that was never interrupted. Each process is a child under a
watchdog."""

import dataclasses
import json
import time

import pytest
from helpers.finetune_tasks import write_first_word_task
from helpers.multiprocess import ProcessGroup, describe, printed_nothing, run_processes

from qmoe_jax.checkpoints.format_v1 import CompressedCheckpoint
from qmoe_jax.training import FinetuneOptions, finetune

pytestmark = pytest.mark.slow
WATCHDOG_SECONDS = 900


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, compressed_tiny, tiny_tokenizer):
    """(compressed directory, jsonl task, tokenizer path) of the tiny model."""
    root = tmp_path_factory.mktemp("finetune")
    _, compressed, _ = compressed_tiny
    task = write_first_word_task(root)
    return compressed, task, tiny_tokenizer.model_path


def options_for(tiny, output_dir) -> FinetuneOptions:
    compressed, task, tokenizer = tiny
    return FinetuneOptions(
        checkpoint=compressed,
        task=task,
        tokenizer=tokenizer,
        output_dir=str(output_dir),
        steps=4,
        batch_size=8,
        inputs_length=32,
        eval_examples=16,
        eval_every=1,
        checkpoint_every=1,
        learning_rate=3e-3,
        expert_lora_rank=2,
        dropout_rate=0.1,
    )


def cli_args(options: FinetuneOptions) -> list[str]:
    args = ["-m", "qmoe_jax.finetune"]
    for field in dataclasses.fields(options):
        value = getattr(options, field.name)
        if value is not None:
            args += [f"--{field.name}", str(value)]
    return args


def curve(output_dir) -> list[tuple]:
    with open(output_dir / "metrics.jsonl") as f:
        records = [json.loads(line) for line in f]
    return [(r["step"], r.get("train_loss"), r["validation_loss"]) for r in records]


def model_checksums(output_dir) -> dict:
    manifest = CompressedCheckpoint(str(output_dir / "model")).manifest
    return {"dense": manifest["dense"]["checksums"], "adapters": manifest["adapters"]["checksums"]}


def test_two_processes_follow_the_one_process_curve_and_resume_from_their_checkpoint(
    tiny, tmp_path
):
    finetune(options_for(tiny, tmp_path / "alone"), log=lambda _: None, progress=False)

    straight = run_processes(
        cli_args(options_for(tiny, tmp_path / "shared")), 2, 2, WATCHDOG_SECONDS
    )
    assert [r.returncode for r in straight] == [0, 0], describe(straight)
    assert json.loads(straight[0].stdout.splitlines()[-1])["steps"] == 4
    assert printed_nothing(straight[1]), describe(straight)
    alone, shared = curve(tmp_path / "alone"), curve(tmp_path / "shared")
    assert [step for step, *_ in shared] == [0, 1, 2, 3, 4]
    for (_, train1, valid1), (_, train2, valid2) in zip(alone, shared, strict=True):
        if train1 is not None:
            assert abs(train1 - train2) < 1e-4
        assert abs(valid1 - valid2) < 1e-4

    resumed_dir = tmp_path / "resumed"
    args = cli_args(options_for(tiny, resumed_dir)) + ["--heartbeat_timeout_seconds", "5"]
    with ProcessGroup(args) as group:
        deadline = time.monotonic() + WATCHDOG_SECONDS
        while not (resumed_dir / "train_state" / "2").is_dir():
            assert time.monotonic() < deadline, group.output(0)[-3000:]
            assert all(child.poll() is None for child in group.children), group.output(0)[-3000:]
            time.sleep(0.05)
        group.kill(1)
        killed = group.wait(WATCHDOG_SECONDS)  # process 0 stops by itself
    assert killed[0].returncode != 0, describe(killed)
    assert not (resumed_dir / "model").exists()

    resumed = run_processes(args, 2, 2, WATCHDOG_SECONDS)
    assert [r.returncode for r in resumed] == [0, 0], describe(resumed)
    assert "resuming at step" in resumed[0].stderr
    assert [step for step, *_ in curve(resumed_dir)] == [0, 1, 2, 3, 4]
    assert model_checksums(resumed_dir) == model_checksums(tmp_path / "shared")
