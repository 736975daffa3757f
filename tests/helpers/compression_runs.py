"""Compression runs of the tiny model in tests: options, and every array of a compressed
directory."""

import numpy as np

from qmoe_jax.checkpoints.format_v1 import CompressedCheckpoint
from qmoe_jax.compression.job import CompressionOptions


def options(setup, output_dir, **overrides):
    checkpoint, text, tokenizer = setup
    values = dict(
        checkpoint=checkpoint,
        tokenizer=tokenizer,
        calibration=f"text:{text}",
        num_samples=24,
        inputs_length=32,
        batch_size=8,
        group_size=2,
        output_dir=str(output_dir),
    )
    values.update(overrides)
    return CompressionOptions(**values)


def all_arrays(directory):
    checkpoint = CompressedCheckpoint(str(directory))
    return {name: checkpoint.layer(name)[0] for name in checkpoint.layer_names()}


def assert_same_arrays(a, b):
    assert a.keys() == b.keys()
    for layer in a:
        for kernel in a[layer]:
            for key in a[layer][kernel]:
                np.testing.assert_array_equal(
                    np.asarray(a[layer][kernel][key]),
                    np.asarray(b[layer][kernel][key]),
                    err_msg=f"{layer}/{kernel}/{key}",
                )
