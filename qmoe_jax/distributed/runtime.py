"""Joining JAX's multi-process runtime: one command, several processes (one per host, or per GPU).

Every ``python -m qmoe_jax.<command>`` runs either alone or as one process of
many. It joins a multi-process run when

- the flags ``--coordinator_address``, ``--num_processes`` and ``--process_id``
  are given (``--coordinator_address`` at least; JAX fills in what a detected
  cluster knows), or
- none is given and JAX's own cluster detection (SLURM, Open MPI, Kubernetes,
  Cloud TPU; what ``jax.distributed.initialize()`` without arguments uses)
  finds an environment that runs more than one process, so that
  ``srun python -m qmoe_jax.compress ...`` just works.

It then calls ``jax.distributed.initialize`` before any JAX computation, with
gloo collectives for CPU devices (JAX's CPU client has none by default).
``--heartbeat_timeout_seconds`` is how long the others wait for a process that
died before they stop too (JAX's default, 100 s).

Process 0 is the *lead*: it alone prints the report and progress and writes
the output directory; the others stay quiet except for errors, whose message
starts with the process (``process 1/2: error: ...``, ``label``).
docs/multihost.md describes what each command does across processes.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os

FLAGS = ("--coordinator_address", "--num_processes", "--process_id", "--heartbeat_timeout_seconds")
DEFAULT_HEARTBEAT_SECONDS = 100  # jax.distributed.initialize's own default

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Cluster:
    """How to join: ``jax.distributed.initialize``'s arguments (None: JAX detects them)."""

    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    heartbeat_timeout_seconds: int = DEFAULT_HEARTBEAT_SECONDS
    detected: str | None = None  # the cluster environment JAX found, e.g. "slurm"


def add_flags(parser: argparse.ArgumentParser) -> None:
    """The flags that make a command one process of many (``cli.run_cli`` reads them; a command's
    own parser lists them for ``--help`` and never sees them)."""
    group = parser.add_argument_group(
        "several processes (docs/multihost.md; default: join the cluster JAX detects, if any)"
    )
    group.add_argument(
        "--coordinator_address",
        default=argparse.SUPPRESS,
        help="host:port of process 0, where the processes meet",
    )
    group.add_argument(
        "--num_processes", type=int, default=argparse.SUPPRESS, help="processes in the run"
    )
    group.add_argument(
        "--process_id", type=int, default=argparse.SUPPRESS, help="this process, 0 to N-1"
    )
    group.add_argument(
        "--heartbeat_timeout_seconds",
        type=int,
        default=argparse.SUPPRESS,
        help="the others stop this long after a process dies (default: "
        f"{DEFAULT_HEARTBEAT_SECONDS})",
    )


def split_flags(argv: list[str]) -> tuple[dict, list[str]]:
    """(the values of ``FLAGS`` in ``argv``, the other arguments); ``--flag value`` and
    ``--flag=value`` both count. Raises ``ValueError`` for a flag without a value."""
    found: dict[str, str] = {}
    rest: list[str] = []
    position = 0
    while position < len(argv):
        arg = argv[position]
        name, equals, value = arg.partition("=")
        if arg == "--":
            rest += argv[position:]
            break
        if name in FLAGS:
            if not equals:
                position += 1
                if position == len(argv) or argv[position].startswith("--"):
                    raise ValueError(f"{name} needs a value")
                value = argv[position]
            found[name.lstrip("-")] = value
        else:
            rest.append(arg)
        position += 1
    return found, rest


def _integer(values: dict, name: str, least: int) -> int | None:
    if name not in values:
        return None
    try:
        number = int(values[name])
    except ValueError:
        raise ValueError(f"--{name} must be an integer, got {values[name]!r}") from None
    if number < least:
        raise ValueError(f"--{name} must be at least {least}, got {number}")
    return number


def detected_environment() -> tuple[str, int] | None:
    """(name, processes) of the cluster environment JAX's ``jax.distributed.initialize()`` would
    detect (opt-in methods such as mpi4py left out), or None."""
    try:
        from jax._src.clusters import ClusterEnv  # the list jax.distributed.initialize() tries
    except ImportError:  # a JAX that moved it: only the flags join
        return None
    for environment in ClusterEnv._cluster_types:
        try:
            if environment.opt_in_only_method or not environment.is_env_present():
                continue
            return getattr(environment, "name", None) or environment.__name__, int(
                environment.get_process_count()
            )
        except Exception as error:  # a half-configured environment: not a cluster to join
            logger.debug("cluster detection %s failed: %s", environment.__name__, error)
    return None


def cluster_from(values: dict) -> Cluster | None:
    """The run to join for the flag values of ``split_flags``; None when this process runs
    alone."""
    processes = _integer(values, "num_processes", 1)
    process_id = _integer(values, "process_id", 0)
    heartbeat = _integer(values, "heartbeat_timeout_seconds", 1) or DEFAULT_HEARTBEAT_SECONDS
    address = values.get("coordinator_address")
    if processes is not None and process_id is not None and process_id >= processes:
        raise ValueError(
            f"--process_id {process_id} is not one of the {processes} processes (0 to "
            f"{processes - 1})"
        )
    given = address is not None or processes is not None or process_id is not None
    detected = detected_environment()
    if not given:
        if detected is None or detected[1] <= 1:
            return None
        return Cluster(heartbeat_timeout_seconds=heartbeat, detected=detected[0])
    if detected is None and (address is None or processes is None or process_id is None):
        missing = [
            flag
            for flag, value in zip(FLAGS, (address, processes, process_id), strict=False)
            if value is None
        ]
        raise ValueError(
            f"{', '.join(missing)} missing: outside a cluster that JAX detects (SLURM, Open MPI, "
            "Kubernetes, Cloud TPU) a multi-process run needs --coordinator_address, "
            "--num_processes and --process_id"
        )
    if processes == 1:
        return None
    return Cluster(address, processes, process_id, heartbeat, detected and detected[0])


_joined: Cluster | None = None


def join(cluster: Cluster) -> None:
    """``jax.distributed.initialize`` for ``cluster``, with gloo collectives on CPU devices.

    Must run before any JAX computation (JAX's own rule); a second call is ignored.
    """
    global _joined
    import jax

    if jax.distributed.is_initialized():
        _joined = _joined or cluster
        return
    if os.environ.get("JAX_CPU_COLLECTIVES_IMPLEMENTATION") is None:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=cluster.coordinator_address,
        num_processes=cluster.num_processes,
        process_id=cluster.process_id,
        heartbeat_timeout_seconds=cluster.heartbeat_timeout_seconds,
    )
    _joined = cluster


def join_from_argv(argv: list[str]) -> list[str]:
    """Joins the run that ``argv``'s flags (or the detected cluster) describe; returns ``argv``
    without those flags."""
    values, rest = split_flags(argv)
    cluster = cluster_from(values)
    if cluster is not None:
        join(cluster)
    return rest


def process_count() -> int:
    """Processes in the run (1 when this one runs alone); starts no JAX backend when alone."""
    import jax

    return jax.process_count() if jax.distributed.is_initialized() else 1


def process_index() -> int:
    import jax

    return jax.process_index() if jax.distributed.is_initialized() else 0


def is_lead() -> bool:
    """Whether this process prints the report and writes the output (process 0)."""
    return process_index() == 0


def label() -> str:
    """``"process i/N"`` in a multi-process run, else ``""``."""
    count = process_count()
    return f"process {process_index()}/{count}" if count > 1 else ""


def lead_only(log):
    """``log`` on the lead; on the other processes a function that takes the same arguments and
    prints nothing."""
    return log if is_lead() else (lambda *args, **kwargs: None)
