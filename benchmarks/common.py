"""What the benchmark scripts share: facts about the machine and writing their JSON results.

Each script writes one JSON file, by default ``benchmarks/results/<script name>.json``
(``write_result``), holding its own figures beside the machine facts (``machine_facts``: CPU
model, cores, jax version, date) and the exact command line, so that a result file says where
and how it was measured. Also the machine's last-level cache and memory bandwidth, for the
kernel benchmarks that compare against them.

Imported by the benchmark scripts, which run as ``python benchmarks/<script>.py`` (from the
repository root or anywhere: Python puts the script's folder first on sys.path); not part of
the qmoe_jax package. Importing it puts the repository root first on sys.path, as pytest does
(``pythonpath = ["."]``): every benchmark, and every child process it starts from its own
script, measures this checkout's qmoe_jax, and a development build of the extension in the root
(docs/development.md) where there is one, the installed extension otherwise.
"""

from __future__ import annotations

import contextlib
import datetime
import glob
import importlib.metadata
import itertools
import json
import os
import platform
import shlex
import sys
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if sys.path[:1] != [REPO]:
    sys.path.insert(0, REPO)
RESULTS_DIR = os.path.join(REPO, "benchmarks", "results")
# Checkpoints and runs a benchmark makes on the way (git ignores runs/; results/ is for the JSON).
WORK_DIR = os.path.join(REPO, "runs", "benchmarks")


def _cpuinfo_fields() -> dict[str, str]:
    """The first processor's fields in /proc/cpuinfo ({} where there is none)."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break  # the end of the first processor's block
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return fields


def cpu_model() -> str:
    """The CPU: /proc/cpuinfo's model name with its family, model and stepping, e.g. "AMD EPYC
    (family 25, model 17, stepping 1)": some virtual machines name only the vendor's line, and the
    numbers still tell the generation apart. The platform's processor string where there is no
    /proc/cpuinfo."""
    fields = _cpuinfo_fields()
    name = fields.get("model name") or platform.processor() or "unknown"
    numbers = [
        f"{label} {fields[key]}"
        for key, label in (("cpu family", "family"), ("model", "model"), ("stepping", "stepping"))
        if key in fields
    ]
    return f"{name} ({', '.join(numbers)})" if numbers else name


def core_count() -> int:
    """Logical CPUs of the machine (``os.cpu_count()``)."""
    return os.cpu_count() or 1


def usable_cores() -> int:
    """Logical CPUs this process may run on (fewer than ``core_count`` under ``taskset``)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no sched_getaffinity on this platform
        return core_count()


def jax_version() -> str:
    """The installed jax's version, read without importing jax ("not installed" without one)."""
    try:
        return importlib.metadata.version("jax")
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def now() -> str:
    """The current date and time in UTC, ISO 8601 to the second."""
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


def machine_facts() -> dict:
    """Where a result was measured: CPU model, logical CPUs (all, and usable by this process),
    load average (the machine may be shared), jax and Python versions, and the date."""
    return {
        "cpu": cpu_model(),
        "cores": core_count(),
        "usable_cores": usable_cores(),
        "load_average": list(os.getloadavg()),
        "jax_version": jax_version(),
        "python_version": platform.python_version(),
        "date": now(),
    }


def work_dir(name: str) -> str:
    """The default folder of benchmark ``name``'s checkpoints and runs: runs/benchmarks/<name>."""
    return os.path.join(WORK_DIR, name)


@contextlib.contextmanager
def restored_isa():
    """QMOE_CPU_ISA as it was on entry, set again (or unset) on exit: benchmarks that force an
    instruction set for some calls (the CPU kernels read the variable at each call)."""
    saved = os.environ.get("QMOE_CPU_ISA")
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("QMOE_CPU_ISA", None)
        else:
            os.environ["QMOE_CPU_ISA"] = saved


def result_path(name: str) -> str:
    """The default result file of benchmark ``name``: benchmarks/results/<name>.json."""
    return os.path.join(RESULTS_DIR, f"{name}.json")


