"""The compressed-checkpoint writer of a run of one or several processes.

Lingo: the *lead* (process 0) alone opens the ``CompressedCheckpointWriter``
and writes: the manifest, ``dense/``, the dictionaries, every finished layer,
the report. The other processes compute their share of each layer
(``calibration.expert_share``) and send it to the lead; they never write into
the output directory. Every write is collective (``distributed.exchange``):
the lead writes, and every process learns the outcome, so that a failed
write (a full disk) stops every process, and every process sees the same
state (finished layers, dense parameters written), which decides what the
pass replays and what it compresses.

Non-finite source values that a process zeroed (``--nonfinite zero``), and the
digests of the source arrays it read whole (``checkpoints.read_digests``), are
kept in that process and sent to the lead before its next write. The lead
compares each digest with its own read of the same array, so hosts whose
copies of the source differ stop the run; every process compares its reads
with the digests of the finished parts. In a one-process run each method is
the writer's own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from qmoe_jax.checkpoints.format_v1 import CompressedCheckpointWriter
from qmoe_jax.codec import Dictionary
from qmoe_jax.compression.source_check import SourceChangedError
from qmoe_jax.distributed import exchange, runtime


class SharedWriter:
    """``CompressedCheckpointWriter``'s methods for every process of a run; only the lead's write.

    Args:
      open_writer: opens the writer (the lead calls it; its errors, such as a refused resume, are
        raised in every process).
      directory: the output directory's absolute path.
    """

    def __init__(self, open_writer: Callable[[], CompressedCheckpointWriter], directory: str):
        self.directory = directory
        self.writer: CompressedCheckpointWriter | None = None
        self._zeroed: dict[str, int] = {}
        self._reads: dict[str, str] = {}

        def open_on_lead() -> dict:
            self.writer = open_writer()
            return self._state()

        self.state = exchange.decided(open_on_lead)

    def _state(self) -> dict:
        return {
            "layers": list(self.writer.manifest["layers"]),
            "dense": self.writer.has_dense(),
            "source": self.writer.manifest["header"]["source"],
            "reads": self.writer.recorded_reads() if runtime.process_count() > 1 else {},
        }

    def _record_reads(self, process: int, reads: dict[str, str]) -> None:
        """On the lead: the digests another process read, checked against the lead's own."""
        for path, digest in reads.items():
            own = self.writer.recorded_read(path)
            if own is not None and own != digest:
                raise SourceChangedError(
                    f"the array {path} of the source checkpoint holds other values in process "
                    f"{process} than in process 0 (SHA-256 {own[:12]}…, there {digest[:12]}…), so "
                    "the hosts read different versions of it",
                    "give every process the same checkpoint (the same shared path, or identical "
                    "copies) and re-run the same command",
                )
            self.writer.record_read(path, digest)

    def _on_lead(self, work: Callable[[CompressedCheckpointWriter], Any]) -> Any:
        """``work(writer)`` on the lead, after the zeroed-value records and read digests of every
        process; its result in every process."""
        kept = exchange.allgather_objects((self._zeroed, self._reads))
        self._zeroed, self._reads = {}, {}

        def run() -> tuple[Any, dict]:
            for process, (zeroed, reads) in enumerate(kept):
                for key, count in zeroed.items():
                    self.writer.record_zeroed(key, count)
                self._record_reads(process, reads)
            return work(self.writer), self._state()

        result, self.state = exchange.decided(run)
        return result

    @property
    def manifest(self) -> dict:
        """The lead's manifest (the lead only: the others hold no manifest)."""
        if self.writer is None:
            raise RuntimeError(f"{runtime.label()} holds no manifest; only the lead writes")
        return self.writer.manifest

    def _current(self) -> dict:
        """The writer's state: read from it on the lead (also after a write it interrupted), else
        as the lead last sent it."""
        return self._state() if self.writer is not None else self.state

    @property
    def started_from(self) -> str:
        """Where the source checkpoint was when the stored run started."""
        return self._current()["source"]

    def finished_layers(self) -> list[str]:
        return list(self._current()["layers"])

    def has_dense(self) -> bool:
        return self._current()["dense"]

    def record_zeroed(self, key: str, count: int) -> None:
        if self.writer is not None and runtime.process_count() == 1:
            self.writer.record_zeroed(key, count)
        else:
            self._zeroed[key] = count

    def recorded_read(self, path: str) -> str | None:
        """The digest of the source array ``path`` that the finished parts (or the lead, since)
        read; ``CompressedCheckpointWriter.recorded_read``."""
        if self.writer is not None:
            return self.writer.recorded_read(path)
        return self.state["reads"].get(path)

    def recorded_reads(self) -> dict[str, str]:
        return (
            self.writer.recorded_reads() if self.writer is not None else dict(self.state["reads"])
        )

    def record_read(self, path: str, digest: str) -> None:
        if self.writer is not None:
            self.writer.record_read(path, digest)
        else:
            self._reads.setdefault(path, digest)

    def verify(self, full: bool = False) -> list[str]:
        return self._on_lead(lambda writer: writer.verify(full=full))

    def write_dense(self, read_params: Callable[[], dict]) -> None:
        """Saves the non-expert parameters that ``read_params()`` reads (on the lead only)."""
        self._on_lead(lambda writer: writer.write_dense(read_params()))

    def write_dictionary(self, dictionary: Dictionary) -> str:
        return self._on_lead(lambda writer: writer.write_dictionary(dictionary))

    def write_layer(self, name: str, arrays: dict, stats: dict) -> None:
        self._on_lead(lambda writer: writer.write_layer(name, arrays, stats))

    def repair_dictionary(self, fingerprint: str) -> Dictionary:
        return self._on_lead(lambda writer: writer.repair_dictionary(fingerprint))

    def discard_layer(self, name: str) -> None:
        self._on_lead(lambda writer: writer.discard_layer(name))

    def finalize(self, report: dict) -> None:
        self._on_lead(lambda writer: writer.finalize(report))
