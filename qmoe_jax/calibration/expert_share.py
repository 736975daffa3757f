"""Which experts of each group a process compresses, when several processes share a run.

Lingo: a run's processes each hold the whole calibration token buffer (every
process runs the same dense calibration forward, which is deterministic), so
every process knows every token's routing. At a sparse layer each expert
group (``group_size`` experts) is dealt to the processes in contiguous parts,
as even as their device counts allow; a process reads from the source only
its part's kernel slices, builds their Hessians, quantizes them on its own
devices (``quant.group``, sharded over its local devices), encodes them and
runs their tokens through them. The parts meet in every process (``gather``):
the codes go to the lead, which writes the layer, and every process scatters
every part's outputs into its buffer. An expert's codes and outputs do not
depend on which process computes it, so the result is bit-identical to a
one-process run.

A run of one process has one share that owns every expert and gathers
without sending anything.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from qmoe_jax.distributed import exchange, runtime


@dataclasses.dataclass(frozen=True)
class ExpertShare:
    """This process's share of every expert group.

    Attributes:
      index: this process (0 … processes − 1).
      devices: the local device count of every process, in process order.
    """

    index: int = 0
    devices: tuple[int, ...] = (1,)

    def __post_init__(self):
        if not 0 <= self.index < len(self.devices) or min(self.devices) < 1:
            raise ValueError(
                f"process {self.index} of device counts {self.devices} is not a process of the run"
            )

    @classmethod
    def of_run(cls) -> ExpertShare:
        """The share of this process in the current JAX run (all experts when it runs alone)."""
        if runtime.process_count() == 1:
            return cls()
        import jax

        counts = [0] * jax.process_count()
        for device in jax.devices():
            counts[device.process_index] += 1
        return cls(jax.process_index(), tuple(counts))

    @property
    def processes(self) -> int:
        return len(self.devices)

    def owned(self, experts: range) -> range:
        """This process's contiguous part of the group ``experts``: process p gets the experts
        from ``len · (devices before p) / all devices``, rounded down, to the next process's
        start; it may be empty when the group has fewer experts than processes."""
        total = sum(self.devices)
        before = sum(self.devices[: self.index])
        first = len(experts) * before // total
        last = len(experts) * (before + self.devices[self.index]) // total
        return range(experts.start + first, experts.start + last)

    def gather(self, work: Callable[[], Any]) -> list[Any]:
        """Every process's ``work()``, in process order (so in expert order); collective. An error
        in any process is raised in all (``distributed.exchange.gathered``)."""
        if self.processes == 1:
            return [work()]
        return exchange.gathered(work)
