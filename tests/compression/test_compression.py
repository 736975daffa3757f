import dataclasses
import json
import os
import pathlib
import signal
import time

import numpy as np
import pytest
from helpers.child_process import popen_python
from helpers.compression_runs import all_arrays, assert_same_arrays, options
from helpers.switch_fixtures import TINY, write_c4_shard
from helpers.text import synthetic_sentences

from qmoe_jax import compress
from qmoe_jax.checkpoints import open_t5x_checkpoint
from qmoe_jax.checkpoints.format_v1 import CompressedCheckpoint
from qmoe_jax.compression.job import compress_checkpoint
from qmoe_jax.compression.options import CompressionOptions
from qmoe_jax.compression.report import summary_table
from qmoe_jax.data import bundled
from qmoe_jax.inference import mean_cross_entropy
from qmoe_jax.inference.compressed_params import load_compressed_model
from qmoe_jax.inference.loading import infer_config
from qmoe_jax.models import SwitchTransformer
from qmoe_jax.models.configs import resolve_config


@pytest.mark.slow
def test_compress_tiny_end_to_end(tiny_setup, tmp_path):
    report = compress_checkpoint(
        options(tiny_setup, tmp_path / "out"), log=lambda _: None, progress=False, config=TINY
    )
    assert [layer["name"] for layer in report["layers"]] == [
        "encoder.layers_1.mlp",
        "decoder.layers_1.mlp",
    ]
    for layer in report["layers"]:
        assert 0.3 < layer["zero_fraction"] < 1.0
        assert layer["bits_per_weight"] > 0 and layer["tokens_per_expert"]["max"] > 0
    assert report["moe"]["compression_rate"] > 4
    assert os.path.isfile(tmp_path / "out" / "report.png")
    saved = json.loads((tmp_path / "out" / "report.json").read_text())
    assert saved["moe"] == report["moe"]
    # the CLI's own timing: every phase of the run, each a share of the total
    seconds = saved["seconds"]
    phases = ("data", "read", "dense", "hessian", "gptq", "encode", "forward", "write")
    assert all(seconds[phase] > 0 for phase in phases), seconds
    assert seconds["replay"] == 0 and sum(seconds[phase] for phase in phases) <= seconds["total"]
    assert seconds["read"] > sum(
        layer["seconds"]["read"] for layer in saved["layers"]
    )  # + non-expert weights

    model = load_compressed_model(str(tmp_path / "out"))
    wi = np.asarray(model.params["encoder"]["layers_1"]["mlp"]["expert"]["wi"]["kernel"])
    assert wi.shape == (TINY.num_experts, TINY.d_model, TINY.d_ff)
    for expert in wi:  # ternary: each output feature (a column here) holds at most {min, 0, max}
        assert max(len(np.unique(column)) for column in expert.T) <= 3
    tokens = np.arange(2, 34, dtype=np.int32).reshape(2, 16)
    example = [(tokens[0], tokens[1]), (tokens[1], tokens[0])]
    assert np.isfinite(
        mean_cross_entropy(SwitchTransformer(TINY), model.params, example, batch_size=2)
    )


def test_report_output_error_shows_gptq_fitting_its_hessian_positions(
    tiny_setup, compressed_tiny, tmp_path
):
    quiet = dict(log=lambda _: None, progress=False, config=TINY)
    rtn = compress_checkpoint(options(tiny_setup, tmp_path / "rtn", method="rtn"), **quiet)
    # compressed_tiny is the GPTQ run of the same settings
    gptq = json.loads((pathlib.Path(compressed_tiny[1]) / "report.json").read_text())
    for rtn_layer, gptq_layer in zip(rtn["layers"], gptq["layers"]):
        fitted, rounded = gptq_layer["output_error"], rtn_layer["output_error"]
        assert 0 < fitted["hessian_positions"] < 0.7 * rounded["hessian_positions"], (
            fitted,
            rounded,
        )
    encoder, decoder = (layer["output_error"] for layer in gptq["layers"])
    assert encoder["premasked_positions"] > 0  # the default premask drops encoder sentinels only
    assert decoder["premasked_positions"] is None
    assert " / -" in summary_table(gptq)


@pytest.mark.slow
def test_rtn_and_kbit(tiny_setup, tmp_path):
    rtn = compress_checkpoint(
        options(tiny_setup, tmp_path / "rtn", method="rtn"),
        log=lambda _: None,
        progress=False,
        config=TINY,
    )
    assert all(layer["fallback_experts"] == 0 for layer in rtn["layers"])
    two_bit = compress_checkpoint(
        options(tiny_setup, tmp_path / "2bit", grid="2bit"),
        log=lambda _: None,
        progress=False,
        config=TINY,
    )
    assert all(
        abs(
            layer["bits_per_weight"]
            - (
                2
                + 64 / layer["kernels"]["wi"]["cols"] / 2
                + 64 / layer["kernels"]["wo"]["cols"] / 2
            )
        )
        < 1e-9
        for layer in two_bit["layers"]
    )
    model = load_compressed_model(str(tmp_path / "2bit"))
    wo = np.asarray(model.params["decoder"]["layers_1"]["mlp"]["expert"]["wo"]["kernel"])
    assert max(len(np.unique(column)) for expert in wo for column in expert.T) <= 4


