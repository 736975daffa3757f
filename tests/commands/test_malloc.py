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
