"""Fine-tuning compressed models: the trainable split, expert LoRA, tasks, the run directory, resume
after kill -9, the compressed and T5X outputs and their readers, and data parallelism over 4 host
devices."""

import dataclasses
import json
import os
import re
import signal
import subprocess
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.child_process import popen_python, run_python
from helpers.finetune_tasks import write_first_word_task
from helpers.json_lines import read_json_lines
from helpers.switch_fixtures import TINY
from helpers.text import synthetic_sentences

from qmoe_jax import evaluate as evaluate_cli
from qmoe_jax import finetune as finetune_cli
from qmoe_jax.checkpoints.format_v1 import CompressedCheckpoint
from qmoe_jax.codec import CompressedExperts
from qmoe_jax.data import works
from qmoe_jax.inference import open_model
from qmoe_jax.inference.compressed_params import load_compressed_model
from qmoe_jax.models.lora import init_adapter
from qmoe_jax.training import FinetuneOptions, finetune, load_task, select_trainable
from qmoe_jax.training.finetuning import add_expert_adapters
from qmoe_jax.training.run_directory import FORMAT, ResumeMismatchError, RunDirectory
from qmoe_jax.training.trainable import flatten, split

WATCHDOG_SECONDS = 600


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, compressed_tiny, tiny_tokenizer):
    """(T5X checkpoint, compressed directory, config JSON, jsonl task, tokenizer path) of the tiny
    model."""
    root = tmp_path_factory.mktemp("finetune")
    checkpoint, compressed, _ = compressed_tiny
    config = root / "tiny.json"
    config.write_text(json.dumps(dataclasses.asdict(TINY)))
    task = write_first_word_task(root)
    return checkpoint, compressed, str(config), task, tiny_tokenizer.model_path


def options_for(tiny, output_dir, **overrides) -> FinetuneOptions:
    _, compressed, _, task, tokenizer = tiny
    settings = dict(
        checkpoint=compressed,
        task=task,
        tokenizer=tokenizer,
        output_dir=str(output_dir),
        steps=4,
        batch_size=8,
        inputs_length=32,
        eval_examples=16,
        eval_every=2,
        checkpoint_every=2,
        learning_rate=3e-3,
    )
    settings.update(overrides)
    return FinetuneOptions(**settings)


def cli_args(options: FinetuneOptions) -> list[str]:
    args = []
    for field in dataclasses.fields(options):
        value = getattr(options, field.name)
        if value is not None:
            args += [f"--{field.name}", ",".join(value) if isinstance(value, tuple) else str(value)]
    return args


def test_default_trainable_parts_leave_out_every_expert_array(tiny):
    params = open_model(tiny[1]).params
    chosen = select_trainable(params, None)
    assert any("router" in p for p in chosen) and any("attention" in p for p in chosen)
    assert "token_embedder/embedding" in chosen and not any("/expert/" in p for p in chosen)
    trainable, frozen = split(params, chosen)
    assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(trainable))
    stacks = [leaf for leaf in flatten(frozen).values() if isinstance(leaf, CompressedExperts)]
    assert len(stacks) == 4  # wi and wo of the encoder's and the decoder's sparse layer
    assert select_trainable(params, ["attention/query"]) == sorted(
        p for p in chosen if "attention/query" in p
    )


@pytest.mark.parametrize(
    "pattern, message",
    [
        ("expert/wi", "matches only frozen compressed experts"),
        ("no_such_layer", "matches no parameter"),
        ("(", "is not a regular expression"),
    ],
)
def test_a_trainable_pattern_that_selects_nothing_trainable_is_refused(tiny, pattern, message):
    params = open_model(tiny[1]).params
    with pytest.raises(ValueError, match=message):
        select_trainable(params, [pattern])


@pytest.mark.slow
def test_expert_lora_is_the_dense_product_with_adapters_folded_in(tiny):
    """Random adapters (B non-zero): the fused-kernel model with adapters gives the logits of the
    dequantized model with W + (B A)ᵀ in its kernels; with B = 0 the adapters change nothing."""
    compressed = open_model(tiny[1])
    tokens = jnp.asarray(np.random.default_rng(0).integers(3, 60, (4, 16)), jnp.int32)
    baseline = compressed.module.apply({"params": compressed.params}, tokens, tokens, tokens)
    zero = add_expert_adapters(compressed.params, 2, jax.random.PRNGKey(0))
    np.testing.assert_allclose(
        compressed.module.apply({"params": zero}, tokens, tokens, tokens),
        baseline,
        rtol=1e-6,
        atol=1e-6,
    )
    flat = flatten(zero)
    for path in [p for p in flat if p.endswith("/b")]:
        flat[path] = jax.random.normal(jax.random.PRNGKey(len(path)), flat[path].shape) * 0.05
    from qmoe_jax.models.lora import merged_kernel
    from qmoe_jax.training.trainable import unflatten

    adapted = unflatten(flat)
    dense = load_compressed_model(tiny[1], experts="dense")
    dense_flat = flatten(dense.params)
    for path in [p for p in flat if p.endswith("/lora/wi/a") or p.endswith("/lora/wo/a")]:
        expert, _, rest = path.partition("/lora/")
        kernel = rest.split("/")[0]
        adapter = {"a": flat[path], "b": flat[path[:-1] + "b"]}
        dense_flat[f"{expert}/{kernel}/kernel"] = merged_kernel(
            dense_flat[f"{expert}/{kernel}/kernel"], adapter
        )
    expected = dense.module().apply({"params": unflatten(dense_flat)}, tokens, tokens, tokens)
    got = compressed.module.apply({"params": adapted}, tokens, tokens, tokens)
    assert not np.allclose(got, baseline, atol=1e-3)
    np.testing.assert_allclose(got, expected, rtol=2e-4, atol=2e-4)


