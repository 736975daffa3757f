"""Importing the QMoE authors' published layout (python -m qmoe_jax.import_qmoe) and the torch-free
.pt reader."""

import collections
import dataclasses
import json
import os
import re
import shutil

import jax
import numpy as np
import pytest
from helpers.child_process import run_python
from helpers.qmoe_fixtures import (
    BF16,
    Call,
    Global,
    hf_config,
    save_pt,
    t5x_to_hf,
    ternary_state,
    write_qmoe_directory,
)

from qmoe_jax import import_qmoe as import_cli
from qmoe_jax.checkpoints import hf_names, torch_pickle
from qmoe_jax.checkpoints.format_v1 import CompressedCheckpoint
from qmoe_jax.codec import decode_codes, encode
from qmoe_jax.inference.compressed_params import load_compressed_model
from qmoe_jax.interop import qmoe_import
from qmoe_jax.interop.qmoe_config import read_qmoe_config
from qmoe_jax.interop.qmoe_layout import QMoEDirectory
from qmoe_jax.kernels import ops
from qmoe_jax.models import get_config, param_shapes

TOLERANCE = 1e-4


def quiet(_):
    pass


def torch_free_directory(root, full_sparse=False, seed=0):
    """A random model in the authors' layout, written without torch; returns (directory, config,
    ternary state)."""
    values = hf_config(full_sparse=full_sparse, tied=not full_sparse)
    root.mkdir(parents=True, exist_ok=True)
    config_path = root / "probe.json"
    config_path.write_text(json.dumps(values))
    config, _ = read_qmoe_config(str(config_path))
    state = ternary_state(t5x_to_hf(random_tree(config, seed), config))
    directory = str(root / "model_qmoe")
    write_qmoe_directory(directory, values, state, use_torch=False)
    return directory, config, state


def random_tree(config, seed):
    """Random parameters of the model's shapes (norm scales near 1), without compiling its init."""
    rng = np.random.default_rng(seed)

    def leaf(path, shape):
        noise = rng.standard_normal(shape.shape).astype(np.float32)
        return 1 + 0.1 * noise if path[-1].key == "scale" else 0.2 * noise

    return jax.tree_util.tree_map_with_path(leaf, param_shapes(config))


@pytest.fixture(scope="module")
def torch_free(tmp_path_factory):
    return torch_free_directory(tmp_path_factory.mktemp("qmoe"), full_sparse=True)


# ---- the .pt reader
# --------------------------------------------------------------------------------


def test_reader_reads_the_torch_free_writer(tmp_path):
    values = collections.OrderedDict(
        a=np.arange(6, dtype=np.int16).reshape(2, 3),
        b=np.float32(2) * np.ones(3, BF16),
        c=np.zeros(0, BF16),
        d=np.arange(4, dtype=np.int32),
    )
    save_pt({"state": values, "n": 7}, str(tmp_path / "x.pt"))
    loaded = torch_pickle.load(str(tmp_path / "x.pt"))
    assert loaded["n"] == 7 and list(loaded["state"]) == ["a", "b", "c", "d"]
    for key, value in values.items():
        assert loaded["state"][key].dtype == value.dtype and np.array_equal(
            loaded["state"][key], value
        )
    lazy = torch_pickle.load(str(tmp_path / "x.pt"), lazy=True)["state"]["a"]
    out = np.empty((2, 3), np.int16)
    lazy.read_into(out)
    assert np.array_equal(out, values["a"])


