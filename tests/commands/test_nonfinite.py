"""Non-finite numbers never get through: float flags are refused when parsed, every JSON qmoe_jax
writes is strict JSON, and a command whose result is NaN or infinite fails (docs/recovery.md)."""

import dataclasses
import json
import math
import os
import pathlib
import re

import jax
import numpy as np
import pytest

import qmoe_jax
from qmoe_jax import compress, evaluate, finetune, generate
from qmoe_jax.checkpoints import strict_json
from qmoe_jax.compression.options import CompressionOptions
from qmoe_jax.inference.strategies import DecodingConfig
from qmoe_jax.training import FinetuneOptions
from qmoe_jax.training import finetune as run_finetune


def strict_loads(text: str):
    """``json.loads`` that refuses NaN and ±Infinity, written here so that the test does not rely on
    the module it tests."""

    def refuse(name):
        raise ValueError(f"{name} is not JSON")

    return json.loads(text, parse_constant=refuse)


def strict_files(directory) -> list[str]:
    """Parses every .json and .jsonl file under ``directory`` strictly; returns their paths."""
    found = []
    for folder, _, names in os.walk(directory):
        for name in names:
            path = os.path.join(folder, name)
            if name.endswith(".json"):
                strict_loads(pathlib.Path(path).read_text())
            elif name.endswith(".jsonl"):
                for line in pathlib.Path(path).read_text().splitlines():
                    strict_loads(line)
            else:
                continue
            found.append(os.path.relpath(path, directory))
    return sorted(found)


FLOAT_FLAGS = {
    "compress": (compress.main, ["--damping"]),
    "generate": (generate.main, ["--temperature", "--top_p", "--alpha", "--expert_cache_gb"]),
    "evaluate": (evaluate.main, ["--expert_cache_gb"]),
    "finetune": (
        finetune.main,
        [
            "--learning_rate",
            "--final_learning_rate_fraction",
            "--weight_decay",
            "--clip_norm",
            "--dropout_rate",
        ],
    ),
}


@pytest.mark.parametrize("value", ["inf", "nan", "-inf"])
@pytest.mark.parametrize(
    "command, flag", [(name, flag) for name, (_, flags) in FLOAT_FLAGS.items() for flag in flags]
)
def test_every_float_flag_refuses_a_nonfinite_value_when_parsed(command, flag, value, capsys):
    main = FLOAT_FLAGS[command][0]
    with pytest.raises(SystemExit) as exited:
        main([f"{flag}={value}"])
    err = capsys.readouterr().err
    assert exited.value.code == 2, err
    assert f"argument {flag}: must be a finite number, got {value}" in err


def test_the_options_refuse_nonfinite_values_too():
    with pytest.raises(ValueError, match="damping must be > 0 and finite"):
        CompressionOptions(damping=math.inf)
    with pytest.raises(ValueError, match="temperature must be positive and finite"):
        DecodingConfig(temperature=math.inf)
    with pytest.raises(ValueError, match="alpha must be a finite number"):
        DecodingConfig(alpha=math.nan)
    with pytest.raises(ValueError, match="--weight_decay must be a finite number"):
        FinetuneOptions(output_dir="x", weight_decay=math.nan)


def test_strict_json_names_where_a_nonfinite_number_sits():
    with pytest.raises(strict_json.NonFiniteNumberError, match=r"report\.json .* at moe/layers/1"):
        strict_json.dumps({"moe": {"layers": [0.5, math.inf]}}, what="report.json")
    assert strict_json.dumps({"a": [1.5, 2]}) == '{"a": [1.5, 2]}'
    for text in ("NaN", '{"a": Infinity}', "[-Infinity]"):
        with pytest.raises(ValueError, match="is not JSON"):
            strict_json.loads(text)


def test_no_module_writes_json_around_the_strict_writer():
    """Every JSON written goes through strict_json; ``json.loads(json.dumps(x))``, which normalizes
    a value in memory, is the only other use of json.dumps."""
    root = pathlib.Path(qmoe_jax.__file__).parent
    offenders = []
    for path in root.rglob("*.py"):
        if path.name == "strict_json.py":
            continue
        text = path.read_text()
        for match in re.finditer(r"(?<![\w.])json\.dumps?\(", text):
            if not text[: match.start()].endswith("json.loads("):
                line = text.count("\n", 0, match.start()) + 1
                offenders.append(f"{path.relative_to(root)}:{line}")
    assert not offenders, offenders