def test_lora_rank_above_min_in_out_is_refused():
    with pytest.raises(ValueError, match="min\\(out, in\\) = 32"):
        init_adapter(jax.random.PRNGKey(0), 4, 64, 32, 33)


def test_malformed_task_lines_are_named(tmp_path, tiny_tokenizer):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"inputs": "a", "targets": "b"}\n{"inputs": "a"}\n')
    with pytest.raises(ValueError, match=f"{path}:2"):
        load_task(f"jsonl:{path}", tiny_tokenizer, 32, 8)
    with pytest.raises(ValueError, match="unknown task"):
        load_task("glue:mnli", tiny_tokenizer, 32, 8)


def test_name_the_work_split_shares_no_passage():
    train, validation = works.examples("train"), works.examples("validation")
    assert not {e.inputs for e in train} & {e.inputs for e in validation}
    assert not {e.source for e in train} & {e.source for e in validation}
    assert {e.targets for e in train} == {e.targets for e in validation}  # every work in both
    assert len(validation) * 8 < len(train)


@pytest.mark.slow
def test_finetune_with_expert_lora_writes_a_compressed_checkpoint_the_readers_load(
    tiny, tmp_path, capsys
):
    options = options_for(
        tiny, tmp_path / "run", expert_lora_rank=2, accumulate=2, dropout_rate=0.1
    )
    summary = finetune(options, log=lambda _: None, progress=False)
    model = str(tmp_path / "run" / "model")
    assert summary["model"] == model
    records = read_json_lines(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 2, 4]
    assert {"validation_loss", "validation_token_accuracy", "validation_exact_match"} <= records[
        -1
    ].keys()
    assert records[-1]["validation_loss"] < records[0]["validation_loss"]
    assert os.path.getsize(tmp_path / "run" / "metrics.png") > 0

    source, tuned = CompressedCheckpoint(tiny[1]), CompressedCheckpoint(model)
    assert tuned.complete and tuned.header["finetune"]["expert_lora_rank"] == 2
    for name in source.layer_names():  # the expert codes are the source's, bit for bit
        assert (
            tuned.manifest["layers"][name]["checksums"]
            == source.manifest["layers"][name]["checksums"]
        )
    adapters = tuned.adapters()
    assert sorted(adapters) == sorted(source.layer_names())
    assert any(
        np.abs(adapter["b"]).max() > 0
        for kernels in adapters.values()
        for adapter in kernels.values()
    )
    original, new = source.dense_params(), tuned.dense_params()
    assert not np.allclose(
        np.asarray(original["token_embedder"]["embedding"], np.float32),
        new["token_embedder"]["embedding"],
    )

    # Both forms of the fine-tuned model (adapters applied by the kernels, or folded into dense
    # kernels) agree.
    compressed, dense = open_model(model), open_model(model, experts="dense")
    tokens = jnp.asarray(np.random.default_rng(1).integers(3, 60, (4, 16)), jnp.int32)
    np.testing.assert_allclose(
        compressed.module.apply({"params": compressed.params}, tokens, tokens, tokens),
        dense.module.apply({"params": dense.params}, tokens, tokens, tokens),
        rtol=2e-4,
        atol=2e-4,
    )
    assert sorted(os.listdir(tmp_path / "run" / "train_state")) == ["2", "4"]

    evaluate_cli.main(
        [
            "--checkpoint",
            model,
            "--tokenizer",
            options.tokenizer,
            "--num_samples",
            "4",
            "--inputs_length",
            "32",
        ]
    )
    assert json.loads(capsys.readouterr().out)["experts"] == "compressed"