def test_readers_agree_with_torch(tmp_path):
    torch = pytest.importorskip("torch")
    state = {
        "bf16": torch.randn(5, 7).bfloat16(),
        "transposed": torch.randn(4, 6).t(),
        "view": torch.arange(20, dtype=torch.int32)[3:11],
        "int16": torch.tensor([-3, 0, 32767], dtype=torch.int16),
        "empty": torch.zeros(0, dtype=torch.bfloat16),
        "f64": torch.randn(3).double(),
        "sizes": 12,
    }
    torch.save(state, tmp_path / "t.pt")
    ours = torch_pickle.load(str(tmp_path / "t.pt"))
    theirs = torch.load(tmp_path / "t.pt", weights_only=True)
    for key, value in theirs.items():
        if isinstance(value, int):
            assert ours[key] == value
            continue
        expected = value.float().numpy() if value.dtype == torch.bfloat16 else value.numpy()
        assert ours[key].shape == tuple(value.shape)
        np.testing.assert_array_equal(np.asarray(ours[key], expected.dtype), expected)
    # and torch reads what the torch-free writer writes, to the same values
    save_pt(
        {"a": np.arange(6, dtype=np.int16).reshape(2, 3), "b": np.ones(4, BF16)},
        str(tmp_path / "f.pt"),
    )
    back = torch.load(tmp_path / "f.pt", weights_only=True)
    assert back["a"].tolist() == [[0, 1, 2], [3, 4, 5]] and back["b"].dtype == torch.bfloat16


def test_forbidden_global_is_refused(tmp_path):
    marker = tmp_path / "ran"
    save_pt({"x": Call(Global("os", "system"), (f"touch {marker}",))}, str(tmp_path / "evil.pt"))
    with pytest.raises(torch_pickle.UnsafePickleError, match=r"evil\.pt.*global os\.system"):
        torch_pickle.load(str(tmp_path / "evil.pt"))
    assert not marker.exists()


def test_malformed_files_name_themselves(tmp_path):
    path = tmp_path / "x.pt"
    path.write_bytes(b"not a zip")
    with pytest.raises(torch_pickle.TorchFileError, match=r"x\.pt is not a complete PyTorch file"):
        torch_pickle.load(str(path))
    path.write_text("version https://git-lfs.github.com/spec/v1\noid sha256:00\nsize 5\n")
    with pytest.raises(
        torch_pickle.TorchFileError, match=r"x\.pt is a Git LFS pointer.*git lfs pull"
    ):
        torch_pickle.load(str(path))


# ---- the importer
# ----------------------------------------------------------------------------------


def test_import_copies_streams_bit_for_bit(torch_free, tmp_path, dictionary):
    directory, config, state = torch_free
    report = qmoe_import.import_qmoe(directory, str(tmp_path / "out"), log=quiet, progress=False)
    checkpoint = CompressedCheckpoint(str(tmp_path / "out"))
    assert (
        checkpoint.complete and len(report["layers"]) == 2 * config.num_encoder_layers
    )  # every block sparse
    dense = checkpoint.dense_params()
    expected_dense = hf_names.hf_to_t5x(
        {k: v.astype(BF16) for k, v in state.items()}, config, experts=False
    )
    for path, value in jax.tree_util.tree_leaves_with_path(expected_dense):
        stored = dense
        for key in path:
            stored = stored[key.key]
        assert np.asarray(stored).dtype == BF16 and np.array_equal(np.asarray(stored), value)
    files = {}
    for name in checkpoint.layer_names():
        arrays, stats = checkpoint.layer(name)
        files[stats["source_file"]] = stats["source_sha256"]
        stack, index = name.split(".")[0], int(name.split(".")[1].removeprefix("layers_"))
        for kernel, stored in arrays.items():
            for e in range(config.num_experts):
                q = state[f"{hf_names.expert_name(stack, index, e)}.{kernel}.weight"]
                minmax = np.stack([q.min(1), q.max(1)], 1).astype(BF16)
                codes = np.zeros(q.shape, np.uint8)
                codes[q == minmax[:, 0:1].astype(np.float32)] = 1
                codes[q == minmax[:, 1:2].astype(np.float32)] = 2
                fresh = encode(codes, minmax, dictionary)
                n = int(stored["row_offsets"][e, -1])
                assert np.array_equal(np.asarray(stored["codes"])[e, :n], np.asarray(fresh.codes))
                assert np.array_equal(
                    np.asarray(stored["row_offsets"])[e], np.asarray(fresh.row_offsets)
                )
                assert np.array_equal(
                    np.asarray(stored["minmax"])[e].view(np.uint16), minmax.view(np.uint16)
                )
    provenance = checkpoint.manifest["report"]["provenance"]
    assert provenance["source"] == os.path.abspath(directory)
    assert set(provenance["sha256"]) == {"config.json", "noexp.pt", "sizes.pt"} | set(files)
    assert all(len(h) == 64 for h in provenance["sha256"].values())
    layer = report["layers"][0]
    assert 0 < layer["bits_per_weight"] < 16 and 0 < layer["zero_fraction"] < 1


