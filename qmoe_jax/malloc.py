"""glibc malloc settings for the commands that run big XLA programs (``python -m
qmoe_jax.compress``).

Three settings and one call, all for Linux with glibc; elsewhere they do nothing.

**Arenas** (``limit_arenas``): with XLA's many threads glibc's default of 8
arenas per core holds freed memory in per-thread arenas and inflates peak RSS;
the compressor caps them at 2 (M_ARENA_MAX, set in-process).

**A fixed mmap threshold** (``fix_mmap_threshold``): glibc serves a block of at
least M_MMAP_THRESHOLD bytes with its own ``mmap`` and unmaps it on free. The
threshold starts at 128 KiB, but each freed mmap'd block raises it to that
block's size (up to 32 MiB), and from then on blocks below it come from the
arenas, where freed memory stays resident between and around live blocks.
XLA:CPU allocates a program's buffers afresh on every call, megabytes each,
so the compressor's RSS crept upward layer after layer; with the threshold
fixed at 1 MiB (mallopt, in-process; ``QMOE_JAX_MMAP_THRESHOLD`` overrides it
in bytes, 0 keeps glibc's moving threshold) those buffers leave the resident
set when freed (benchmarks/streaming.py; docs/measurements.md).

**Free memory** (``release_free_memory``): ``malloc_trim(0)`` after a step that freed much of
what it allocated (opening a model for inference; each expert group the compressor finishes), so
the freed heap leaves the resident set; and, once a model is open for inference, after each XLA
compilation (``release_free_memory_after_compiles``).

**Huge pages** (``reexec_with_huge_pages``): XLA:CPU allocates a program's
buffers afresh on every call, and the big ones are big: a switch-base wo
Hessian is 3072² float32, 36 MiB. glibc serves blocks over 32 MiB (and
smaller ones once freed memory has been trimmed) with fresh ``mmap``s, so
every call first-touches new 4 KiB pages, tens of thousands per switch-base
expert's GPTQ. glibc ≥ 2.35
has a tunable, ``glibc.malloc.hugetlb=1``, that marks malloc's memory
``MADV_HUGEPAGE``; where the kernel's transparent huge pages are in
``madvise`` mode (the default of Debian and Ubuntu kernels), pages then come
2 MiB at a time, and the page faults drop by one to two orders of magnitude
(benchmarks/malloc_pages.py measures it in alternating processes; figures in
docs/measurements.md).

glibc reads tunables once, when the process starts, so a command that wants
it re-executes itself first thing (``os.execve`` with the same interpreter,
arguments and environment plus the tunable, appended to any
``GLIBC_TUNABLES`` already set). Nothing is re-executed where it would not
help: THP mode ``always`` (huge pages already) or ``never`` (none to get),
glibc older than 2.35, a ``GLIBC_TUNABLES`` that already sets
``glibc.malloc.hugetlb`` (the user's choice stands), or
``QMOE_JAX_HUGE_PAGES=0`` (the opt-out). Importing qmoe_jax never
re-executes anything: only a command's ``__main__`` calls it.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import platform
import sys
from collections.abc import Mapping

TUNABLES = "GLIBC_TUNABLES"
HUGE_PAGE_TUNABLE = "glibc.malloc.hugetlb"
HUGE_PAGE_SETTING = f"{HUGE_PAGE_TUNABLE}=1"
OPT_OUT = "QMOE_JAX_HUGE_PAGES"
THP_MODE_FILE = "/sys/kernel/mm/transparent_hugepage/enabled"
MIN_GLIBC = (2, 35)
_M_ARENA_MAX = -8
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_VARIABLE = "QMOE_JAX_MMAP_THRESHOLD"
DEFAULT_MMAP_THRESHOLD = 1 << 20


def limit_arenas(arenas: int = 2) -> None:
    """Caps glibc's malloc arenas at ``arenas`` (M_ARENA_MAX); nothing where the C library is not
    glibc."""
    try:
        ctypes.CDLL("libc.so.6").mallopt(_M_ARENA_MAX, arenas)
    except (OSError, AttributeError):
        pass  # not glibc: nothing to tune


def mmap_threshold(environ: Mapping[str, str]) -> int:
    """The mmap threshold ``fix_mmap_threshold`` sets: ``QMOE_JAX_MMAP_THRESHOLD`` in bytes (0:
    none, glibc's moving threshold stays), else 1 MiB.

    Raises:
      ValueError: the variable is not a whole number of bytes from 0 to 32 MiB (glibc's maximum).
    """
    text = environ.get(MMAP_THRESHOLD_VARIABLE, "").strip()
    if not text:
        return DEFAULT_MMAP_THRESHOLD
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= 32 << 20:
        raise ValueError(
            f"{MMAP_THRESHOLD_VARIABLE}={text!r}: give the mmap threshold in bytes, from 0 "
            f"(glibc's own moving threshold) to {32 << 20}, or unset it for "
            f"{DEFAULT_MMAP_THRESHOLD}"
        )
    return value


def fix_mmap_threshold() -> None:
    """Fixes glibc's mmap threshold (M_MMAP_THRESHOLD) at ``mmap_threshold(os.environ)`` bytes, so
    freed big blocks leave the resident set (module docstring); nothing where the C library is not
    glibc or the threshold is 0."""
    threshold = mmap_threshold(os.environ)
    if not threshold:
        return
    try:
        ctypes.CDLL("libc.so.6").mallopt(_M_MMAP_THRESHOLD, threshold)
    except (OSError, AttributeError):
        pass  # not glibc: nothing to tune


def release_free_memory() -> None:
    """Returns the heap's free memory to the system (glibc's ``malloc_trim(0)``); nothing where the
    C library is not glibc.

    glibc keeps memory freed by big transient work (restoring a checkpoint on tensorstore's
    threads, converting its arrays) in its arenas, where it counts in the resident set until malloc
    hands it out again; a step that frees much of what it allocated calls this at its end.
    """
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc: nothing to release


# The event jax records when XLA has compiled a program, before it first runs (jax 0.10's
# jax._src.dispatch.BACKEND_COMPILE_EVENT; tests/commands/test_malloc.py fails if it moves).
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_released_after_compiles = False


def _release_after_compile(event: str, duration: float, **_) -> None:
    if event == COMPILE_EVENT:
        release_free_memory()


def release_free_memory_after_compiles() -> None:
    """From now on, returns the heap's free memory to the system right after XLA compiles a program,
    before the program first runs (a jax monitoring listener; registered once per process).

    Compiling a decoding program allocates and frees hundreds of megabytes that glibc keeps; the
    program's own buffers, allocated when it runs, then come on top of them. Opening a model for
    inference (``inference.loading.open_model``) calls this.
    """
    global _released_after_compiles
    if _released_after_compiles:
        return
    import jax.monitoring

    jax.monitoring.register_event_duration_secs_listener(_release_after_compile)
    _released_after_compiles = True


def thp_mode(path: str = THP_MODE_FILE) -> str | None:
    """The kernel's transparent huge page mode (the bracketed word of ``path``: always, madvise or
    never), or None where the file is missing or unreadable."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return None
    start, stop = text.find("["), text.find("]")
    return text[start + 1 : stop] if 0 <= start < stop else None