@pytest.mark.slow
def test_t5x_input_gives_a_t5x_output_in_bfloat16_activations(tiny, tmp_path):
    checkpoint, _, config, *_ = tiny
    options = options_for(
        tiny,
        tmp_path / "run",
        checkpoint=checkpoint,
        config=config,
        steps=2,
        activations="bfloat16",
        trainable=("attention", "router"),
    )
    summary = finetune(options, log=lambda _: None, progress=False)
    assert summary["model"].endswith(os.path.join("model", "checkpoint_2"))
    opened = open_model(summary["model"], TINY)
    assert opened.kind == "t5x"
    with pytest.raises(ValueError, match="needs compressed experts"):
        finetune(
            options_for(
                tiny, tmp_path / "lora", checkpoint=checkpoint, config=config, expert_lora_rank=2
            ),
            log=lambda _: None,
            progress=False,
        )


@pytest.mark.slow
def test_resume_with_other_settings_is_refused_and_a_complete_run_is_not_redone(tiny, tmp_path):
    options = options_for(tiny, tmp_path / "run", steps=2)
    first = finetune(options, log=lambda _: None, progress=False)
    lines = []
    assert finetune(options, log=lines.append, progress=False) == json.loads(json.dumps(first))
    assert "already complete" in lines[-1]
    with pytest.raises(
        ResumeMismatchError, match=re.escape("learning_rate: 0.003 before, 0.001 now")
    ):
        finetune(
            dataclasses.replace(options, learning_rate=1e-3), log=lambda _: None, progress=False
        )


def test_a_run_recorded_without_an_optimizer_resumes_as_adamw_only(tmp_path):
    record = {"settings": {"steps": 4, "optimizer": "adamw"}, "source": {"path": "x"}}
    stored = {"format": FORMAT, "format_version": 1, "complete": False, "model": None}
    stored |= {"settings": {"steps": 4}, "source": {"path": "x"}}  # a manifest without the key
    (tmp_path / "manifest.json").write_text(json.dumps(stored))
    RunDirectory(str(tmp_path), record).close()
    adafactor = {**record, "settings": {"steps": 4, "optimizer": "adafactor"}}
    with pytest.raises(
        ResumeMismatchError, match=re.escape("optimizer: 'adamw' before, 'adafactor' now")
    ):
        RunDirectory(str(tmp_path), adafactor)


@pytest.mark.slow
def test_adafactor_run_learns_and_its_optimizer_is_part_of_the_settings(tiny, tmp_path):
    options = options_for(tiny, tmp_path / "run", optimizer="adafactor", learning_rate=1e-2)
    finetune(options, log=lambda _: None, progress=False)
    records = read_json_lines(tmp_path / "run" / "metrics.jsonl")
    first, last = records[0]["validation_loss"], records[-1]["validation_loss"]
    assert [r["step"] for r in records] == [0, 2, 4]
    assert np.isfinite(last) and last < first - 0.1, (first, last)
    with pytest.raises(
        ResumeMismatchError, match=re.escape("optimizer: 'adafactor' before, 'adamw' now")
    ):
        finetune(
            dataclasses.replace(options, optimizer="adamw"), log=lambda _: None, progress=False
        )


def _dense_checksums(directory: str) -> dict:
    return CompressedCheckpoint(os.path.join(directory, "model")).manifest["dense"]["checksums"]


@pytest.mark.slow
def test_kill_9_then_the_same_command_resumes_and_ends_where_an_uninterrupted_run_ends(
    tiny, tmp_path
):
    """A child fine-tunes with a checkpoint every step; it is SIGKILLed once step 3 is saved, and
    the same command finishes the run from there, to the parameters of a run that was never
    interrupted."""
    options = options_for(
        tiny, tmp_path / "killed", steps=8, checkpoint_every=1, eval_every=4, expert_lora_rank=2
    )
    args = ["-m", "qmoe_jax.finetune", *cli_args(options)]
    child = popen_python(args, JAX_PLATFORMS="cpu")
    state = tmp_path / "killed" / "train_state"
    deadline = time.time() + WATCHDOG_SECONDS
    try:
        while not (state / "3").is_dir():
            assert child.poll() is None, child.stdout.read().decode()[-3000:]
            assert time.time() < deadline, "the fine-tuning child saved no step 3 in time"
            time.sleep(0.05)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    assert child.returncode == -signal.SIGKILL
    assert not (tmp_path / "killed" / "model").exists()
    manifest = json.loads((tmp_path / "killed" / "manifest.json").read_text())
    assert manifest["complete"] is False

    resumed = run_python(args, timeout=WATCHDOG_SECONDS, JAX_PLATFORMS="cpu")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming at step" in resumed.stderr
    steps = [record["step"] for record in read_json_lines(tmp_path / "killed" / "metrics.jsonl")]
    assert steps == [0, 4, 8]

    straight = run_python(
        [
            "-m",
            "qmoe_jax.finetune",
            *cli_args(dataclasses.replace(options, output_dir=str(tmp_path / "straight"))),
        ],
        timeout=WATCHDOG_SECONDS,
        JAX_PLATFORMS="cpu",
    )
    assert straight.returncode == 0, straight.stderr[-3000:]
    assert _dense_checksums(str(tmp_path / "killed")) == _dense_checksums(
        str(tmp_path / "straight")
    )
    killed = CompressedCheckpoint(str(tmp_path / "killed" / "model")).manifest["adapters"][
        "checksums"
    ]
    assert (
        killed
        == CompressedCheckpoint(str(tmp_path / "straight" / "model")).manifest["adapters"][
            "checksums"
        ]
    )


