"""Mapped checkpoints (docs/format.md §9): conversion, equality with the loaded model, damaged
files."""

import errno
import json
import os
import shutil

import numpy as np
import pytest
from helpers.child_process import run_python
from helpers.switch_fixtures import TINY

from qmoe_jax import convert as convert_cli
from qmoe_jax import generate as generate_cli
from qmoe_jax.checkpoints.format_v1 import CompressedCheckpoint, CompressedCheckpointError
from qmoe_jax.checkpoints.mapped_layout import MappedCheckpoint, MappedExpertError
from qmoe_jax.checkpoints.to_mapped import convert_to_mapped
from qmoe_jax.inference import open_model
from qmoe_jax.inference.strategies import DecodingConfig, generate


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, compressed_tiny):
    """(compressed directory, mapped directory) of the tiny model."""
    mapped = tmp_path_factory.mktemp("mapped") / "mapped"
    convert_cli.main(["--checkpoint", compressed_tiny[1], "--output_dir", str(mapped)])
    return compressed_tiny[1], str(mapped)


def prompts(count, seed=0):
    rng = np.random.default_rng(seed)
    return np.stack(
        [np.append(rng.integers(3, TINY.vocab_size - 100, 12), 1) for _ in range(count)]
    ).astype(np.int32)


def copy(directory, tmp_path):
    target = str(tmp_path / "copy")
    shutil.copytree(directory, target)
    return target


def layer_file(directory, name="decoder.layers_1.mlp"):
    return os.path.join(directory, "layers", f"{name}.experts")


@pytest.mark.slow
def test_mapped_model_generates_the_tokens_of_the_loaded_model(checkpoints):
    compressed, mapped = checkpoints
    loaded, lazy = open_model(compressed), open_model(mapped, experts="mapped")
    assert (lazy.kind, lazy.experts, lazy.config) == ("mapped", "mapped", loaded.config)
    assert lazy.residency.stats["verified"] == 0  # nothing read before a token is routed
    config = DecodingConfig(method="greedy", max_decode_length=8, eos_id=-1)
    for batch in (1, 4):
        expected = np.asarray(generate(loaded.module, loaded.params, prompts(batch), config).tokens)
        got = np.asarray(generate(lazy.module, lazy.params, prompts(batch), config).tokens)
        np.testing.assert_array_equal(got, expected, err_msg=f"batch {batch}")
    stats = lazy.residency.stats
    assert stats["calls"] > 0 and 0 < stats["verified"] <= 2 * TINY.num_experts, stats


def test_mapped_stacks_alias_the_file_mapping(checkpoints):
    _, mapped = checkpoints
    model = open_model(mapped)
    layer = model.residency.layers["encoder.layers_1.mlp"]
    stacks = layer.stacks()
    placed = model.params["encoder"]["layers_1"]["mlp"]["expert"]["wi"]
    assert placed.codes.unsafe_buffer_pointer() == stacks["wi"].codes.ctypes.data
    np.testing.assert_array_equal(np.asarray(placed.codes), stacks["wi"].codes)


def test_conversion_keeps_every_array(checkpoints):
    compressed, mapped = checkpoints
    source, target = CompressedCheckpoint(compressed), MappedCheckpoint(mapped)
    for name in source.layer_names():
        arrays, _ = source.layer(name)
        for kernel, stack in target.open_layer(name).stacks().items():
            for array in ("codes", "row_offsets", "minmax"):
                np.testing.assert_array_equal(
                    getattr(stack, array), arrays[kernel][array], err_msg=f"{name}/{kernel}"
                )


def test_truncated_file_is_named_with_the_expert_at_open(checkpoints, tmp_path):
    directory = copy(checkpoints[1], tmp_path)
    path = layer_file(directory)
    os.truncate(path, os.path.getsize(path) - 4096)
    with pytest.raises(
        MappedExpertError, match=rf"{path} has .* bytes but the manifest recorded .*expert \d+"
    ):
        open_model(directory)


def test_file_truncated_after_open_is_an_error_not_a_fault(checkpoints, tmp_path):
    directory = copy(checkpoints[1], tmp_path)
    model = open_model(directory)
    path = layer_file(directory)
    os.truncate(path, 4096)
    config = DecodingConfig(method="greedy", max_decode_length=4, eos_id=-1)
    for _ in range(2):  # and again: the layer stays refused, even if the file got its size back
        with (
            pytest.raises(
                MappedExpertError, match=rf"{path} has 4096 bytes.*decoder.layers_1.mlp, expert \d+"
            ),
            model.residency.errors(),
        ):
            generate(model.module, model.params, prompts(2), config)
        os.truncate(path, model.residency.layers["decoder.layers_1.mlp"].index.bytes)


