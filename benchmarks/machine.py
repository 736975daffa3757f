"""Facts about the machine a benchmark runs on: CPU model, last-level cache, memory bandwidth.

Imported by the benchmark scripts (run from the repository root or benchmarks/);
not part of the qmoe_jax package.
"""

from __future__ import annotations

import glob
import itertools
import os
import platform
import threading
import time

import numpy as np


def cpu_model() -> str:
    """/proc/cpuinfo's 'model name' (the platform's processor string elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(
                line.split(":", 1)[1].strip() for line in f if line.startswith("model name")
            )
    except (OSError, StopIteration):
        return platform.processor() or "unknown"


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