def test_min_zero_rows_decode_to_their_weights(torch_free, tmp_path, dictionary):
    """A row without negative weights stores min 0 and codes its zeros 1; decoding follows the
    codes."""
    directory, _, state = torch_free
    out = str(tmp_path / "out")
    qmoe_import.import_qmoe(directory, out, log=quiet, progress=False)
    q = state["encoder.block.0.layer.1.mlp.experts.expert_0.wi.weight"]
    dense = load_compressed_model(out, experts="dense").params["encoder"]["layers_0"]["mlp"][
        "expert"
    ]["wi"]
    np.testing.assert_array_equal(np.asarray(dense["kernel"][0]).T, q)
    stack = load_compressed_model(out, experts="compressed").params["encoder"]["layers_0"]["mlp"][
        "expert"
    ]["wi"]
    minmax = np.asarray(stack.minmax[0]).astype(np.float32)
    codes = decode_codes(jax.device_get(stack[0]), dictionary)
    assert minmax[0, 0] == 0 and (q[0] == 0).any() and (codes[0][q[0] == 0] == 1).all()
    assert minmax[1, 0] == minmax[1, 1] == 0 and (q[1] == 0).all()  # an all-zero row
    np.testing.assert_array_equal(np.asarray(ops.dequantize(stack[0], dictionary), np.float32), q)


