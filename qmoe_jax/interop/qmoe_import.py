"""Importing a published QMoE model into a compressed checkpoint, without recompressing
(docs/qmoe_import.md).

``import_qmoe`` reads a downloaded ``*_qmoe`` directory (the authors' layout,
``qmoe_layout``) and writes our compressed checkpoint (docs/format.md §8)
with ``CompressedCheckpointWriter``: the dense parameters from ``noexp.pt``,
the authors' dictionary (p0 = 0.885, identical to theirs bit for bit), and
one layer per ``expNN.pt``, its code streams copied bit for bit. One layer
file is read at a time, so peak memory is about one layer plus the dense
parameters.

Provenance: the manifest header names the source directory and carries the
SHA-256 of ``config.json``, ``noexp.pt`` and ``sizes.pt`` and the size of every
``expNN.pt``; each layer's stats carry its ``expNN.pt``'s SHA-256, and the
finished manifest's ``report.provenance`` lists every file's SHA-256.
Re-running the same command resumes after the last finished layer; a source
that changed since (other config, sizes or hashes) is refused, naming what
changed.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Callable

import numpy as np
from tqdm import tqdm

from qmoe_jax.checkpoints.format_v1 import (
    COMPRESSED_OUTPUT,
    CompressedCheckpointError,
    CompressedCheckpointWriter,
)
from qmoe_jax.checkpoints.manifest_rebuild import rebuild_lost_manifest
from qmoe_jax.checkpoints.output_dir import claimed
from qmoe_jax.checkpoints.shapes import path_shapes
from qmoe_jax.codec.dictionary import DEFAULT_P0, build_dictionary
from qmoe_jax.compression.report import build_report, summary_table, write_report
from qmoe_jax.data.corpus import file_sha256
from qmoe_jax.interop.qmoe_layout import (
    CONFIG,
    DENSE,
    SIZES,
    LayerFile,
    QMoEDirectory,
    QMoELayoutError,
    read_layer,
)
from qmoe_jax.malloc import release_free_memory
from qmoe_jax.models import param_shapes
from qmoe_jax.quant import GridConfig

IMPORTER = "qmoe_jax.import_qmoe"
VERIFY_LEVELS = ("quick", "full")


class ImportRefusedError(CompressedCheckpointError):
    """The output directory holds an import that this one may not continue."""


def _header(directory: QMoEDirectory) -> dict:
    files = {
        name: {
            "bytes": os.path.getsize(directory.file(name)),
            "sha256": file_sha256(directory.file(name)),
        }
        for name in (CONFIG, DENSE, SIZES)
    }
    files |= {
        os.path.basename(path): {"bytes": os.path.getsize(path)} for path in directory.layer_paths
    }
    return {
        "model": dataclasses.asdict(directory.config),
        "source": directory.path,
        "source_files": files,
        "grid": dataclasses.asdict(GridConfig()),
        "settings": {"importer": IMPORTER, "dictionary_p0": DEFAULT_P0},
    }


def _check_resume(stored: dict, header: dict, output_dir: str) -> None:
    old, new = stored["header"], json.loads(json.dumps(header))
    if old.get("settings", {}).get("importer") != IMPORTER:
        raise ImportRefusedError(
            f"{output_dir} holds a checkpoint written by python -m qmoe_jax.compress, not an "
            "import",
            "choose a new --output_dir",
        )
    problems = [f"{key} differs" for key in ("model", "grid", "settings") if old[key] != new[key]]
    for name in sorted(old["source_files"].keys() | new["source_files"].keys()):
        if old["source_files"].get(name) != new["source_files"].get(name):
            problems.append(
                f"{name} "
                + (
                    "is new"
                    if name not in old["source_files"]
                    else "is gone"
                    if name not in new["source_files"]
                    else "changed"
                )
            )
    if problems:
        raise ImportRefusedError(
            f"{output_dir} holds an import of another source ({old['source']}): "
            + "; ".join(problems),
            f"import into a new --output_dir, or delete {output_dir} to start over",
        )


def _parameter_counts(directory: QMoEDirectory) -> tuple[int, int]:
    shapes = path_shapes(param_shapes(directory.config))
    total = sum(int(np.prod(shape)) for shape in shapes.values())
    experts = sum(int(np.prod(shape)) for path, shape in shapes.items() if "/expert/" in path)
    return total, experts


def _layer_files(directory: QMoEDirectory) -> dict[str, LayerFile]:
    """Every expNN.pt's layer (pickles only), in the order of the sparse layers; each layer exactly
    once."""
    sizes = directory.sizes()
    found: dict[str, LayerFile] = {}
    for path in directory.layer_paths:
        layer = directory.layer_file(path, sizes)
        if layer.layer in found:
            raise QMoELayoutError(
                f"{found[layer.layer].name} and {layer.name} both hold layer {layer.hf_prefix}"
            )
        found[layer.layer] = layer
    order = [f"{stack}.layers_{i}.mlp" for stack, i in directory.sparse_layers()]
    missing = [name for name in order if name not in found]
    if missing:
        raise QMoELayoutError(
            f"{directory.path} has no expNN.pt for the sparse layer(s) {', '.join(missing)}; "
            "the download is incomplete"
        )
    return {name: found[name] for name in order}


def _recheck_sources(writer: CompressedCheckpointWriter, layers: dict[str, LayerFile], log) -> None:
    """--verify full: each finished layer's expNN.pt must still have the SHA-256 recorded with
    it."""
    for name in writer.finished_layers():
        stats = writer.manifest["layers"][name]["stats"]
        if file_sha256(layers[name].path) != stats["source_sha256"]:
            log(
                f"repairing layer {name}: {layers[name].name} changed since it was imported; it "
                "is imported again"
            )
            writer.discard_layer(name)


def _resume_advice(writer: CompressedCheckpointWriter, layers: dict[str, LayerFile]) -> str:
    done = len(writer.finished_layers())
    return f"re-run the same command to resume ({done} of {len(layers)} layers imported)"


def import_qmoe(
    source: str,
    output_dir: str | None = None,
    verify: str = "quick",
    log: Callable[[str], None] = print,
    progress: bool = True,
) -> dict:
    """Imports (or resumes importing) a published QMoE directory; returns the report (also written
    to disk).

    Args:
      source: the ``*_qmoe`` directory (config.json, noexp.pt, sizes.pt, expNN.pt).
      output_dir: the compressed checkpoint to write (None: runs/imported/<config name>).
      verify: on resume, "quick" checks the finished parts' files and sizes;
        "full" also every checksum and every finished layer's source SHA-256.
    """
    if verify not in VERIFY_LEVELS:
        raise ValueError(
            f"unknown verify level {verify!r}; choose one of {', '.join(VERIFY_LEVELS)}"
        )
    started = time.perf_counter()
    directory = QMoEDirectory(source)
    config = directory.config
    for difference in directory.config_differences:
        log(
            f"note: config.json and the registered config disagree on {difference}; config.json "
            "is used"
        )
    tick = time.perf_counter()
    layers = _layer_files(directory)
    seconds = {"index": time.perf_counter() - tick}
    output_dir = output_dir or os.path.join("runs", "imported", config.name)
    log(
        f"model {config.name} ({len(layers)} sparse layers, {config.num_experts} experts) from "
        f"{directory.path}; "
        f"output {output_dir}"
    )
    header = _header(directory)
    writer = None
    try:
        with claimed(output_dir, COMPRESSED_OUTPUT):
            rebuilt = rebuild_lost_manifest(output_dir)
            if rebuilt:
                log(rebuilt)
            writer = CompressedCheckpointWriter(
                output_dir,
                header,
                log=log,
                check_resume=lambda stored: _check_resume(stored, header, output_dir),
            )
            for damage in writer.verify(full=verify == "full"):
                log(f"repairing {damage}")
            if verify == "full":
                _recheck_sources(writer, layers, log)
            if writer.has_dense() or writer.finished_layers():
                log(
                    f"resuming: {len(writer.finished_layers())} of {len(layers)} layers already "
                    "imported"
                )
            report = _import(directory, layers, writer, seconds, log, progress)
            report["seconds"]["total"] = time.perf_counter() - started
            write_report(report, writer.directory)
    except (KeyboardInterrupt, OSError) as error:
        if writer is not None:
            error.add_note(_resume_advice(writer, layers))
        raise
    log(summary_table(report))
    log(
        f"imported checkpoint: {output_dir}\nuse it:\n  python -m qmoe_jax.evaluate --checkpoint "
        f"{output_dir}\n"
        f'  python -m qmoe_jax.generate --checkpoint {output_dir} --prompt "... <extra_id_0> ..."'
    )
    return report


def _import(
    directory: QMoEDirectory,
    layers: dict[str, LayerFile],
    writer: CompressedCheckpointWriter,
    seconds: dict[str, float],
    log: Callable[[str], None],
    progress: bool,
) -> dict:
    """The work of ``import_qmoe`` once everything is checked; ``seconds`` collects the stages' wall
    time."""
    seconds |= {"dense": 0.0, "write": 0.0}
    if not writer.has_dense():
        tick = time.perf_counter()
        writer.write_dense(directory.dense_params())
        release_free_memory()
        seconds["dense"] = time.perf_counter() - tick
    dictionary = build_dictionary(DEFAULT_P0)
    fingerprint = writer.write_dictionary(dictionary)
    todo = [name for name in layers if name not in writer.finished_layers()]
    total_bytes = sum(os.path.getsize(layers[name].path) for name in todo)
    with tqdm(
        total=total_bytes, unit="B", unit_scale=True, desc="import", disable=not progress
    ) as bar:
        for name in todo:
            layer = layers[name]
            bar.set_postfix_str(f"{layer.name} -> {name}")
            tick = time.perf_counter()
            sha256 = file_sha256(layer.path)
            hashed = time.perf_counter()
            arrays, kernels = read_layer(layer, directory.config, dictionary)
            read = time.perf_counter()
            stats = {
                "dictionary": fingerprint,
                "kernels": kernels,
                "source_file": layer.name,
                "source_sha256": sha256,
                "seconds": {"hash": hashed - tick, "read": read - hashed},
            }
            writer.write_layer(name, arrays, stats)
            del arrays
            # tensorstore's encode buffers, freed once a layer is written, would stay resident and
            # add to the next layer's peak
            release_free_memory()
            seconds["write"] += time.perf_counter() - read
            bar.update(os.path.getsize(layer.path))
    total, experts = _parameter_counts(directory)
    report = build_report(writer.manifest, total, experts, seconds)
    files = writer.manifest["header"]["source_files"]
    hashes = {name: record["sha256"] for name, record in files.items() if "sha256" in record}
    hashes |= {
        record["stats"]["source_file"]: record["stats"]["source_sha256"]
        for record in writer.manifest["layers"].values()
    }
    provenance = {"source": directory.path, "sha256": hashes}
    report["provenance"] = provenance
    writer.finalize({"moe": report["moe"], "model": report["model"], "provenance": provenance})
    return report
