"""Compression runs of the tiny model in tests: options, every array of a compressed
directory, and same-size damage to its Orbax trees."""

import json
import os

import numpy as np

from qmoe_jax.checkpoints.format_v1 import CompressedCheckpoint
from qmoe_jax.compression.options import CompressionOptions


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


def flip_bytes(tree) -> None:
    """Flips the middle byte of every data file of the Orbax tree ``tree``, leaving their sizes as
    they were.

    Which arrays a data file holds, and whether its middle byte lies in array bytes, a compressed
    chunk's header or an unreferenced B-tree node, depends on how the asynchronous write batched
    them. So a reader sees a checksum mismatch or an unreadable chunk (or, for some files,
    nothing); tests must accept either error."""
    for directory, _, names in os.walk(tree):
        if os.path.basename(directory) != "d":
            continue
        for name in names:
            with open(os.path.join(directory, name), "r+b") as f:
                f.seek(os.path.getsize(f.name) // 2)
                byte = f.read(1)[0]
                f.seek(-1, os.SEEK_CUR)
                f.write(bytes([byte ^ 0x10]))


def manifest_checksums(output_dir) -> dict[str, str]:
    """The SHA-256 of every array of a compressed directory, as its manifest records them, by
    ``dense/<path>`` and ``<layer>/<path>``."""
    with open(os.path.join(output_dir, "manifest.json")) as f:
        manifest = json.load(f)
    checksums = {f"dense/{path}": digest for path, digest in manifest["dense"]["checksums"].items()}
    for layer, record in manifest["layers"].items():
        checksums.update(
            {f"{layer}/{path}": digest for path, digest in record["checksums"].items()}
        )
    return checksums


def cli_flags(setup, output_dir, config_file) -> list[str]:
    """The flags of ``options(setup, output_dir)`` for ``python -m qmoe_jax.compress``
    (``config_file``: the tiny model's config as JSON)."""
    values = dict(vars(options(setup, output_dir)), config=config_file)
    names = ("checkpoint", "config", "tokenizer", "calibration", "num_samples", "inputs_length")
    flags = []
    for name in (*names, "batch_size", "group_size", "output_dir"):
        flags += [f"--{name}", str(values[name])]
    return flags
