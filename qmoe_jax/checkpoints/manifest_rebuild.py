"""Rebuilding the manifest of a compressed checkpoint from its layers' records, when it was lost.

Each ``layers/<layer>/layer.json`` holds that layer's record (checksums, file
sizes, the digests of the source arrays it was made from, its dictionary's p0)
and the header of the run that wrote it (``run_header``). From them the
manifest is rebuilt as a resumable, incomplete run:

- ``header``: the layers' common ``run_header``, so that a re-run is checked
  against the settings that made them, as on any resume;
- ``layers``: the records, in compression order, up to the first layer whose
  record is unreadable (it and the layers after it are compressed again);
- ``dictionaries``: the ones the layers name, with their p0 (the re-run checks
  each by its fingerprint and rebuilds what fails);
- ``dense``: none: ``dense/`` is written again from the source;
- no ``source_snapshot``: what the layers were made from is then confirmed by
  content (``--verify full``) before the run goes on.

Layer records written by a qmoe_jax without ``run_header`` cannot be checked
against the run, so such a directory is not rebuilt; the error says so.
"""

from __future__ import annotations

import os

from qmoe_jax.checkpoints.compressed_trees import file_sizes, write_json_atomic
from qmoe_jax.checkpoints.format_v1 import (
    FORMAT,
    FORMAT_VERSION,
    LAYER_DIRECTORY,
    LAYER_RECORD,
    RERUN,
    RUN_HEADER,
    CompressedCheckpointError,
    layer_order,
    lost_manifest,
)
from qmoe_jax.checkpoints.output_dir import MANIFEST, read_json_object


def _layer_records(directory: str) -> dict[str, dict | None]:
    """Each finished layer directory's ``layer.json``, in compression order (None: unreadable)."""
    root = os.path.join(directory, "layers")
    names = [
        name for name in os.listdir(root) if LAYER_DIRECTORY.match(name) and ".partial" not in name
    ]
    return {
        name: read_json_object(os.path.join(root, name, LAYER_RECORD))
        for name in sorted(names, key=layer_order)
    }


def _cannot(directory: str, why: str) -> CompressedCheckpointError:
    return CompressedCheckpointError(
        f"{directory} is a compressed checkpoint whose {MANIFEST} is missing, and {why}, so it "
        "cannot be rebuilt",
        f"delete {directory} and {RERUN} to compress it again, or choose a new --output_dir",
    )


def rebuilt_manifest(directory: str) -> tuple[dict, list[str]]:
    """(the manifest rebuilt from the layer records of ``directory``, the names of the layers it
    leaves out); ``CompressedCheckpointError`` when the records cannot rebuild one."""
    records = _layer_records(directory)
    kept: dict[str, dict] = {}
    for name, record in records.items():
        if record is None or not {"checksums", "files", "stats"} <= record.keys():
            break
        kept[name] = record
    if kept and not all(RUN_HEADER in record for record in kept.values()):
        raise _cannot(
            directory,
            "its layer records were written by an older qmoe_jax, without the run's settings",
        )
    headers = [record[RUN_HEADER] for record in kept.values()]
    if any(header != headers[0] for header in headers):
        raise _cannot(directory, "its layers were written by runs with different settings")
    dictionaries: dict[str, dict] = {}
    zeroed: dict[str, int] = {}
    for record in kept.values():
        zeroed.update(record.get("nonfinite_zeroed", {}))
        fingerprint = record["stats"].get("dictionary")
        if fingerprint is not None and fingerprint not in dictionaries:
            path = os.path.join(directory, "dictionaries", fingerprint[:16])
            dictionaries[fingerprint] = {
                "p0": record.get("dictionary_p0"),
                "directory": fingerprint[:16],
                "files": file_sizes(path),  # the fingerprint, checked on the re-run, decides
            }
    header = next(iter(kept.values()))[RUN_HEADER] if kept else None  # None: nothing to keep
    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "header": header,
        "dense": None,
        "dictionaries": dictionaries,
        "layers": {
            name: {key: value for key, value in record.items() if key != RUN_HEADER}
            for name, record in kept.items()
        },
        "nonfinite_zeroed": zeroed,
        "complete": False,
    }
    return manifest, [name for name in records if name not in kept]


def rebuild_lost_manifest(directory: str) -> str | None:
    """Writes the rebuilt manifest of ``directory`` when it lost its own (``lost_manifest``);
    returns what was done, for the log, or None when there was nothing to do. The caller holds
    the directory's lock."""
    if not lost_manifest(directory):
        return None
    manifest, left_out = rebuilt_manifest(directory)
    write_json_atomic(os.path.join(directory, MANIFEST), manifest)
    if manifest["header"] is None:  # a manifest without parts, which the writer replaces
        return (
            f"{directory}/{MANIFEST} was missing and no layer record is readable "
            f"({', '.join(left_out)}): starting over"
        )
    skipped = (
        f"; {', '.join(left_out)} had no readable record and are compressed again"
        if left_out
        else ""
    )
    return (
        f"{directory}/{MANIFEST} was missing: rebuilt it from the records of "
        f"{len(manifest['layers'])} finished layer(s); dense/ is written again from the "
        f"source{skipped}"
    )


def lost_manifest_advice(directory: str) -> str | None:
    """What to do with ``directory`` when it is a compressed checkpoint that lost its manifest;
    None when it is not one."""
    if not lost_manifest(directory):
        return None
    try:
        manifest, _ = rebuilt_manifest(directory)
    except CompressedCheckpointError as error:
        return str(error)
    if "source_fingerprint" in (manifest["header"] or {"source_fingerprint": None}):
        rerun = f"{RERUN} that wrote it with --verify full"
    else:  # written by python -m qmoe_jax.import_qmoe, which checks its source files itself
        rerun = "re-run the same `python -m qmoe_jax.import_qmoe` command that wrote it"
    return (
        f"{directory} is a qmoe_jax compressed checkpoint whose {MANIFEST} is missing; {rerun}, "
        "which rebuilds the manifest from the layers' records (layers/*/layer.json), checks them "
        "against the source and finishes the checkpoint"
    )