def with_nan_logits(opened):
    """``opened`` with the decoder's final norm scale set to NaN: every logit is NaN."""
    params = jax.tree_util.tree_map(lambda x: x, opened.params)
    norm = params["decoder"]["decoder_norm"]
    norm["scale"] = np.full(np.shape(norm["scale"]), np.nan, np.float32)
    return dataclasses.replace(opened, params=params)


@pytest.mark.parametrize("decoding", ["greedy", "beam"])
def test_generate_fails_on_nan_logits_instead_of_printing_a_nan_score(
    compressed_tiny, decoding, monkeypatch, capsys
):
    _, directory, tokenizer = compressed_tiny
    opened = generate.open_model_from_args
    monkeypatch.setattr(
        generate, "open_model_from_args", lambda args: with_nan_logits(opened(args))
    )
    with pytest.raises(SystemExit) as exited:
        generate.main(
            [
                "--checkpoint",
                directory,
                "--tokenizer",
                tokenizer.model_path,
                "--prompt",
                "the small <extra_id_0> model",
                "--max_decode_length",
                "3",
                "--decoding",
                decoding,
                "--beam_size",
                "2",
            ]
        )
    captured = capsys.readouterr()
    assert exited.value.code == 1, captured.err
    assert "the model's score for the prompt 'the small <extra_id_0> model' is nan" in captured.err
    assert "Traceback" not in captured.err
    assert captured.out == ""  # no line with a NaN score


def test_what_the_main_job_evaluate_and_generate_write_is_strict_json(compressed_tiny, capsys):
    _, directory, tokenizer = compressed_tiny
    files = strict_files(directory)
    assert {"manifest.json", "report.json", "layers/encoder.layers_1.mlp/layer.json"} <= set(files)
    evaluate.main(
        [
            "--checkpoint",
            directory,
            "--tokenizer",
            tokenizer.model_path,
            "--num_samples",
            "4",
            "--inputs_length",
            "32",
        ]
    )
    assert strict_loads(capsys.readouterr().out)["examples"] == 4
    generate.main(
        [
            "--checkpoint",
            directory,
            "--tokenizer",
            tokenizer.model_path,
            "--prompt",
            "the small <extra_id_0> model",
            "--prompt",
            "every layer",
            "--max_decode_length",
            "3",
        ]
    )
    lines = capsys.readouterr().out.splitlines()
    assert [strict_loads(line)["inputs"] for line in lines] == [
        "the small <extra_id_0> model",
        "every layer",
    ]


@pytest.fixture(scope="module")
def finetune_task(tmp_path_factory, compressed_tiny, tiny_tokenizer):
    """(compressed tiny model, jsonl task, tokenizer path)."""
    root = tmp_path_factory.mktemp("nonfinite_finetune")
    compressed = compressed_tiny[1]
    lines = [
        json.dumps({"inputs": f"first word: {word} and more", "targets": word})
        for word in ["the", "small", "model", "reads", "every", "layer"] * 8
    ]
    (root / "train.jsonl").write_text("\n".join(lines) + "\n")
    return compressed, f"jsonl:{root / 'train.jsonl'}", tiny_tokenizer.model_path


def finetune_options(task, output_dir, **overrides) -> FinetuneOptions:
    compressed, spec, tokenizer = task
    values = dict(
        checkpoint=compressed,
        task=spec,
        tokenizer=tokenizer,
        output_dir=str(output_dir),
        steps=2,
        batch_size=8,
        inputs_length=32,
        eval_examples=8,
        eval_every=1,
        checkpoint_every=1,
    )
    values.update(overrides)
    return FinetuneOptions(**values)


@pytest.mark.slow
def test_what_finetune_writes_is_strict_json(finetune_task, tmp_path, capsys):
    options = finetune_options(finetune_task, tmp_path / "run")
    finetune.main(
        [
            f"--{field.name}={getattr(options, field.name)}"
            for field in dataclasses.fields(options)
            if getattr(options, field.name) is not None
        ]
    )
    assert strict_loads(capsys.readouterr().out)["steps"] == 2
    files = strict_files(tmp_path / "run")
    assert {"manifest.json", "metrics.jsonl", "model/manifest.json"} <= set(files)


@pytest.mark.slow
def test_finetune_that_diverges_stops_before_recording_a_nonfinite_loss(finetune_task, tmp_path):
    options = finetune_options(
        finetune_task, tmp_path / "run", learning_rate=1e30, clip_norm=1e30, warmup_steps=0
    )
    with pytest.raises(ValueError, match="the training diverged"):
        run_finetune(options, log=lambda line: None, progress=False)
    strict_files(tmp_path / "run")  # what it did record is finite
    assert not (tmp_path / "run" / "model").exists()
