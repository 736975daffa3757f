"""qmoe_jax.malloc: when the compression CLI re-executes itself with glibc's huge-page tunable, and
that it does."""

import platform
import sys

import pytest
from helpers.child_process import run_python

from qmoe_jax import malloc

GLIBC = ("glibc", "2.36")
HOST_QUALIFIES = (
    sys.platform == "linux"
    and malloc.huge_page_decision({}, platform.libc_ver(), malloc.thp_mode())[0]
)


@pytest.mark.parametrize(
    ("environ", "libc", "mode", "wanted", "says"),
    [
        ({}, GLIBC, "madvise", True, "on (GLIBC_TUNABLES=glibc.malloc.hugetlb=1"),
        ({}, ("glibc", "2.35"), "madvise", True, "on"),
        ({}, GLIBC, "always", False, "not needed (transparent huge pages: always)"),
        ({}, GLIBC, "never", False, "not needed (transparent huge pages: never)"),
        ({}, GLIBC, None, False, "not needed (transparent huge pages: unknown)"),
        (
            {},
            ("glibc", "2.31"),
            "madvise",
            False,
            "glibc 2.31 has no glibc.malloc.hugetlb; it needs 2.35",
        ),
        ({}, ("", ""), "madvise", False, "off (not glibc)"),
        ({}, ("musl", "1.2"), "madvise", False, "off (not glibc)"),
        ({"QMOE_JAX_HUGE_PAGES": "0"}, GLIBC, "madvise", False, "off (QMOE_JAX_HUGE_PAGES=0)"),
        ({"QMOE_JAX_HUGE_PAGES": "1"}, GLIBC, "madvise", True, "on"),
        (
            {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"},
            GLIBC,
            "madvise",
            False,
            "as set in GLIBC_TUNABLES",
        ),
        ({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, GLIBC, "madvise", True, "on"),
    ],
)
def test_decision(environ, libc, mode, wanted, says):
    decided, reason = malloc.huge_page_decision(environ, libc, mode)
    assert decided == wanted
    assert says in reason


@pytest.mark.parametrize(
    ("before", "after"),
    [
        (None, "glibc.malloc.hugetlb=1"),
        ("", "glibc.malloc.hugetlb=1"),
        ("glibc.malloc.arena_max=2", "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"),
        ("glibc.malloc.arena_max=2:", "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"),
    ],
)
def test_environment_appends_the_tunable(before, after):
    environ = {"PATH": "/bin"} if before is None else {"PATH": "/bin", "GLIBC_TUNABLES": before}
    tuned = malloc.huge_page_environment(environ)
    assert tuned == {"PATH": "/bin", "GLIBC_TUNABLES": after}
    assert malloc.huge_page_decision(tuned, GLIBC, "madvise")[0] is False  # never twice


@pytest.mark.parametrize(
    ("text", "mode"),
    [
        ("always [madvise] never\n", "madvise"),
        ("[always] madvise never\n", "always"),
        ("always madvise [never]\n", "never"),
        ("garbage\n", None),
    ],
)
def test_thp_mode(tmp_path, text, mode):
    path = tmp_path / "enabled"
    path.write_text(text)
    assert malloc.thp_mode(str(path)) == mode
    assert malloc.thp_mode(str(tmp_path / "missing")) is None


def test_only_the_command_line_entry_reexecutes(monkeypatch, tmp_path):
    script = tmp_path / "bench.py"
    script.write_text("")
    monkeypatch.setattr(sys, "orig_argv", ["python", "-m", "qmoe_jax.compress", "--seed", "1"])
    assert malloc._started_as("qmoe_jax.compress")
    assert not malloc._started_as("qmoe_jax.evaluate")
    monkeypatch.setattr(sys, "orig_argv", ["python", str(script), "--repeats", "2"])
    assert malloc._started_as(str(script))
    assert not malloc._started_as("qmoe_jax.compress")
    monkeypatch.setattr(
        sys, "orig_argv", ["python", "-m", "pytest", "tests"]
    )  # runpy in another program
    called = []
    monkeypatch.setattr(malloc.os, "execve", lambda *args: called.append(args))
    malloc.reexec_with_huge_pages("qmoe_jax.compress")
    assert called == []


@pytest.mark.skipif(
    not HOST_QUALIFIES,
    reason="needs Linux, glibc >= 2.35 and transparent huge pages in madvise mode",
)
def test_command_reexecutes_with_huge_pages():
    completed = run_python(
        ["-m", "qmoe_jax.malloc"], timeout=120, GLIBC_TUNABLES="glibc.malloc.arena_max=2"
    )
    assert completed.returncode == 0, completed.stderr
    assert (
        "malloc huge pages: on (GLIBC_TUNABLES=glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"
        in completed.stdout
    )

    opted_out = run_python(["-m", "qmoe_jax.malloc"], timeout=120, QMOE_JAX_HUGE_PAGES="0")
    assert "malloc huge pages: off (QMOE_JAX_HUGE_PAGES=0)" in opted_out.stdout

    # the compression CLI re-executes before it parses its arguments: they arrive intact
    refused = run_python(["-m", "qmoe_jax.compress", "--group_size", "-3"], timeout=300)
    assert refused.returncode == 2 and "group_size" in refused.stderr, refused.stderr


RELEASE_CHILD = """
import numpy as np
from qmoe_jax.malloc import release_free_memory

def rss_mib():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) >> 10 for line in f if line.startswith("VmRSS:"))

blocks = [np.ones(12_000) for _ in range(2000)]  # 96 KB each: heap blocks, not mmaps
last = blocks[-1]  # keeps the heap's top in use, so that freeing the rest does not shrink it
del blocks
freed = rss_mib()
release_free_memory()
print(freed, rss_mib())
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
def test_release_free_memory_returns_the_freed_heap():
    completed = run_python(["-c", RELEASE_CHILD], timeout=120)
    assert completed.returncode == 0, completed.stderr
    freed, released = map(int, completed.stdout.split())
    assert freed - released >= 100, (freed, released)  # of the ~190 MiB freed


AFTER_COMPILES_CHILD = """
import jax, jax.numpy as jnp, numpy as np
from qmoe_jax import malloc

calls = []
malloc.release_free_memory = lambda: calls.append(1)
f = jax.jit(lambda x: jnp.sin(x) * 2)
f(np.ones(3, np.float32)).block_until_ready()
before = len(calls)
malloc.release_free_memory_after_compiles()
malloc.release_free_memory_after_compiles()  # registers once
f(np.ones(3, np.float32)).block_until_ready()  # cached: no compilation
cached = len(calls)
f(np.ones(4, np.float32)).block_until_ready()  # a new shape compiles
jax.jit(lambda x: x + 1)(np.ones(2, np.float32)).block_until_ready()
print(before, cached, len(calls))
"""


def test_free_memory_is_released_after_each_compilation_once_asked():
    completed = run_python(["-c", AFTER_COMPILES_CHILD], timeout=120)
    assert completed.returncode == 0, completed.stderr
    assert completed.stdout.split() == ["0", "0", "2"], completed.stdout


@pytest.mark.parametrize(
    ("value", "expected"),
    [(None, 1 << 20), ("", 1 << 20), ("0", 0), ("4194304", 4 << 20), (str(32 << 20), 32 << 20)],
)
def test_mmap_threshold_from_the_environment(value, expected):
    environ = {} if value is None else {malloc.MMAP_THRESHOLD_VARIABLE: value}
    assert malloc.mmap_threshold(environ) == expected


@pytest.mark.parametrize("value", ["1MiB", "-1", str((32 << 20) + 1), "1.5"])
def test_bad_mmap_threshold_is_refused_naming_the_variable(value):
    with pytest.raises(ValueError, match=r"QMOE_JAX_MMAP_THRESHOLD.*in bytes"):
        malloc.mmap_threshold({malloc.MMAP_THRESHOLD_VARIABLE: value})


# After a 16 MiB block is freed, glibc's moving threshold serves 4 MiB blocks from the heap, where
# freed blocks below a live one stay resident; with the threshold fixed they are unmapped on free.
RETAINED = """
import ctypes, sys
from qmoe_jax import malloc
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
if sys.argv[1] == "fixed":
    malloc.fix_mmap_threshold()
def rss():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) << 10
big = libc.malloc(16 << 20)
ctypes.memset(big, 1, 16 << 20)
libc.free(big)
base = rss()
blocks = [libc.malloc(4 << 20) for _ in range(8)]
for block in blocks:
    ctypes.memset(block, 1, 4 << 20)
for block in blocks[:-1]:
    libc.free(block)
print(rss() - base)
"""


@pytest.mark.skipif(
    sys.platform != "linux" or platform.libc_ver()[0] != "glibc", reason="glibc's malloc only"
)
def test_fixed_mmap_threshold_returns_freed_blocks():
    retained = {}
    for mode in ("moving", "fixed"):
        child = run_python(["-c", RETAINED, mode], timeout=120, QMOE_JAX_MMAP_THRESHOLD="")
        assert child.returncode == 0, child.stderr
        retained[mode] = int(child.stdout.split()[-1])
    # seven freed 4 MiB blocks: resident with the moving threshold, gone with the fixed one
    assert retained["moving"] >= 24 << 20, retained
    assert retained["fixed"] <= 8 << 20, retained
