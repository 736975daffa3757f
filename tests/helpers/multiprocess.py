"""Several child processes that form one JAX multi-process run on 127.0.0.1, under a watchdog.

Each child is ``python *args --coordinator_address 127.0.0.1:<port> --num_processes N
--process_id i`` (the flags every qmoe_jax command takes; a ``-c`` script passes its arguments to
``qmoe_jax.distributed.runtime.join_from_argv``), started like ``child_process``'s children, with
``devices`` host devices and gloo collectives. Output goes to files, not pipes, so a chatty child
never blocks. The watchdog kills every child that outlives it.
"""

import dataclasses
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

from helpers.child_process import TESTS_DIR, child_env

# The pieces of gloo's "[Gloo] Rank R is connected to N peer ranks. Expected number of connected
# peer ranks is : N" line. Its threads write these pieces separately, so two lines can interleave
# piece by piece; what is left once they are removed must be digits and whitespace.
GLOO_PIECES = re.compile(
    r"\[Gloo\] Rank |Expected number of connected peer ranks is :|is connected to|peer ranks\."
)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@dataclasses.dataclass
class Finished:
    """One child's exit code and output."""

    returncode: int
    stdout: str
    stderr: str


class ProcessGroup:
    """``processes`` children running ``python *args`` as one JAX run.

    Args:
      args: the Python arguments (``["-m", "qmoe_jax.compress", ...]`` or ``["-c", code]``).
      processes: N; devices: host devices per process.
      env: extra environment variables for every child.
    """

    def __init__(self, args: list[str], processes: int = 2, devices: int = 2, **env: str):
        port = free_port()
        self.directory = tempfile.mkdtemp(prefix="qmoe_jax_multiprocess_")
        self.children: list[subprocess.Popen] = []
        self.paths: list[tuple[str, str]] = []
        for index in range(processes):
            flags = [
                f"--coordinator_address=127.0.0.1:{port}",
                f"--num_processes={processes}",
                f"--process_id={index}",
            ]
            paths = tuple(
                os.path.join(self.directory, f"{index}.{kind}") for kind in ("out", "err")
            )
            self.paths.append(paths)
            with open(paths[0], "w") as out, open(paths[1], "w") as err:
                self.children.append(
                    subprocess.Popen(
                        [sys.executable, *args, *flags],
                        env=child_env(
                            JAX_PLATFORMS="cpu",
                            XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
                            **env,
                        ),
                        cwd=TESTS_DIR,
                        stdout=out,
                        stderr=err,
                        start_new_session=True,  # a process group of its own, killed whole
                    )
                )

    def _read(self, index: int) -> tuple[str, str]:
        texts = []
        for path in self.paths[index]:
            with open(path, errors="replace") as f:
                texts.append(f.read())
        return texts[0], texts[1]

    def output(self, index: int) -> str:
        """What child ``index`` printed so far, stdout then stderr."""
        return "".join(self._read(index))

    def kill(self, index: int, signal_number: int = signal.SIGKILL) -> None:
        self.children[index].send_signal(signal_number)

    def kill_all(self) -> None:
        for child in self.children:
            if child.poll() is None:
                try:
                    os.killpg(child.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for child in self.children:
            child.wait()

    def wait(self, timeout: float) -> list[Finished]:
        """Every child's result; kills them all and raises ``TimeoutError`` (with their output)
        when one is still running after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        try:
            for child in self.children:
                child.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.kill_all()
            tails = "\n".join(
                f"--- process {i}:\n{self.output(i)[-3000:]}" for i in range(len(self.children))
            )
            raise TimeoutError(
                f"{len(self.children)} processes still running after {timeout} s\n{tails}"
            ) from None
        return [
            Finished(child.returncode, *self._read(index))
            for index, child in enumerate(self.children)
        ]

    def close(self) -> None:
        self.kill_all()
        shutil.rmtree(self.directory, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def run_processes(
    args: list[str], processes: int = 2, devices: int = 2, timeout: float = 900, **env: str
) -> list[Finished]:
    """Runs ``python *args`` as one run of ``processes`` children; their results in process
    order (``ProcessGroup``)."""
    with ProcessGroup(args, processes, devices, **env) as group:
        return group.wait(timeout)


def describe(results: list[Finished], tail: int = 3000) -> str:
    """The exit codes and output tails of every child, for assertion messages."""
    return "\n".join(
        f"--- process {i} (exit {r.returncode}):\n{(r.stdout + r.stderr)[-tail:]}"
        for i, r in enumerate(results)
    )


def printed_nothing(result: Finished) -> bool:
    """Whether a process printed nothing of its own: gloo's connection lines (its C++ code prints
    them to stdout, interleaved across threads) and JAX's log lines on stderr aside."""
    own = GLOO_PIECES.sub("", result.stdout)
    return re.fullmatch(r"[\d\s]*", own) is not None and "error" not in result.stderr.lower()