def test_truncated_layer_file_is_named(torch_free, tmp_path):
    directory, _, _ = torch_free
    copy = tmp_path / "copy_qmoe"
    shutil.copytree(directory, copy)
    path = copy / "exp01.pt"
    path.write_bytes(path.read_bytes()[: os.path.getsize(path) // 2])
    with pytest.raises(
        torch_pickle.TorchFileError, match=r"exp01\.pt is not a complete PyTorch file"
    ):
        qmoe_import.import_qmoe(str(copy), str(tmp_path / "out"), log=quiet, progress=False)
    result = run_python(
        ["-m", "qmoe_jax.import_qmoe", str(copy), "--output_dir", str(tmp_path / "out2")],
        timeout=300,
    )
    assert result.returncode == 1 and "exp01.pt is not a complete PyTorch file" in result.stderr
    assert "Traceback" not in result.stderr


def test_import_resumes_after_interruption(torch_free, tmp_path, monkeypatch):
    directory, _, _ = torch_free
    whole = str(tmp_path / "whole")
    qmoe_import.import_qmoe(directory, whole, log=quiet, progress=False)
    calls = []
    real = qmoe_import.read_layer

    def interrupted(*args):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*args)

    monkeypatch.setattr(qmoe_import, "read_layer", interrupted)
    resumed = str(tmp_path / "resumed")
    with pytest.raises(KeyboardInterrupt) as caught:
        qmoe_import.import_qmoe(directory, resumed, log=quiet, progress=False)
    assert "resume (2 of 4 layers imported)" in caught.value.__notes__[0]
    monkeypatch.setattr(qmoe_import, "read_layer", real)
    lines = []
    qmoe_import.import_qmoe(directory, resumed, log=lines.append, progress=False)
    assert any("resuming: 2 of 4 layers" in line for line in lines)
    a, b = CompressedCheckpoint(whole).manifest, CompressedCheckpoint(resumed).manifest
    assert {n: r["checksums"] for n, r in a["layers"].items()} == {
        n: r["checksums"] for n, r in b["layers"].items()
    }
    assert a["dense"]["checksums"] == b["dense"]["checksums"]


def test_changed_source_is_refused_on_resume(tmp_path):
    directory, _, _ = torch_free_directory(tmp_path / "a")
    out = str(tmp_path / "out")
    qmoe_import.import_qmoe(directory, out, log=quiet, progress=False)
    other, _, _ = torch_free_directory(tmp_path / "b", seed=1)
    with pytest.raises(qmoe_import.ImportRefusedError, match=re.escape("noexp.pt changed")):
        qmoe_import.import_qmoe(other, out, log=quiet, progress=False)


def test_published_configs_map_to_the_registered_ones(tmp_path):
    """config.json as the authors save it (HF's fields, their c-2048 edits) gives our registered
    configs."""
    # google/switch-base-128's config.json as the authors save it (torch_dtype set to bfloat16), and
    # switch-c-2048_qmoe's: HF's fields (is_full_sparse, encoder_sparse_step 1, decoder_sparse_step
    # 0) with the authors' edits (num_decoder_layers 15 instead of HF's 12, untied embeddings,
    # expert_capacity 1024).
    base = {
        "model_type": "switch_transformers",
        "_name_or_path": "google/switch-base-128",
        "vocab_size": 32128,
        "d_model": 768,
        "d_kv": 64,
        "d_ff": 3072,
        "num_heads": 12,
        "num_layers": 12,
        "num_decoder_layers": 12,
        "num_experts": 128,
        "num_sparse_encoder_layers": 6,
        "num_sparse_decoder_layers": 6,
        "encoder_sparse_step": 2,
        "decoder_sparse_step": 2,
        "dense_act_fn": "relu",
        "is_gated_act": False,
        "relative_attention_num_buckets": 32,
        "relative_attention_max_distance": 128,
        "torch_dtype": "bfloat16",
    }
    c2048 = dict(
        base,
        _name_or_path="google/switch-c-2048",
        d_model=2080,
        d_ff=6144,
        num_heads=30,
        num_layers=15,
        num_decoder_layers=15,
        num_experts=2048,
        num_sparse_encoder_layers=15,
        num_sparse_decoder_layers=15,
        encoder_sparse_step=1,
        decoder_sparse_step=0,
        is_full_sparse=True,
        tie_word_embeddings=False,
        expert_capacity=1024,
    )
    for values, name in ((base, "switch-base-128"), (c2048, "switch-c-2048")):
        (tmp_path / "config.json").write_text(json.dumps(values))
        config, differences = read_qmoe_config(str(tmp_path / "config.json"))
        assert differences == [] and config.name == name
        registered = get_config(name)
        assert (config.num_encoder_sparse_layers, config.logits_dense, config.group_size) == (
            registered.num_encoder_sparse_layers,
            registered.logits_dense,
            registered.group_size,
        )
    (tmp_path / "config.json").write_text(json.dumps(dict(c2048, d_ff=6000)))
    config, differences = read_qmoe_config(str(tmp_path / "config.json"))
    assert config.d_ff == 6000 and differences == [
        "d_ff: config.json 6000, get_config('switch-c-2048') 6144"
    ]


def test_other_directories_are_refused(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(
        ValueError, match=r"is not a QMoE model directory: it lacks noexp.pt, sizes.pt, exp\*.pt"
    ):
        QMoEDirectory(str(tmp_path))


# ---- against Hugging Face, and the CLIs
# -----------------------------------------------------------


def hf_directory(root, full_sparse: bool, seed: int):
    """A random HF Switch with ternary experts, written with torch.save; returns (directory, HF
    model)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    values = hf_config(full_sparse=full_sparse, tied=not full_sparse)
    torch.manual_seed(seed)
    model = transformers.SwitchTransformersForConditionalGeneration(
        transformers.SwitchTransformersConfig(
            **{k: v for k, v in values.items() if k != "torch_dtype"}
        )
    ).eval()
    model.encoder.embed_tokens.weight.data.copy_(model.shared.weight.data)
    model.decoder.embed_tokens.weight.data.copy_(model.shared.weight.data)
    state = ternary_state({k: v.detach().numpy() for k, v in model.state_dict().items()})
    model.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()})
    directory = str(root / "hf_qmoe")
    write_qmoe_directory(directory, values, state, use_torch=True)
    return directory, model


@pytest.mark.parity
@pytest.mark.parametrize("full_sparse", [False, True], ids=["base-like", "c2048-like"])
def test_imported_logits_equal_hugging_face(tmp_path, full_sparse):
    torch = pytest.importorskip("torch")
    directory, hf_model = hf_directory(tmp_path, full_sparse, seed=3)
    out = str(tmp_path / "out")
    qmoe_import.import_qmoe(directory, out, log=quiet, progress=False)
    rng = np.random.default_rng(0)
    encoder_tokens = rng.integers(2, 164, (2, 16)).astype(np.int32)
    targets = rng.integers(2, 164, (2, 8)).astype(np.int32)
    decoder_inputs = np.concatenate([np.zeros((2, 1), np.int32), targets[:, :-1]], axis=1)
    torch.set_flush_denormal(True)
    try:
        with torch.no_grad():
            expected = hf_model(
                input_ids=torch.from_numpy(encoder_tokens).long(),
                decoder_input_ids=torch.from_numpy(decoder_inputs).long(),
            ).logits.numpy()
    finally:
        torch.set_flush_denormal(False)
    for experts in ("compressed", "dense"):
        loaded = load_compressed_model(out, experts=experts)
        config = loaded.config
        loaded.config = dataclasses.replace(
            config, eval_capacity_factor=float(config.num_experts), min_expert_capacity=64
        )
        logits = np.asarray(
            loaded.module().apply(
                {"params": loaded.params}, encoder_tokens, decoder_inputs, targets
            )
        )
        assert np.abs(logits - expected).max() <= TOLERANCE, experts
    assert np.abs(expected).max() > 0.1


@pytest.mark.slow
def test_evaluate_and_generate_run_on_an_import(torch_free, tmp_path, tiny_tokenizer):
    directory, _, _ = torch_free
    out = str(tmp_path / "imported")
    import_cli.main([directory, "--output_dir", out])
    assert CompressedCheckpoint(out).complete
    result = run_python(
        [
            "-m",
            "qmoe_jax.evaluate",
            "--checkpoint",
            out,
            "--tokenizer",
            tiny_tokenizer.model_path,
            "--num_samples",
            "4",
            "--inputs_length",
            "32",
            "--batch_size",
            "4",
        ],
        timeout=600,
    )
    assert result.returncode == 0, result.stderr
    line = json.loads(result.stdout.strip().splitlines()[-1])
    assert (
        np.isfinite(line["validation_loss"])
        and line["examples"] == 4
        and line["experts"] == "compressed"
    )
    result = run_python(
        [
            "-m",
            "qmoe_jax.generate",
            "--checkpoint",
            out,
            "--tokenizer",
            tiny_tokenizer.model_path,
            "--prompt",
            "the small <extra_id_0> model",
            "--max_decode_length",
            "4",
        ],
        timeout=600,
    )
    assert result.returncode == 0, result.stderr
    assert (
        json.loads(result.stdout.strip().splitlines()[-1])["inputs"]
        == "the small <extra_id_0> model"
    )


def test_damaged_layer_is_imported_again(torch_free, tmp_path):
    directory, _, _ = torch_free
    out = tmp_path / "out"
    qmoe_import.import_qmoe(directory, str(out), log=quiet, progress=False)
    before = CompressedCheckpoint(str(out)).manifest["layers"]["decoder.layers_1.mlp"]["checksums"]
    (out / "layers" / "decoder.layers_1.mlp" / "arrays" / "manifest.ocdbt").unlink()
    lines = []
    qmoe_import.import_qmoe(directory, str(out), log=lines.append, progress=False)
    assert any(line.startswith("repairing layer decoder.layers_1.mlp") for line in lines)
    checkpoint = CompressedCheckpoint(str(out))
    assert (
        checkpoint.complete
        and checkpoint.manifest["layers"]["decoder.layers_1.mlp"]["checksums"] == before
    )
    checkpoint.layer("decoder.layers_1.mlp")  # reads back, checksums verified