def _glibc_version(libc: tuple[str, str]) -> tuple[int, ...] | None:
    name, version = libc
    if name != "glibc":
        return None
    try:
        return tuple(int(part) for part in version.split(".")[:2])
    except ValueError:
        return None


def _tunable_value(environ: Mapping[str, str]) -> str | None:
    """The value ``GLIBC_TUNABLES`` gives ``glibc.malloc.hugetlb`` (the last one, as glibc reads
    them), or None."""
    values = [
        part.split("=", 1)[1]
        for part in environ.get(TUNABLES, "").split(":")
        if part.startswith(HUGE_PAGE_TUNABLE + "=")
    ]
    return values[-1] if values else None


def huge_page_decision(
    environ: Mapping[str, str], libc: tuple[str, str], mode: str | None
) -> tuple[bool, str]:
    """(whether to re-execute with ``glibc.malloc.hugetlb=1``, why, in words), for the process
    environment ``environ``, ``platform.libc_ver()``'s answer ``libc`` and the THP mode ``mode``."""
    if environ.get(OPT_OUT, "") == "0":
        return False, f"off ({OPT_OUT}=0)"
    if _tunable_value(environ) is not None:
        return False, f"as set in {TUNABLES} ({environ[TUNABLES]})"
    version = _glibc_version(libc)
    if version is None:
        return False, "off (not glibc)"
    if version < MIN_GLIBC:
        return False, f"off (glibc {libc[1]} has no {HUGE_PAGE_TUNABLE}; it needs 2.35)"
    if mode != "madvise":
        return False, f"not needed (transparent huge pages: {mode or 'unknown'})"
    return True, f"on ({TUNABLES}={HUGE_PAGE_SETTING}, transparent huge pages: madvise)"


def huge_page_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` with ``glibc.malloc.hugetlb=1`` appended to ``GLIBC_TUNABLES``
    (colon-separated)."""
    tunables = [part for part in environ.get(TUNABLES, "").split(":") if part]
    return {**environ, TUNABLES: ":".join(tunables + [HUGE_PAGE_SETTING])}


def huge_pages_status() -> str:
    """Whether malloc gets huge pages, in words (benchmarks print it): this process's state where
    its ``GLIBC_TUNABLES`` sets the tunable, else what ``reexec_with_huge_pages`` does for a command
    started now."""
    environ = os.environ
    value = _tunable_value(environ)
    if value is not None:
        state = "off" if value == "0" else "on"
        pages = thp_mode() or "unknown"
        return f"{state} ({TUNABLES}={environ[TUNABLES]}, transparent huge pages: {pages})"
    return huge_page_decision(environ, platform.libc_ver(), thp_mode())[1]


def _started_as(entry: str) -> bool:
    """Whether the interpreter's own command line runs ``entry``: ``-m entry`` for a module name,
    the same file for a path ending in .py (not, say, runpy inside another program, which an exec
    would replace)."""
    argv = sys.orig_argv
    if entry.endswith(".py"):
        return any(os.path.isfile(arg) and os.path.samefile(arg, entry) for arg in argv[1:])
    return any(flag == "-m" and name == entry for flag, name in itertools.pairwise(argv))


def reexec_with_huge_pages(entry: str) -> None:
    """Re-executes this process with ``glibc.malloc.hugetlb=1`` where that helps (module docstring).
    ``entry`` is the caller's module name (``python -m``) or script path: a process whose command
    line does not run it is left alone. Returns where nothing is re-executed or the exec fails (the
    process then goes on as it is)."""
    if sys.platform != "linux" or not _started_as(entry):
        return
    wanted, _ = huge_page_decision(os.environ, platform.libc_ver(), thp_mode())
    if not wanted:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(sys.executable, sys.orig_argv, huge_page_environment(os.environ))
    except OSError:
        pass  # an interpreter we cannot start again: run on without huge pages


if __name__ == "__main__":  # python -m qmoe_jax.malloc: what the commands get on this machine
    reexec_with_huge_pages("qmoe_jax.malloc")
    print(f"malloc huge pages: {huge_pages_status()}")
