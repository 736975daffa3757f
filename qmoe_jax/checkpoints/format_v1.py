"""The compressed checkpoint (format v1): Orbax trees plus a JSON manifest.

Layout of an output directory::

    manifest.json          format version; header (model config, source, grid, settings);
                           dictionaries; layers
    dense/                 Orbax tree: every parameter except the expert kernels (as in the source)
    dictionaries/<fp16>/   Orbax tree {"entries": uint32[65536, 2]}, one per distinct dictionary
    layers/<layer>/        one finished sparse layer: arrays/ (Orbax) + layer.json
                           (stats, checksums)
    report.json, report.png

``<layer>`` is the dotted path of a sparse MLP, e.g. ``encoder.layers_1.mlp``.
Its arrays are ``{kernel: {...}}`` per expert kernel (``wi``, ``wo``, or ``wi_0``, ``wi_1``,
``wo``): for ternary codes ``codes uint16[E, n]``, ``row_offsets int32[E, rows+1]``, ``minmax
bfloat16[E, rows, 2]`` (rows = output features, i.e. the T5X kernel transposed); for k-bit grids
``codes uint8[E, rows, cols]`` and ``grid_params float32[E, rows, 2]`` (scale, zero). docs/format.md
§8 has the whole layout.

Each layer is written into a temporary directory and renamed into place, and
the manifest is replaced atomically after it, so a crash (even kill -9) leaves
either the finished layer or nothing; a re-run resumes after the last finished
layer. Every array carries a SHA-256 in layer.json; loading verifies them, and
the dictionary fingerprints, and names the array that fails. The manifest also
records the size of every file of each part, so that a resumed run can check
cheaply that nothing is missing (``CompressedCheckpointWriter.verify``), and
what the parts were made from: the signals of the source's files when the run
started (``source_snapshot``, ``checkpoints.source_files``) and, in each
part's record, the SHA-256 of every source array it read (``source_reads``,
``checkpoints.read_digests``); ``compression.source_check`` compares them.

The writer follows the rules of ``output_dir``: it writes only into a new,
empty or compressed-checkpoint directory (``COMPRESSED_OUTPUT``), and it deletes
only entries it writes itself: ``dense/``, ``dictionaries/<fp16>/`` and
``layers/<layer>[.partial]/``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np
from flax import traverse_util

from qmoe_jax.checkpoints.compressed_trees import (
    CompressedCheckpointError,
    file_sizes,
    flat_checksums,
    missing_or_resized,
    require_finite,
    restore_tree,
    save_tree,
    verify_checksums,
    write_json_atomic,
)
from qmoe_jax.checkpoints.output_dir import (
    LOCK_FILE,
    MANIFEST,
    UNFINISHED_MANIFEST,
    OutputKind,
    check_writable,
    read_json_object,
)
from qmoe_jax.codec.dictionary import Dictionary, build_dictionary, fingerprint_of

FORMAT = "qmoe_jax.compressed"
FORMAT_VERSION = 1
# where Orbax writes a tree before renaming it into place
ORBAX_TEMPORARY = r"\.orbax-checkpoint-tmp.*"
LAYER_DIRECTORY = re.compile(r"^(encoder|decoder)\.layers_(\d+)\.mlp(\.partial)?$")
DICTIONARY_DIRECTORY = re.compile(rf"^[0-9a-f]{{16}}({ORBAX_TEMPORARY})?$")
DENSE_TEMPORARY = re.compile(rf"^dense{ORBAX_TEMPORARY}$")
# optional expert LoRA adapters of a fine-tuned checkpoint (docs/format.md §8.9)
ADAPTERS = "adapters"
RERUN = "re-run the same `python -m qmoe_jax.compress` command"
LAYER_RECORD = "layer.json"
SOURCE_SNAPSHOT = "source_snapshot"  # manifest: the source files' signals (source_files.py)
SOURCE_READS = "source_reads"  # part records: {param path: digest} of what they were made from
RUN_HEADER = "run_header"  # layer.json: the header of the run that wrote it


def _written_before_marker(manifest: dict) -> bool:
    """Manifests of format version 1 written before the "format" marker: the version and the run
    header."""
    header = manifest.get("header")
    return (
        manifest.get("format_version") == FORMAT_VERSION
        and isinstance(header, dict)
        and {"model", "source", "settings"} <= header.keys()
    )


OWN_ENTRIES = frozenset({"dense/", "dictionaries/", "layers/", "report.json", "report.png"})


def lost_manifest(directory: str) -> bool:
    """Whether ``directory`` is a compressed checkpoint that lost its manifest: it holds nothing
    but what the writer writes, at least one finished layer directory with its ``layer.json``,
    and no ``manifest.json``."""
    try:
        names = {
            entry.name + ("/" if entry.is_dir() else "") for entry in os.scandir(directory)
        } - {LOCK_FILE, UNFINISHED_MANIFEST}
        layers = os.listdir(os.path.join(directory, "layers"))
        dictionaries = (
            os.listdir(os.path.join(directory, "dictionaries")) if "dictionaries/" in names else []
        )
    except OSError:
        return False
    return (
        MANIFEST not in names
        and all(name in OWN_ENTRIES or DENSE_TEMPORARY.match(name.rstrip("/")) for name in names)
        and all(LAYER_DIRECTORY.match(name) for name in layers)
        and all(DICTIONARY_DIRECTORY.match(name) for name in dictionaries)
        and any(
            os.path.isfile(os.path.join(directory, "layers", name, LAYER_RECORD)) for name in layers
        )
    )


COMPRESSED_OUTPUT = OutputKind(
    FORMAT, "a qmoe_jax compressed checkpoint", _written_before_marker, lost_manifest
)


def layer_order(name: str) -> tuple[bool, int]:
    """Sort key of a sparse layer's name in the order the calibration pass visits it (encoder
    first)."""
    match = LAYER_DIRECTORY.match(name)
    return match.group(1) == "decoder", int(match.group(2))


def save_dense(directory: str, params: dict) -> dict:
    """Saves the non-expert parameters as ``<directory>/dense`` (replacing a stale copy); returns
    their manifest record (§8.3)."""
    require_finite(params, "dense parameters")
    path = os.path.join(directory, "dense")
    if os.path.exists(path):
        shutil.rmtree(path)
    save_tree(path, params)
    return {"checksums": flat_checksums(params), "files": file_sizes(path)}


def save_dictionary(directory: str, dictionary: Dictionary) -> dict:
    """Saves ``dictionary`` as ``<directory>/dictionaries/<fingerprint[:16]>`` (replacing a stale
    copy); returns its manifest record (§8.4)."""
    path = os.path.join(directory, "dictionaries", dictionary.fingerprint[:16])
    if os.path.exists(path):
        shutil.rmtree(path)
    save_tree(path, {"entries": np.asarray(dictionary.entries)})
    return {
        "p0": dictionary.p0,
        "directory": dictionary.fingerprint[:16],
        "files": file_sizes(path),
    }


def _delete_and_rerun(path: str, what: str) -> str:
    return f"delete {path} and {RERUN} that wrote it, which {what}"


def _rerun(what: str) -> str:
    return f"{RERUN} that wrote it, which {what}"


class CompressedCheckpointWriter:
    """Writes (or resumes writing) a compressed checkpoint directory.

    Args:
      directory: output directory (created if missing). It must be new, empty
        or a compressed checkpoint (``COMPRESSED_OUTPUT``); the caller holds its
        lock (``output_dir.claimed``) while writing.
      header: run description stored in the manifest (config, source,
        settings).
      check_resume: called with the stored manifest when the directory holds a
        run with finished parts; raises if ``header``'s run may not continue it.
        The default requires the same header. A stored run without finished
        parts is replaced.
      log: where repairs are reported.
    """

    def __init__(
        self,
        directory: str,
        header: dict,
        check_resume: Callable[[dict], None] | None = None,
        log: Callable[[str], None] = lambda line: None,
    ):
        directory = os.path.abspath(directory)  # Orbax writes absolute paths only
        check_writable(directory, COMPRESSED_OUTPUT)
        os.makedirs(directory, exist_ok=True)
        self.directory = directory
        self.log = log
        self.replaced: dict[
            str, dict
        ] = {}  # records of layers unrecorded as damaged, until they are rewritten
        stored = read_json_object(os.path.join(directory, MANIFEST))
        if stored is None and lost_manifest(directory):
            raise CompressedCheckpointError(
                f"{directory}/{MANIFEST} is missing",
                "rebuild it first (checkpoints.manifest_rebuild.rebuild_lost_manifest, as "
                "`python -m qmoe_jax.compress` does)",
            )
        if stored is not None and stored.get("format_version") != FORMAT_VERSION:
            raise CompressedCheckpointError(
                f"{directory} holds a compressed checkpoint of format version "
                f"{stored.get('format_version')}, "
                f"which this qmoe_jax (version {FORMAT_VERSION}) does not write",
                "choose a new --output_dir",
            )
        if stored is not None and (stored["dense"] is not None or stored["layers"]):
            if "format" not in stored:
                raise CompressedCheckpointError(
                    f"{directory} was written by an older qmoe_jax, which did not record what "
                    "resuming checks "
                    "(the source's content, the files' sizes)",
                    f"choose a new --output_dir, or delete {directory}",
                )
            (check_resume or self._require_header(header))(stored)
            self.manifest = stored
        else:
            self.manifest = {
                "format": FORMAT,
                "format_version": FORMAT_VERSION,
                "header": header,
                "dense": None,
                "dictionaries": {},
                "layers": {},
                "nonfinite_zeroed": {},
                "complete": False,
            }
            self._commit()
        self._reads: dict[str, str] = {}  # source digests of the recorded parts, and read since
        for record in self._part_records():
            self._reads.update(record.get(SOURCE_READS, {}))
        self._remove_unrecorded()

    def _remove_unrecorded(self) -> None:
        """Deletes what a stopped run left half-written: entries the writer owns that the manifest
        does not record."""
        dictionaries = {record["directory"] for record in self.manifest["dictionaries"].values()}
        for folder, owned, recorded in (
            ("layers", LAYER_DIRECTORY, self.manifest["layers"]),
            ("dictionaries", DICTIONARY_DIRECTORY, dictionaries),
            ("", DENSE_TEMPORARY, ()),
        ):
            path = os.path.join(self.directory, folder)
            os.makedirs(path, exist_ok=True)
            for name in os.listdir(path):
                if owned.match(name) and name not in recorded:
                    shutil.rmtree(os.path.join(path, name))

    def _require_header(self, header: dict) -> Callable[[dict], None]:
        def check(stored: dict) -> None:
            if stored["header"] != json.loads(json.dumps(header)):
                raise CompressedCheckpointError(
                    f"{self.directory} holds a compressed checkpoint of another run",
                    "choose a new output directory",
                )

        return check

    def _commit(self) -> None:
        write_json_atomic(os.path.join(self.directory, MANIFEST), self.manifest)

    def finished_layers(self) -> list[str]:
        return list(self.manifest["layers"])

    def has_dense(self) -> bool:
        return self.manifest["dense"] is not None

    # --- what the parts were made from ----------------------------------------------------------
    def _part_records(self) -> list[dict]:
        return ([self.manifest["dense"]] if self.has_dense() else []) + list(
            self.manifest["layers"].values()
        )

    def source_snapshot(self) -> dict | None:
        """The snapshot of the source's files (``checkpoints.source_files``) this run resumes
        against; None when none is recorded."""
        return self.manifest.get(SOURCE_SNAPSHOT)

    def set_source_snapshot(self, snapshot: dict) -> None:
        self.manifest[SOURCE_SNAPSHOT] = snapshot
        self._commit()

    def recorded_read(self, path: str) -> str | None:
        """The digest (``checkpoints.read_digests``) of the source array ``path`` as the recorded
        parts, or this run since, read it; None when it was not read whole."""
        return self._reads.get(path)

    def recorded_reads(self) -> dict[str, str]:
        """Every digest ``recorded_read`` knows, by param path."""
        return dict(self._reads)

    def record_read(self, path: str, digest: str) -> None:
        """Notes the digest of a source array as read; stored with each part written after."""
        self._reads.setdefault(path, digest)

    def _layer_source(self, name: str, stats: dict) -> dict:
        """What a layer record adds so that the layer can be checked without the manifest: the
        source digests and zeroed counts no other layer record holds, and its dictionary's p0."""
        others = [record for other, record in self.manifest["layers"].items() if other != name]
        read = set().union(*(record.get(SOURCE_READS, {}) for record in others))
        zeroed = set().union(*(record.get("nonfinite_zeroed", {}) for record in others))
        dictionary = self.manifest["dictionaries"].get(stats.get("dictionary"))
        return {
            SOURCE_READS: {p: d for p, d in sorted(self._reads.items()) if p not in read},
            "nonfinite_zeroed": {
                key: count
                for key, count in sorted(self.manifest["nonfinite_zeroed"].items())
                if key not in zeroed
            },
            "dictionary_p0": None if dictionary is None else dictionary["p0"],
        }

    def record_zeroed(self, key: str, count: int) -> None:
        """Notes that ``count`` non-finite source values of ``key`` (an array, or ``array[expert]``)
        were replaced by zeros; stored with the next part written."""
        self.manifest["nonfinite_zeroed"][key] = count

    def write_dense(self, params: dict) -> None:
        """Saves the non-expert parameters (nested dict of arrays)."""
        record = save_dense(self.directory, params)
        flat = traverse_util.flatten_dict(params, sep="/")
        record[SOURCE_READS] = {p: self._reads[p] for p in sorted(flat) if p in self._reads}
        self.manifest["dense"] = record
        self._commit()

    def write_dictionary(self, dictionary: Dictionary) -> str:
        """Saves a dictionary once; returns its fingerprint."""
        fingerprint = dictionary.fingerprint
        if fingerprint not in self.manifest["dictionaries"]:
            self.manifest["dictionaries"][fingerprint] = save_dictionary(self.directory, dictionary)
            self._commit()
        return fingerprint

    def write_layer(self, name: str, arrays: dict, stats: dict) -> None:
        """Atomically saves one finished sparse layer (``arrays`` as in the module docstring).

        A layer that replaces a damaged copy (``discard_layer``) must come out the
        same; if it does not, every later layer was made from other inputs and is
        unrecorded too, so that the run recomputes it.
        """
        require_finite(arrays, f"layer {name}")
        final = os.path.join(self.directory, "layers", name)
        staging = final + ".partial"
        for path in (final, staging):
            if os.path.exists(path):
                shutil.rmtree(path)
        os.makedirs(staging)
        save_tree(os.path.join(staging, "arrays"), arrays, expert_stacks=True)
        record = {
            "stats": stats,
            "checksums": flat_checksums(arrays),
            "files": file_sizes(staging),
            **self._layer_source(name, stats),
        }
        run = {RUN_HEADER: self.manifest["header"]}  # layer.json only: rebuild_manifest's check
        write_json_atomic(os.path.join(staging, LAYER_RECORD), record | run)
        os.replace(staging, final)
        self.manifest["layers"][name] = record
        self._commit()
        previous = self.replaced.pop(name, None)
        if previous is not None and previous["checksums"] != record["checksums"]:
            later = [
                other for other in self.manifest["layers"] if layer_order(other) > layer_order(name)
            ]
            if later:
                self.log(
                    f"{name} came out different from its first copy, so the {len(later)} layer(s) "
                    "after it "
                    "are recomputed too"
                )
            for other in later:
                self.discard_layer(other)

    def _unrecord_dense(self) -> None:
        """Unrecords ``dense/`` (its files are damaged), so that the run rewrites it."""
        self.manifest["dense"] = None

    def discard_layer(self, name: str) -> None:
        """Unrecords a finished layer (its files are damaged), so that the run recomputes it."""
        self.replaced[name] = self.manifest["layers"].pop(name)
        self._unfinish()

    def _unfinish(self) -> None:
        self.manifest["complete"] = False
        self.manifest.pop("report", None)
        self._commit()

    def verify(self, full: bool = False) -> list[str]:
        """Checks every recorded part against the disk and repairs what fails.

        Every file of ``dense/``, each dictionary and each layer must be there
        with its recorded size. ``dense/`` and every dictionary are also read
        back, and must match their checksums and fingerprints: same-size damage
        shows only there, and they are small next to the layers, which the run
        reads back (and checks) anyway when it replays them. With ``full``,
        every layer's checksums are checked here too. A damaged dictionary is
        rebuilt from its p0 at once; a damaged ``dense/`` or layer is
        unrecorded, so that the run rewrites it. Returns one line per damaged
        part.
        """
        reader = CompressedCheckpoint(self.directory)
        found = []

        def damage(path: str, sizes: dict[str, int], read: Callable[[], Any] | None) -> str | None:
            problem = missing_or_resized(path, sizes)
            if problem is None and read is not None:
                try:
                    read()
                except CompressedCheckpointError as error:
                    problem = error.problem
            return problem

        if self.has_dense():
            dense = os.path.join(self.directory, "dense")
            problem = damage(dense, self.manifest["dense"]["files"], reader.dense_params)
            if problem:
                found.append(f"dense/: {problem}; it is rewritten from the source")
                self._unrecord_dense()
        for fingerprint, record in list(self.manifest["dictionaries"].items()):
            path = os.path.join(self.directory, "dictionaries", record["directory"])
            problem = damage(path, record["files"], partial(reader.dictionary, fingerprint))
            if problem:
                found.append(
                    f"dictionary {record['directory']}: {problem}; it is rebuilt from its p0"
                )
                self.repair_dictionary(fingerprint)
        for name, record in list(self.manifest["layers"].items()):
            path = os.path.join(self.directory, "layers", name)
            problem = damage(path, record["files"], partial(reader.layer, name) if full else None)
            if problem:
                found.append(f"layer {name}: {problem}; it is recomputed")
                self.discard_layer(name)
        if found:
            self._unfinish()
        return found

    def repair_dictionary(self, fingerprint: str) -> Dictionary:
        """Rewrites a damaged dictionary from its recorded p0; returns it."""
        record = self.manifest["dictionaries"].pop(fingerprint)
        dictionary = build_dictionary(record["p0"])
        if dictionary.fingerprint != fingerprint:
            raise CompressedCheckpointError(
                f"dictionary {record['directory']} of {self.directory} cannot be rebuilt: its "
                f"recorded p0 {record['p0']} gives another dictionary",
                f"delete {self.directory} and {RERUN}, which compresses every layer again",
            )
        self.write_dictionary(dictionary)
        return dictionary

    def write_adapters(self, adapters: dict, rank: int) -> None:
        """Saves expert LoRA adapters ``{layer: {kernel: {"a": [E, r, in], "b": [E, out, r]}}}``
        (§8.9)."""
        adapters = traverse_util.unflatten_dict(
            {
                (*layer.split("."), *key): value
                for layer, kernels in adapters.items()
                for key, value in traverse_util.flatten_dict(kernels).items()
            }
        )
        require_finite(adapters, "expert adapters")
        path = os.path.join(self.directory, ADAPTERS)
        if os.path.exists(path):
            shutil.rmtree(path)
        save_tree(path, adapters, expert_stacks=True)
        self.manifest[ADAPTERS] = {
            "rank": rank,
            "checksums": flat_checksums(adapters),
            "files": file_sizes(path),
        }
        self._commit()

    def finalize(self, report: dict) -> None:
        self.manifest["complete"] = True
        self.manifest["report"] = report
        self._commit()