@pytest.mark.parametrize("verify", ["lazy", "full"])
def test_changed_byte_is_named_with_the_expert(checkpoints, tmp_path, verify):
    directory = copy(checkpoints[1], tmp_path)
    path = layer_file(directory)
    with open(path, "r+b") as f:  # the first codeword of expert 0 of the first kernel
        first = f.read(2)
        f.seek(0)
        f.write(bytes([first[0] ^ 1, first[1]]))
    pattern = rf"expert 0 of layer decoder.layers_1.mlp in {path} does not match its checksum"
    if verify == "full":
        with pytest.raises(MappedExpertError, match=pattern):
            open_model(directory, verify="full")
        return
    model = open_model(directory)  # lazy: nothing is read yet
    residency = model.residency
    with pytest.raises(MappedExpertError, match=pattern):
        residency.touch(
            "decoder.layers_1.mlp", np.array([1] + [0] * (TINY.num_experts - 1), np.int32)
        )
    residency.touch(
        "decoder.layers_1.mlp", np.array([0, 1] + [0] * (TINY.num_experts - 2), np.int32)
    )


def test_budget_releases_the_least_recently_routed_experts(checkpoints):
    model = open_model(checkpoints[1], expert_cache_gb=1e-9)
    residency = model.residency
    for expert in range(TINY.num_experts):
        counts = np.zeros(TINY.num_experts, np.int32)
        counts[expert] = 1
        residency.touch("encoder.layers_1.mlp", counts)
    assert list(residency.resident) == [("encoder.layers_1.mlp", TINY.num_experts - 1)]
    assert residency.stats["released"] == TINY.num_experts - 1


@pytest.mark.slow
def test_generate_cli_takes_the_mapped_form(checkpoints, tiny_tokenizer, tmp_path, capsys):
    compressed, mapped = checkpoints
    common = [
        "--tokenizer",
        tiny_tokenizer.model_path,
        "--prompt",
        "every <extra_id_0> layer",
        "--max_decode_length",
        "5",
    ]
    generate_cli.main(common + ["--checkpoint", compressed])
    expected = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    generate_cli.main(
        common
        + [
            "--checkpoint",
            mapped,
            "--experts",
            "mapped",
            "--verify",
            "full",
            "--expert_cache_gb",
            "0.5",
        ]
    )
    got = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    # The same tokens and text; the score to float rounding: the mapped layer sends each of the
    # prompt's few tokens through the one-token kernel, the loaded model's dispatch path an expert's
    # 4 or more tokens through the several-token one, which adds in another order (bit for bit alike
    # on some instruction sets only).
    assert [{k: v for k, v in line.items() if k != "score"} for line in got] == [
        {k: v for k, v in line.items() if k != "score"} for line in expected
    ]
    assert expected and [line["score"] for line in got] == pytest.approx(
        [line["score"] for line in expected], rel=1e-5, abs=1e-5
    )
    directory = copy(mapped, tmp_path)
    path = layer_file(directory, "encoder.layers_1.mlp")
    with open(path, "r+b") as f:  # every expert's first codeword
        index = MappedCheckpoint(directory).open_layer("encoder.layers_1.mlp").index
        for expert in range(TINY.num_experts):
            offset = index.kernels[0].regions(expert)[0][0]
            f.seek(offset)
            word = f.read(2)
            f.seek(offset)
            f.write(bytes([word[0] ^ 1, word[1]]))
    result = run_python(
        ["-m", "qmoe_jax.generate", "--checkpoint", directory, "--experts", "mapped"] + common,
        timeout=300,
    )
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("error: expert ")
    assert f"of layer encoder.layers_1.mlp in {path} does not match its checksum" in result.stderr


def test_disk_full_while_writing_removes_the_layer_file(checkpoints, tmp_path, monkeypatch):
    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(OSError, match="No space left"):
        convert_to_mapped(checkpoints[0], str(tmp_path / "out"))
    assert not [
        name for name in os.listdir(tmp_path / "out" / "layers") if name.endswith(".experts")
    ]


def test_bad_requests_are_refused_with_the_fix(checkpoints, tmp_path):
    compressed, mapped = checkpoints
    with pytest.raises(ValueError, match="convert a compressed checkpoint once"):
        open_model(compressed, experts="mapped")
    with pytest.raises(ValueError, match="whose experts are mapped"):
        open_model(mapped, experts="dense")
    with pytest.raises(
        CompressedCheckpointError, match="already holds a finished mapped checkpoint"
    ):
        convert_to_mapped(compressed, mapped)
    with pytest.raises(SystemExit):
        generate_cli.main(["--checkpoint", compressed, "--experts", "mapped", "--prompt", "x"])


def test_checkpoint_with_expert_adapters_is_not_converted(checkpoints, tmp_path):
    """A fine-tuned checkpoint's LoRA adapters (docs/format.md §8.9) have no place in the mapped
    layout: refused, never silently dropped."""
    import json

    source = copy(checkpoints[0], tmp_path)
    manifest_path = os.path.join(source, "manifest.json")
    with open(manifest_path) as f:
        manifest = json.load(f)
    manifest["adapters"] = {"rank": 2, "checksums": {}, "files": {}}
    with open(manifest_path, "w") as f:
        json.dump(manifest, f)
    with pytest.raises(CompressedCheckpointError, match="expert LoRA adapters"):
        convert_to_mapped(source, str(tmp_path / "mapped"))
    assert not os.path.exists(tmp_path / "mapped" / "layers")
