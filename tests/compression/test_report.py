"""report.json's layer list: the same order after a resume as after a clean run."""

import os

from qmoe_jax.checkpoints.compressed_trees import write_json_atomic
from qmoe_jax.checkpoints.output_dir import read_json_object
from qmoe_jax.compression.report import build_report

PASS_ORDER = [f"encoder.layers_{i}.mlp" for i in (1, 3, 5, 7, 9, 11)] + [
    f"decoder.layers_{i}.mlp" for i in (1, 3, 5, 7, 9, 11)
]


def layer_record(index: int) -> dict:
    kernel = {"rows": 4, "cols": 8, "zero_fraction": 0.5 + index / 100, "codewords": 10 + index}
    return {
        "stats": {
            "kernels": {"wi": kernel, "wo": dict(kernel, rows=8, cols=4)},
            "dictionary": None,
            "fallback_experts": index,
            "seconds": {"gptq": float(index)},
        }
    }


def manifest_with(layers: list[str]) -> dict:
    return {
        "header": {
            "model": {"name": "switch-test", "num_experts": 2},
            "source": "source",
            "grid": {"kind": "ternary"},
            "settings": {},
        },
        "dictionaries": {},
        "nonfinite_zeroed": {},
        "layers": {name: layer_record(PASS_ORDER.index(name)) for name in layers},
    }


def test_a_resumed_runs_report_lists_the_layers_in_pass_order(tmp_path):
    clean = build_report(manifest_with(PASS_ORDER), 1000, 100, {})
    # A run killed at 60 %: its manifest is read back from disk (keys sorted), then the rest follow.
    path = os.path.join(tmp_path, "manifest.json")
    write_json_atomic(path, manifest_with(PASS_ORDER[:8]))
    resumed = read_json_object(path)
    for name in PASS_ORDER[8:]:
        resumed["layers"][name] = layer_record(PASS_ORDER.index(name))
    report = build_report(resumed, 1000, 100, {})
    assert [layer["name"] for layer in report["layers"]] == PASS_ORDER
    assert report["layers"] == clean["layers"]
    assert [layer["fallback_experts"] for layer in report["layers"]] == list(range(12))