@pytest.mark.slow
def test_cli_errors_are_one_line(tiny, tmp_path):
    options = options_for(tiny, tmp_path / "run", expert_lora_rank=100)
    result = run_python(
        ["-m", "qmoe_jax.finetune", *cli_args(options)], timeout=300, JAX_PLATFORMS="cpu"
    )
    assert result.returncode == 1
    assert (
        result.stderr.strip()
        .splitlines()[-1]
        .startswith("error: LoRA rank 100 must be between 1 and")
    )
    assert finetune_cli.parse_options(["--output_dir", "x", "--trainable", "a, b"]).trainable == (
        "a",
        "b",
    )


MULTIDEVICE_SCRIPT = """
import json, sys
from qmoe_jax.training import FinetuneOptions, finetune
import jax
assert jax.device_count() == int(sys.argv[2]), jax.devices()
options = FinetuneOptions(**json.loads(sys.argv[1]))
finetune(options, log=lambda _: None, progress=False)
"""


@pytest.mark.slow
def test_data_parallel_on_four_devices_follows_the_one_device_loss_curve(tiny, tmp_path):
    """Batches split over 4 host devices, experts sharded as in expert-parallel inference: the same
    training loss at every step as on one device, to 1e-4. Children under a watchdog (the device
    count is fixed when jax starts)."""
    curves = {}
    for devices in (1, 4):
        options = options_for(
            tiny,
            tmp_path / f"run{devices}",
            steps=4,
            eval_every=1,
            expert_lora_rank=2,
            dropout_rate=0.1,
        )
        settings = {f.name: getattr(options, f.name) for f in dataclasses.fields(options)}
        try:
            result = run_python(
                ["-c", MULTIDEVICE_SCRIPT, json.dumps(settings), str(devices)],
                timeout=WATCHDOG_SECONDS,
                JAX_PLATFORMS="cpu",
                XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
            )
        except subprocess.TimeoutExpired:
            pytest.fail(f"{devices}-device fine-tuning still running after {WATCHDOG_SECONDS} s")
        assert result.returncode == 0, result.stderr[-3000:]
        records = read_json_lines(tmp_path / f"run{devices}" / "metrics.jsonl")
        curves[devices] = [(r["step"], r.get("train_loss"), r["validation_loss"]) for r in records]
    assert [s for s, *_ in curves[4]] == [0, 1, 2, 3, 4]
    for (_, train1, valid1), (_, train4, valid4) in zip(curves[1], curves[4]):
        if train1 is not None:
            assert abs(train1 - train4) < 1e-4
        assert abs(valid1 - valid4) < 1e-4


def test_tasks_hold_out_validation_and_batches_depend_on_the_step_only(tmp_path, tiny_tokenizer):
    text = tmp_path / "a.txt"
    text.write_text("\n".join(synthetic_sentences(3000, seed=5)))
    task = load_task(f"span_corruption:text:{tmp_path}/*.txt", tiny_tokenizer, 32, 4)
    assert not task.generative and len(task.validation) == 4
    from qmoe_jax.data import SpanCorruptionConfig, token_chunks

    config = SpanCorruptionConfig(inputs_length=32)
    every = [
        c
        for c in token_chunks([text.read_text()], tiny_tokenizer, config)
        if c.size == config.lengths[0]
    ]
    assert [c.tobytes() for c in task.chunks] == [
        c.tobytes() for i, c in enumerate(every) if i % 20
    ]
    third = list(zip(range(3), task.batches(4, seed=1)))[2][1]
    resumed = next(task.batches(4, seed=1, start_step=2))
    for key in third:
        np.testing.assert_array_equal(third[key], resumed[key])

    lines = [
        json.dumps({"inputs": s, "targets": s.split()[0]}) for s in synthetic_sentences(50, seed=6)
    ]
    (tmp_path / "train.jsonl").write_text("\n".join(lines))
    task = load_task(f"jsonl:{tmp_path / 'train.jsonl'}", tiny_tokenizer, 32, 100)
    assert task.generative and len(task.examples) == 45 and len(task.validation) == 5
    with pytest.raises(ValueError, match="no text files match"):
        load_task(f"span_corruption:text:{tmp_path}/*.md", tiny_tokenizer, 32, 4)
