"""Whether the source checkpoint is still the one a resumed run's finished parts were made from.

A run records, in its manifest, a snapshot of the source's files when it starts
(``checkpoints.source_files``: size, mtime, ctime and inode of every local file,
or the generation of every object), and in each part's record the SHA-256 of
every source array that part was made from, as it was read
(``checkpoints.read_digests``). A resumed run then checks, from cheap to
thorough:

1. before any work, the snapshot against the files now: one stat per file. A
   difference refuses the run, naming the array (or file) and the signal;
2. as it reads, every array read whole against its recorded digest: the dense
   arrays, which replaying the finished layers reads anyway;
3. with ``--verify full``, every source array once, before the first layer,
   so that every recorded digest is compared: the dense arrays and the expert
   stacks of the finished layers. When the files differ (a copy of the
   checkpoint) but every digest matches, the run resumes and records the new
   snapshot.

Before the report, the snapshot is taken once more: a source that changed
while the run read it is an error, since the output may mix both versions.
"""

from __future__ import annotations

from collections.abc import Callable

from qmoe_jax.checkpoints.base import T5XCheckpoint
from qmoe_jax.checkpoints.format_v1 import CompressedCheckpointWriter
from qmoe_jax.checkpoints.read_digests import ChangedArrayError, DigestedReads
from qmoe_jax.checkpoints.source_files import describe_differences, differences, snapshot
from qmoe_jax.compression.resume import ResumeRefusedError


class SourceChangedError(ResumeRefusedError):
    """The source changed since the run's finished parts read it, or while the run read it."""


def _start_over(directory: str) -> str:
    return f"choose a new --output_dir (or delete {directory} to start over)"


def _recorded_gib(writer: CompressedCheckpointWriter, source: T5XCheckpoint) -> float:
    spec = source.spec()
    return sum(spec[path].nbytes for path in writer.recorded_reads() if path in spec) / 2**30


def check_files(
    writer: CompressedCheckpointWriter,
    source: T5XCheckpoint,
    files: dict,
    verify: str,
    log: Callable[[str], None],
) -> bool:
    """Check 1 (module docstring) for a run whose output is ``writer``, the source's files being
    ``files`` now. A new run records ``files``. Returns whether the content check of
    ``--verify full`` must confirm the source (the files differ, or none were recorded); raises
    ``SourceChangedError`` when they differ and ``verify`` is not "full"."""
    if not (writer.has_dense() or writer.finished_layers()):
        writer.set_source_snapshot(files)
        return False
    directory, url = writer.directory, source.url
    stored = writer.source_snapshot()
    if stored is not None and not differences(stored, files):
        return False
    full = (
        f"--verify full, which re-reads the {_recorded_gib(writer, source):.3g} GiB of the "
        "checkpoint that the finished parts were made from and resumes if their content is the "
        "same"
    )
    if stored is None:
        problem = (
            f"{directory} holds a run without a record of its source's files (its manifest was "
            "rebuilt, or an older qmoe_jax wrote it), so a changed source cannot be told cheaply"
        )
    else:
        problem = (
            f"the checkpoint at {url} changed since this run started: "
            f"{describe_differences(differences(stored, files))}"
        )
    if verify != "full":
        raise SourceChangedError(
            problem,
            f"re-run with the checkpoint this run started with; if it was only copied or touched, "
            f"re-run with {full}; or {_start_over(directory)}",
        )
    log(f"{problem}; comparing its content with what the finished parts read (--verify full)")
    return True


def digested(source: T5XCheckpoint, writer: CompressedCheckpointWriter) -> DigestedReads:
    """Check 2: ``source`` with every read hashed, compared with the digests ``writer``'s parts
    recorded, and recorded for the parts it writes next."""
    return DigestedReads(source, writer.recorded_read, writer.record_read)


def confirm_content(
    writer: CompressedCheckpointWriter,
    reads: DigestedReads,
    recorded: set[str],
    files: dict,
    files_differ: bool,
    log: Callable[[str], None],
) -> None:
    """Check 3, after every source array was read once through ``reads``: every digest in
    ``recorded`` (those of the finished parts) must have been compared. When ``files_differ``, the
    new snapshot ``files`` is recorded."""
    unread = sorted(recorded - reads.compared)
    if unread:
        raise SourceChangedError(
            f"the checkpoint {reads.url} no longer holds what the finished parts of "
            f"{writer.directory} were made from in a form that can be compared: "
            f"{describe_differences(unread)}",
            _start_over(writer.directory),
        )
    if files_differ:
        writer.set_source_snapshot(files)
        log(
            f"the {len(recorded)} source arrays the finished parts were made from are unchanged "
            "(SHA-256); resuming, with the checkpoint's files recorded anew"
        )


def changed_array(error: ChangedArrayError, directory: str) -> SourceChangedError:
    """The refusal for a digest that differs from the recorded one (checks 2 and 3)."""
    return SourceChangedError(
        f"{error}, so the finished parts of {directory} were made from another version of it",
        f"re-run with the checkpoint this run started with, or {_start_over(directory)}",
    )


def check_unchanged_while_read(writer: CompressedCheckpointWriter, source: T5XCheckpoint) -> None:
    """Raises ``SourceChangedError`` when the source's files differ from the recorded snapshot at
    the end of the run."""
    found = differences(writer.source_snapshot() or {}, snapshot(source))
    if found:
        raise SourceChangedError(
            f"the checkpoint at {source.url} changed while this run read it: "
            f"{describe_differences(found)}, so {writer.directory} may mix two versions of it",
            f"delete {writer.directory} and re-run with a checkpoint that stays unchanged",
        )