class CompressedCheckpoint:
    """A finished (or partial) compressed checkpoint opened for reading."""

    def __init__(self, directory: str):
        directory = os.path.abspath(directory)
        path = os.path.join(directory, MANIFEST)
        if not os.path.isfile(path):
            raise CompressedCheckpointError(
                f"{directory} is not a qmoe_jax compressed checkpoint (no {MANIFEST})",
                "make one with `python -m qmoe_jax.compress`",
            )
        manifest = read_json_object(path)
        if manifest is None or not COMPRESSED_OUTPUT.owns(manifest):
            raise CompressedCheckpointError(
                f"{path} is not the manifest of a qmoe_jax compressed checkpoint "
                f'(it lacks "format": '
                f'"{FORMAT}")',
                "make one with `python -m qmoe_jax.compress`",
            )
        version = manifest.get("format_version")
        if version != FORMAT_VERSION:
            raise CompressedCheckpointError(
                f"{directory} has format version {version}; this qmoe_jax reads version "
                f"{FORMAT_VERSION}"
            )
        self.manifest = manifest
        self.directory = directory

    @property
    def header(self) -> dict:
        return self.manifest["header"]

    @property
    def complete(self) -> bool:
        return bool(self.manifest.get("complete"))

    def layer_names(self) -> list[str]:
        return list(self.manifest["layers"])

    def dense_params(self) -> dict:
        if self.manifest["dense"] is None:
            raise CompressedCheckpointError(
                f"{self.directory} has no dense parameters yet", f"{RERUN} to write them"
            )
        path = os.path.join(self.directory, "dense")
        what = "rewrites it from the source checkpoint"
        fix = _delete_and_rerun(path, what)
        tree = restore_tree(path, fix, rerun=_rerun(what))
        verify_checksums(tree, self.manifest["dense"]["checksums"], "dense parameters", fix)
        return tree

    def dictionary(self, fingerprint: str) -> Dictionary:
        record = self.manifest["dictionaries"].get(fingerprint)
        if record is None:
            raise CompressedCheckpointError(
                f"dictionary {fingerprint[:16]}… is not in {self.directory}"
            )
        path = os.path.join(self.directory, "dictionaries", record["directory"])
        fix = _delete_and_rerun(path, "rebuilds it")
        entries = np.asarray(restore_tree(path, fix, rerun=_rerun("rebuilds it"))["entries"])
        if fingerprint_of(entries) != fingerprint:
            raise CompressedCheckpointError(
                f"dictionary {record['directory']} does not match its fingerprint "
                "(the file is corrupt)",
                fix,
            )
        return Dictionary.from_entries(entries, record["p0"])

    def adapters(self) -> dict | None:
        """Expert LoRA adapters ``{layer: {kernel: {"a", "b"}}}``, checksums verified; None when
        there are none."""
        record = self.manifest.get(ADAPTERS)
        if record is None:
            return None
        path = os.path.join(self.directory, ADAPTERS)
        fix = (
            "re-run the `python -m qmoe_jax.finetune` command that wrote it into a new --output_dir"
        )
        tree = restore_tree(path, fix)
        verify_checksums(tree, record["checksums"], "expert adapters", fix)
        by_layer: dict[str, dict] = {}
        for key, value in traverse_util.flatten_dict(tree).items():
            by_layer.setdefault(".".join(key[:-2]), {}).setdefault(key[-2], {})[key[-1]] = value
        return by_layer

    def layer(self, name: str) -> tuple[dict, dict]:
        """(arrays, stats) of a finished sparse layer, checksums verified."""
        record = self.manifest["layers"].get(name)
        if record is None:
            raise CompressedCheckpointError(
                f"layer {name} is not in {self.directory} (finished: "
                f"{', '.join(self.layer_names()) or 'none'})"
            )
        part = os.path.join(self.directory, "layers", name)
        fix = _delete_and_rerun(part, "recomputes that layer")
        tree = restore_tree(
            os.path.join(part, "arrays"), fix, part, _rerun("recomputes that layer")
        )
        verify_checksums(tree, record["checksums"], f"layer {name}", fix)
        return tree, record["stats"]