def write_result(name: str, payload: dict, path: str | None = None) -> str:
    """Writes benchmark ``name``'s ``payload`` as JSON to ``path`` (default ``result_path(name)``),
    creating its folder, with the machine facts and the exact command line (sys.argv) beside it;
    returns the path written.

    The file holds ``{"benchmark": name, "command": ..., "argv": [...], "machine": {...},
    **payload}``; ``command`` is the command line as one shell-quoted string.
    """
    reserved = {"benchmark", "command", "argv", "machine"} & payload.keys()
    if reserved:
        raise ValueError(
            f"the payload of benchmark {name!r} uses the reserved keys {sorted(reserved)}; "
            "write_result adds them itself"
        )
    path = path or result_path(name)
    record = {
        "benchmark": name,
        "command": shlex.join(["python", *sys.argv]),
        "argv": list(sys.argv),
        "machine": machine_facts(),
        **payload,
    }
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(record, f, indent=1)
        f.write("\n")
    print(f"wrote {path}")
    return path


def _size_bytes(text: str) -> int:
    text = text.strip().upper()
    for suffix, factor in (("K", 1 << 10), ("M", 1 << 20), ("G", 1 << 30)):
        if text.endswith(suffix):
            return int(text[:-1]) * factor
    return int(text)


def last_level_cache() -> dict:
    """The highest-level data or unified cache of CPU 0, from sysfs.

    Returns {"level", "bytes", "shared_cpus"}; bytes is 0 where sysfs does not say.
    """
    best = {"level": 0, "bytes": 0, "shared_cpus": ""}
    for index in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*"):
        try:
            with open(os.path.join(index, "type")) as f:
                kind = f.read().strip()
            with open(os.path.join(index, "level")) as f:
                level = int(f.read())
            with open(os.path.join(index, "size")) as f:
                size = _size_bytes(f.read())
            with open(os.path.join(index, "shared_cpu_list")) as f:
                shared = f.read().strip()
        except (OSError, ValueError):
            continue
        if kind in ("Data", "Unified") and level > best["level"]:
            best = {"level": level, "bytes": size, "shared_cpus": shared}
    return best


def memory_bandwidth(megabytes: int = 512, repeats: int = 5) -> dict:
    """Main-memory bandwidth, best of ``repeats``, over ``megabytes`` MB (far past any cache).

    ``copy_gb_s``: numpy copies on every core at once (one thread per core,
    each its own slice), bytes read plus bytes written (STREAM's convention).
    ``dot_read_gb_s``: XLA's dense float32 matrix-vector product over a
    matrix of that size, its bytes over its time: the rate at which a dense
    dot streams weights from memory, the physical limit of the dense
    baselines.
    """
    import jax
    import jax.numpy as jnp

    count = megabytes * (1 << 20) // 4
    threads = os.cpu_count() or 1
    copy_best = _copy_seconds(count, threads, repeats)  # its arrays are freed on return
    cols = 8192
    matrix = jnp.ones((count // cols, cols), jnp.float32)
    vector = jnp.ones(cols, jnp.float32)
    dot = jax.jit(jnp.dot)
    dot_best = _best_seconds(lambda: dot(matrix, vector).block_until_ready(), repeats)
    nbytes = count * 4
    return {
        "megabytes": megabytes,
        "copy_threads": threads,
        "copy_gb_s": 2 * nbytes / copy_best / 1e9,
        "dot_read_gb_s": nbytes / dot_best / 1e9,
    }


def _copy_seconds(count: int, threads: int, repeats: int) -> float:
    """Best seconds to copy ``count`` float32 values with ``threads`` threads, one slice each."""
    import numpy as np

    source = np.ones(count, np.float32)
    target = np.empty_like(source)
    bounds = np.linspace(0, count, threads + 1).astype(np.int64)

    def copy_all():
        workers = [
            threading.Thread(target=np.copyto, args=(target[a:b], source[a:b]))
            for a, b in itertools.pairwise(bounds)
        ]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()

    return _best_seconds(copy_all, repeats)


def _best_seconds(run, repeats: int) -> float:
    run()
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - started)
    return best
