"""What the processes of one run tell each other: Python objects over JAX's collectives.

Lingo: every function here is *collective*: every process of the run calls it,
in the same order, or the run hangs until JAX's heartbeat stops it. So that an
error in one process does not leave the others waiting in the next
collective, the work whose failure matters is wrapped:

- ``gathered(work)``: every process runs its own ``work()``; the results meet
  in every process, in process order. If any process failed, every process
  raises: the failing one its own error, the others ``PeerError`` naming it.
- ``checked(work)``: the same, but each process keeps its own result and only
  the outcome travels (for results that stay where they are made).
- ``decided(work)``: the lead (process 0) alone runs ``work()`` (a check, a
  write); every process gets its result or raises its error.

Objects travel pickled, as uint8 arrays gathered by a jitted identity over one
device per process (gloo on CPU devices, NCCL on GPUs), padded to one of 8
sizes per power of two so that few shapes compile. In a run of one process
nothing is sent and ``work()`` just runs.
"""

from __future__ import annotations

import functools
import pickle
from collections.abc import Callable
from typing import Any

import numpy as np

from qmoe_jax.distributed import runtime

SMALLEST_MESSAGE = 4096
SHARED = "_qmoe_jax_shared"  # attribute set on an error that every process of the run knows of


class PeerError(RuntimeError):
    """Another process of the run failed; this one stops too.

    Attributes:
      process: the failing process's label (``"process 1/2"``); message: its error, one line.
    """

    def __init__(self, process: str, message: str):
        super().__init__(f"{process} failed: {message}")
        self.process = process
        self.message = message


def is_shared(error: BaseException) -> bool:
    """Whether every process of the run raised ``error`` or a ``PeerError`` for it (so all stop
    together and none waits in a collective)."""
    return isinstance(error, PeerError) or getattr(error, SHARED, False)


def _mark_shared(error: BaseException) -> BaseException:
    try:
        setattr(error, SHARED, True)
    except AttributeError:  # an exception type without a __dict__: the run stops via the heartbeat
        pass
    return error


def _padded_size(size: int) -> int:
    """``size`` rounded up to one of 8 steps per power of two (at most 12.5 % more, few shapes to
    compile), at least ``SMALLEST_MESSAGE``."""
    step = 1 << max(0, size.bit_length() - 4)
    return max(SMALLEST_MESSAGE, -(-size // step) * step)


@functools.cache
def _replicate(devices: tuple):
    """(mesh of ``devices``, a jitted identity whose output is replicated over them)."""
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(np.asarray(devices), ("processes",))
    return mesh, jax.jit(lambda x: x, out_shardings=NamedSharding(mesh, PartitionSpec()))


def _allgather_rows(row: np.ndarray) -> np.ndarray:
    """Every process's ``row`` (same shape and dtype everywhere), stacked in process order
    (collective). One device per process carries them (``jax.experimental.multihost_utils``'s
    gather holds a copy on every local device)."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    first: dict[int, Any] = {}
    for device in jax.devices():  # the same global order in every process
        first.setdefault(device.process_index, device)
    devices = tuple(first[index] for index in range(jax.process_count()))
    mesh, replicate = _replicate(devices)
    local = jax.device_put(row[None], devices[jax.process_index()])
    stacked = jax.make_array_from_single_device_arrays(
        (len(devices), *row.shape), NamedSharding(mesh, PartitionSpec("processes")), [local]
    )
    return np.asarray(replicate(stacked).addressable_data(0))


def allgather_objects(value: Any) -> list[Any]:
    """``value`` of every process, in process order (collective)."""
    if runtime.process_count() == 1:
        return [value]
    data = np.frombuffer(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL), np.uint8)
    sizes = _allgather_rows(np.asarray([data.size], np.int64)).reshape(-1)
    padded = np.zeros(_padded_size(int(sizes.max())), np.uint8)
    padded[: data.size] = data
    del data
    gathered = _allgather_rows(padded)
    return [pickle.loads(gathered[i, : sizes[i]].tobytes()) for i in range(sizes.size)]


def _one_line(error: BaseException) -> str:
    text = str(error).splitlines()[0] if str(error) else ""
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def _outcome(work: Callable[[], Any]) -> tuple[Any, BaseException | None]:
    try:
        return work(), None
    except Exception as error:  # shared with the other processes, then raised again
        return None, error


def _raise_first_failure(errors: list[str | None], own: BaseException | None) -> None:
    """Raises ``own`` (marked shared) or a ``PeerError`` for the first failed process."""
    if own is not None:
        raise _mark_shared(own)
    for index, message in enumerate(errors):
        if message is not None:
            raise PeerError(f"process {index}/{len(errors)}", message)


def gathered(work: Callable[[], Any]) -> list[Any]:
    """Every process's ``work()`` result, in process order (collective); raises in every process
    when ``work`` failed in any."""
    if runtime.process_count() == 1:
        return [work()]
    value, error = _outcome(work)
    results = allgather_objects((value, None if error is None else _one_line(error)))
    _raise_first_failure([message for _, message in results], error)
    return [result for result, _ in results]


def checked(work: Callable[[], Any]) -> Any:
    """This process's own ``work()`` result (collective; nothing but the outcome travels); raises in
    every process when ``work`` failed in any."""
    if runtime.process_count() == 1:
        return work()
    value, error = _outcome(work)
    _raise_first_failure(allgather_objects(None if error is None else _one_line(error)), error)
    return value


def decided(work: Callable[[], Any]) -> Any:
    """The lead's ``work()`` result in every process (collective; only the lead runs ``work``);
    its error raised in every process."""
    if runtime.process_count() == 1:
        return work()
    value, error = _outcome(work) if runtime.is_lead() else (None, None)
    outcome = (value, None if error is None else _one_line(error))
    lead_value, lead_error = allgather_objects(outcome if runtime.is_lead() else None)[0]
    _raise_first_failure([lead_error] + [None] * (runtime.process_count() - 1), error)
    return lead_value


def barrier(name: str) -> None:
    """Waits until every process gets here (collective)."""
    if runtime.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def host_array(array) -> np.ndarray:
    """``array`` as one NumPy array in every process: a JAX array sharded over other processes'
    devices is gathered first (collective for such arrays)."""
    import jax

    if isinstance(array, jax.Array) and not (
        array.is_fully_addressable or array.is_fully_replicated
    ):
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(array, tiled=True))
    return np.asarray(array)
