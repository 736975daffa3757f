"""What a prompt may cost is bounded before any work: long prompts, encoder lengths whose attention
cannot fit, and empty prompts are refused in one line (docs/recovery.md)."""

import json
import re
import time

import pytest

from qmoe_jax import generate
from qmoe_jax.inference import generation
from qmoe_jax.inference.generation import (
    DEFAULT_MAX_INPUTS_LENGTH,
    check_attention_memory,
    encode_prompts,
)
from qmoe_jax.models import get_config

LONG_PROMPT = " ".join(["the small model reads every layer"] * 2000)  # 10,000 words


def error_of(argv, capsys, code=1) -> str:
    with pytest.raises(SystemExit) as exited:
        generate.main(argv)
    err = capsys.readouterr().err
    assert exited.value.code == code, err
    assert "Traceback" not in err, err
    if code == 1:  # an expected error: one line (argparse's own refusals come with the usage line)
        assert err.startswith("error: ") and len(err.strip().splitlines()) == 1, err
    return err


@pytest.fixture
def no_model(monkeypatch):
    """Makes opening a model fail the test: what is refused must be refused before it."""

    def refuse(args):
        raise AssertionError("the model was opened")

    monkeypatch.setattr(generate, "open_model_from_args", refuse)


def test_a_10000_word_prompt_is_refused_before_any_work(tiny_tokenizer, no_model, capsys):
    started = time.perf_counter()
    err = error_of(
        ["--checkpoint", "unused", "--tokenizer", tiny_tokenizer.model_path, "--prompt", "a"]
        + ["--prompt", LONG_PROMPT],
        capsys,
    )
    assert time.perf_counter() - started < 30
    assert (
        f"more than the default bound (T5's pretraining length) {DEFAULT_MAX_INPUTS_LENGTH}" in err
    )
    assert re.search(r"raise the bound with --inputs_length \d+", err), err


def test_a_long_prompt_in_a_file_is_refused_with_an_explicit_length_too(
    tiny_tokenizer, no_model, tmp_path, capsys
):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"inputs": LONG_PROMPT}) + "\n")
    err = error_of(
        ["--checkpoint", "unused", "--tokenizer", tiny_tokenizer.model_path]
        + ["--input_file", str(prompts), "--inputs_length", "64"],
        capsys,
    )
    assert "more than the encoder length 64; shorten it, or raise the bound" in err


def test_an_encoder_length_whose_attention_cannot_fit_is_refused_before_decoding(
    compressed_tiny, monkeypatch, capsys
):
    _, directory, tokenizer = compressed_tiny
    monkeypatch.setattr(generation, "available_memory_bytes", lambda: 2**20)

    def decode(*args, **kwargs):
        raise AssertionError("decoding started")

    monkeypatch.setattr(generate, "generate_encoded", decode)
    err = error_of(
        ["--checkpoint", directory, "--tokenizer", tokenizer.model_path, "--prompt", "a b c"]
        + ["--inputs_length", "1024", "--batch_size", "8"],
        capsys,
    )
    assert (
        "decoding batches of 8 prompts of 1024 tokens needs at least 0.1 GiB for the encoder's "
        "attention scores alone" in err
    )
    assert "lower --batch_size or --inputs_length" in err


def test_the_attention_bound_is_the_scores_of_one_batch():
    config = get_config("switch-base-8")  # 12 heads
    check_attention_memory(config, 8, 512, available=8 * 12 * 512**2 * 4)
    with pytest.raises(ValueError, match="12 heads"):
        check_attention_memory(config, 8, 512, available=8 * 12 * 512**2 * 4 - 1)


def test_empty_prompts_are_refused(tiny_tokenizer, no_model, tmp_path, capsys):
    err = error_of(
        ["--checkpoint", "unused", "--tokenizer", tiny_tokenizer.model_path, "--prompt", ""],
        capsys,
        code=2,
    )
    assert "--prompt is empty; give the text to continue" in err
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"inputs": "a"}) + "\n" + json.dumps({"inputs": "  "}) + "\n")
    err = error_of(
        ["--checkpoint", "unused", "--tokenizer", tiny_tokenizer.model_path]
        + ["--input_file", str(prompts)],
        capsys,
    )
    assert f'{prompts}:2 has an empty "inputs" field' in err
    with pytest.raises(ValueError, match="prompt 2 is empty"):
        encode_prompts(tiny_tokenizer, ["a", ""], None)
