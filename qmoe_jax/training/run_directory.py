"""The fine-tuning run's directory: run manifest, Orbax training checkpoints, metrics, the
fine-tuned model.

Layout of ``--output_dir`` (docs/format.md §11)::

    manifest.json      {"format": "qmoe_jax.finetune", "format_version": 1, "settings", "source",
                        "complete", "model"}
    train_state/<step>/  Orbax checkpoints of the trainable parameters and the optimizer state
                        (the last two kept)
    metrics.jsonl, metrics.png
    model/             the fine-tuned checkpoint (compressed directory, or T5X model directory),
                       written last

A checkpoint step is written by Orbax into a temporary directory and renamed
into place when complete, so ``kill -9`` leaves the completed steps intact and
the half-written one unrecognized (and removed when the run restarts). The model
is written to ``model.partial/`` and renamed; only then is the run marked
complete. A restarted run must have the same settings and source.

With several processes (docs/multihost.md) the lead (process 0) alone writes
the manifest, the metrics and the model; every process takes part in each
Orbax checkpoint, as Orbax's multi-process checkpointing requires. Checkpoints are written
without a copy of the state first (``checkpoints.orbax_trees``): saving does not double the
memory the state takes.
"""

from __future__ import annotations

import json
import os
import shutil

import orbax.checkpoint as ocp

from qmoe_jax.checkpoints import orbax_trees, strict_json
from qmoe_jax.checkpoints.compressed_trees import write_json_atomic
from qmoe_jax.checkpoints.output_dir import MANIFEST, OutputKind, read_json_object
from qmoe_jax.distributed import exchange, runtime

FORMAT = "qmoe_jax.finetune"
FORMAT_VERSION = 1
FINETUNE_OUTPUT = OutputKind(FORMAT, "a qmoe_jax fine-tuning run")
TRAIN_STATE = "train_state"
MODEL = "model"
METRICS = "metrics.jsonl"
KEEP_CHECKPOINTS = 2
# Settings a format-1 manifest may lack, with the value such a run used: it resumes as that.
IMPLIED_SETTINGS = {"optimizer": "adamw"}


class ResumeMismatchError(ValueError):
    """The output directory holds a run with other settings or another source."""


def _differences(stored: dict, current: dict, prefix: str = "") -> list[str]:
    found = []
    for key in sorted(set(stored) | set(current)):
        old, new = stored.get(key, "<absent>"), current.get(key, "<absent>")
        if isinstance(old, dict) and isinstance(new, dict):
            found += _differences(old, new, f"{prefix}{key}.")
        elif old != new:
            found.append(f"{prefix}{key}: {old!r} before, {new!r} now")
    return found


class RunDirectory:
    """A claimed fine-tuning output directory (the caller holds its lock, ``output_dir.claimed``).

    Args:
      directory: the absolute output directory.
      record: ``{"settings": …, "source": …}``, JSON-able; a run found there must have recorded the
        same.
    """

    def __init__(self, directory: str, record: dict):
        self.directory = directory
        self.manifest = exchange.decided(lambda: self._open_manifest(record))
        registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
        for args in (ocp.args.PyTreeSave, ocp.args.PyTreeRestore):
            registry.add(None, args, orbax_trees.handler())
        self.checkpoints = ocp.CheckpointManager(
            self.path(TRAIN_STATE),
            handler_registry=registry,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=KEEP_CHECKPOINTS,
                enable_async_checkpointing=False,
                cleanup_tmp_directories=True,
                create=True,
            ),
        )

    def _open_manifest(self, record: dict) -> dict:
        """The stored run's manifest (checked against ``record``) or a new one; removes a
        half-written model."""
        directory = self.directory
        record = json.loads(json.dumps(record))
        stored = read_json_object(os.path.join(directory, MANIFEST))
        if stored is not None:
            compared = {k: stored.get(k) for k in record}
            if isinstance(compared.get("settings"), dict):
                compared["settings"] = {**IMPLIED_SETTINGS, **compared["settings"]}
            differences = _differences(compared, record)
            if differences:
                raise ResumeMismatchError(
                    f"{directory} holds a fine-tuning run with other settings "
                    f"({'; '.join(differences)}); re-run "
                    "with the same flags to resume it, or choose a new --output_dir"
                )
            manifest = stored
        else:
            manifest = {
                "format": FORMAT,
                "format_version": FORMAT_VERSION,
                **record,
                "complete": False,
                "model": None,
            }
            write_json_atomic(os.path.join(directory, MANIFEST), manifest)
        partial = self.path(MODEL + ".partial")
        if os.path.exists(partial):
            shutil.rmtree(partial)
        return manifest

    def path(self, name: str) -> str:
        return os.path.join(self.directory, name)

    @property
    def complete(self) -> bool:
        return bool(self.manifest.get("complete"))

    def latest_step(self) -> int | None:
        return self.checkpoints.latest_step()

    def save(self, step: int, state: dict) -> None:
        """Saves ``{"trainable": …, "opt_state": …}`` as step ``step`` (atomically), synchronously
        and without copying the arrays first (``orbax_trees``)."""
        tree = orbax_trees.host_views(state)
        self.checkpoints.save(step, args=orbax_trees.save_args(tree), force=True)
        self.checkpoints.wait_until_finished()

    def restore(self, step: int, abstract_state: dict) -> dict:
        """The state saved at ``step``, in the structure, shapes and shardings of
        ``abstract_state``."""
        restore_args = ocp.checkpoint_utils.construct_restore_args(abstract_state)
        return self.checkpoints.restore(
            step, args=ocp.args.PyTreeRestore(abstract_state, restore_args=restore_args)
        )

    def metrics_records(self, up_to_step: int) -> list[dict]:
        """The metrics of steps ≤ ``up_to_step`` (what a resumed run keeps); rewrites the file
        without the rest (the lead; every process gets the records)."""
        return exchange.decided(lambda: self._kept_metrics(up_to_step))

    def _kept_metrics(self, up_to_step: int) -> list[dict]:
        path = self.path(METRICS)
        if not os.path.exists(path):
            return []
        with open(path) as f:
            records = [json.loads(line) for line in f if line.strip()]
        kept = [record for record in records if record["step"] <= up_to_step]
        temporary = path + ".tmp"
        with open(temporary, "w") as f:
            f.writelines(strict_json.dumps(record, what=METRICS) + "\n" for record in kept)
        os.replace(temporary, path)
        return kept

    def append_metrics(self, record: dict) -> None:
        if not runtime.is_lead():
            return
        with open(self.path(METRICS), "a") as f:
            f.write(strict_json.dumps(record, what=METRICS) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def finish(self, model_path: str, summary: dict) -> None:
        """Marks the run complete once its model is in place (``model_path`` relative to the
        directory)."""
        self.manifest.update(complete=True, model=model_path, summary=summary)
        exchange.decided(lambda: write_json_atomic(self.path(MANIFEST), self.manifest))

    def close(self) -> None:
        self.checkpoints.close()