RUNNER = """
from helpers.switch_fixtures import TINY
from qmoe_jax.compression.job import compress_checkpoint
from qmoe_jax.compression.options import CompressionOptions
from qmoe_jax.models.configs import resolve_config
options = CompressionOptions(**{options!r})
compress_checkpoint(options, log=lambda line: print(line, flush=True), progress=False, config=TINY)
"""


def run_compression(options_dict, kill_after_layers=None, **env):
    code = RUNNER.format(options=options_dict)
    process = popen_python(["-c", code], **env)
    if kill_after_layers is None:
        output = process.communicate(timeout=600)[0].decode()
        assert process.returncode == 0, output
        return
    manifest = os.path.join(options_dict["output_dir"], "manifest.json")
    deadline = time.time() + 600
    while time.time() < deadline:
        if os.path.exists(manifest):
            try:
                with open(manifest) as f:
                    if len(json.load(f)["layers"]) >= kill_after_layers:
                        break
            except (json.JSONDecodeError, OSError):
                pass
        assert process.poll() is None, process.stdout.read().decode()
        time.sleep(0.05)
    process.send_signal(signal.SIGKILL)
    process.wait()


@pytest.mark.slow
def test_resume_after_kill_is_bit_identical(tiny_setup, tmp_path):
    base = vars(options(tiny_setup, tmp_path / "whole"))
    run_compression(base)
    resumed = dict(base, output_dir=str(tmp_path / "resumed"))
    run_compression(resumed, kill_after_layers=1)
    assert CompressedCheckpoint(resumed["output_dir"]).complete is False
    assert len(CompressedCheckpoint(resumed["output_dir"]).layer_names()) == 1
    run_compression(resumed)
    assert CompressedCheckpoint(resumed["output_dir"]).complete
    assert_same_arrays(all_arrays(base["output_dir"]), all_arrays(resumed["output_dir"]))


@pytest.mark.slow
def test_four_devices_give_the_same_codes(tiny_setup, tmp_path):
    one = vars(options(tiny_setup, tmp_path / "one", group_size=4))
    four = dict(one, output_dir=str(tmp_path / "four"))
    run_compression(one)
    run_compression(four, XLA_FLAGS="--xla_force_host_platform_device_count=4")
    assert_same_arrays(all_arrays(one["output_dir"]), all_arrays(four["output_dir"]))


@pytest.mark.slow
def test_fused_kernels_run_the_compressed_model(tiny_setup, tmp_path):
    compress_checkpoint(
        options(tiny_setup, tmp_path / "out"), log=lambda _: None, progress=False, config=TINY
    )
    dense = load_compressed_model(str(tmp_path / "out"))
    fused = load_compressed_model(str(tmp_path / "out"), experts="compressed")
    assert (
        type(fused.params["encoder"]["layers_1"]["mlp"]["expert"]["wi"]).__name__
        == "CompressedExperts"
    )
    tokens = np.arange(3, 35, dtype=np.int32).reshape(2, 16)
    args = (tokens, tokens[:, ::-1].copy(), tokens)
    expected = dense.module().apply({"params": dense.params}, *args)
    got = fused.module().apply({"params": fused.params}, *args)
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_true_sequential_and_act_order_change_only_what_they_should(tiny_setup, tmp_path):
    quiet = dict(log=lambda _: None, progress=False, config=TINY)
    compress_checkpoint(options(tiny_setup, tmp_path / "plain"), **quiet)
    compress_checkpoint(options(tiny_setup, tmp_path / "seq", true_sequential=True), **quiet)
    compress_checkpoint(options(tiny_setup, tmp_path / "act", act_order=True), **quiet)
    plain, seq, act = (all_arrays(str(tmp_path / name)) for name in ("plain", "seq", "act"))
    first = "encoder.layers_1.mlp"  # later layers see other inputs once one layer differs
    # True-sequential changes wo's Hessian only: the input kernel is quantized the same way.
    np.testing.assert_array_equal(plain[first]["wi"]["codes"], seq[first]["wi"]["codes"])
    assert not np.array_equal(plain[first]["wo"]["codes"], seq[first]["wo"]["codes"])
    assert not np.array_equal(plain[first]["wi"]["codes"], act[first]["wi"]["codes"])
    model = load_compressed_model(str(tmp_path / "seq"))
    tokens = np.arange(2, 34, dtype=np.int32).reshape(2, 16)
    example = [(tokens[0], tokens[1]), (tokens[1], tokens[0])]
    assert np.isfinite(
        mean_cross_entropy(SwitchTransformer(TINY), model.params, example, batch_size=2)
    )


