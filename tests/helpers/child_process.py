"""Child Python processes that import the same qmoe_jax as the test process.

`python -c` and `python -m` put the working directory first on sys.path, so a
child's qmoe_jax would depend on where it starts. Children start in the tests
directory, with the directory that holds the test process's qmoe_jax first on
PYTHONPATH, then the tests directory (for ``helpers``).

A child started with ``popen_python`` takes Ctrl-C as a command started from a
terminal does. A shell without job control starts background jobs with
SIGINT ignored, and the ignoring is inherited down to pytest's children,
where Python then installs no ``KeyboardInterrupt`` handler: a test that
interrupts a child would see it run to the end.
"""

import os
import signal
import subprocess
import sys

import qmoe_jax

TESTS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(qmoe_jax.__file__)))


def child_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, **extra)
    paths = [PACKAGE_PARENT, TESTS_DIR] + [
        p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p
    ]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


def run_python(args: list[str], *, timeout: float, **extra_env: str) -> subprocess.CompletedProcess:
    """`python *args` in a child, output captured as text."""
    return subprocess.run(
        [sys.executable, *args],
        env=child_env(**extra_env),
        cwd=TESTS_DIR,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def popen_python(args: list[str], **extra_env: str) -> subprocess.Popen:
    """`python *args` started in a child, stdout and stderr merged into one pipe, with SIGINT's
    default action (module docstring)."""
    # A signal with a handler is reset to its default action in the child; an ignored one stays
    # ignored. So SIGINT gets a handler while the child starts.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return subprocess.Popen(
            [sys.executable, *args],
            env=child_env(**extra_env),
            cwd=TESTS_DIR,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
    finally:
        signal.signal(signal.SIGINT, previous)