def test_premask_changes_only_the_decoder_hessians(tiny_setup, compressed_tiny, tmp_path):
    quiet = dict(log=lambda _: None, progress=False, config=TINY)
    compress_checkpoint(options(tiny_setup, tmp_path / "qmoe", premask="encoder_decoder"), **quiet)
    # compressed_tiny is the run with the default premask, "encoder"
    default, qmoe = all_arrays(compressed_tiny[1]), all_arrays(str(tmp_path / "qmoe"))
    for kernel in (
        "wi",
        "wo",
    ):  # the encoder masks are the same; QMoE's also drops decoder positions
        np.testing.assert_array_equal(
            default["encoder.layers_1.mlp"][kernel]["codes"],
            qmoe["encoder.layers_1.mlp"][kernel]["codes"],
        )
    assert not np.array_equal(
        default["decoder.layers_1.mlp"]["wi"]["codes"], qmoe["decoder.layers_1.mlp"]["wi"]["codes"]
    )
    checkpoint = CompressedCheckpoint(str(tmp_path / "qmoe"))
    assert checkpoint.header["settings"]["premask"] == "encoder_decoder"
    assert (
        checkpoint.manifest["layers"]["decoder.layers_1.mlp"]["stats"]["output_error"][
            "premasked_positions"
        ]
        > 0
    )
    with pytest.raises(
        ValueError, match="unknown premask 'all'; choose one of encoder, encoder_decoder, none"
    ):
        options(tiny_setup, tmp_path / "bad", premask="all")


@pytest.mark.slow
def test_config_is_inferred_from_checkpoint_shapes(tiny_setup):
    assert infer_config(open_t5x_checkpoint(bundled.checkpoint_path())).name == "switch-mini-8"
    with pytest.raises(ValueError, match=r"0 known configs match its shapes.*pass --config"):
        infer_config(open_t5x_checkpoint(tiny_setup[0]))


def test_resolve_config_reads_names_and_json_files(tmp_path):
    assert resolve_config("switch-base-128").num_experts == 128
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(dataclasses.asdict(TINY)))
    assert resolve_config(str(path)) == TINY
    path.write_text(json.dumps({"d_model": 8, "no_such_field": 1}))
    with pytest.raises(ValueError, match="is not a SwitchConfig"):
        resolve_config(str(path))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_config(str(tmp_path / "missing.json"))


def test_cli_compresses_c4_text_and_scores_both_models(tiny_setup, tmp_path, capsys):
    """The CLI's own path: flags -> options -> config from a JSON file -> C4 shards -> report with
    both losses."""
    checkpoint, _, tokenizer = tiny_setup
    config_path = tmp_path / "tiny.json"
    config_path.write_text(json.dumps(dataclasses.asdict(TINY)))
    c4 = tmp_path / "c4"
    c4.mkdir()
    write_c4_shard(c4 / "c4-train.00000-of-00002.json.gz", synthetic_sentences(300, seed=3))
    write_c4_shard(c4 / "c4-validation.00000-of-00001.json.gz", synthetic_sentences(100, seed=4))
    output = tmp_path / "out"
    compress.main(
        [
            "--checkpoint",
            checkpoint,
            "--config",
            str(config_path),
            "--tokenizer",
            tokenizer,
            "--calibration",
            f"c4:{c4}",
            "--num_samples",
            "16",
            "--inputs_length",
            "32",
            "--batch_size",
            "8",
            "--group_size",
            "2",
            "--eval_examples",
            "12",
            "--output_dir",
            str(output),
        ]
    )
    printed = capsys.readouterr().out
    report = json.loads((output / "report.json").read_text())
    evaluation = report["evaluation"]
    assert evaluation["data"] == f"c4:{c4}" and evaluation["examples"] == 12
    assert np.isfinite(evaluation["original_loss"]) and np.isfinite(evaluation["compressed_loss"])
    assert evaluation["original_loss"] != evaluation["compressed_loss"]
    assert f"original {evaluation['original_loss']:.4f}" in printed
    assert f"python -m qmoe_jax.evaluate --checkpoint {output}" in printed
    assert f"python -m qmoe_jax.generate --checkpoint {output}" in printed
    assert report["settings"]["calibration"] == f"c4:{c4}" and report["grid"] == {
        "kind": "ternary",
        "bits": None,
    }


def test_header_records_every_setting_that_changes_the_output():
    recorded = set(CompressionOptions().header_settings())
    assert recorded == {field.name for field in dataclasses.fields(CompressionOptions)} - {
        "checkpoint",
        "config",
        "output_dir",
        "eval_examples",
        "eval_data",
        "nonfinite",
        "verify",
    }


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--group_size", "0"], "group_size must be at least 1"),
        (["--batch_size", "0"], "batch_size must be at least 1"),
        (["--damping", "0"], "damping must be > 0"),
        (["--eval_examples", "5", "--calibration", "text:*.txt"], "needs validation text"),
        (
            ["--eval_data", "c5:/data"],
            "eval_data must be 'bundled' or 'c4:<dir or glob>', got 'c5:/data'",
        ),
        (["--config", "switch-base-9"], "unknown SwitchTransformer config 'switch-base-9'"),
        (["--nonfinite", "drop"], "argument --nonfinite: invalid choice: 'drop'"),
    ],
)
def test_cli_rejects_bad_flags_before_any_work(flags, message, capsys):
    with pytest.raises(SystemExit) as exited:
        compress.parse_options(flags)
    assert exited.value.code == 2
    assert message in capsys.readouterr().err
