"""How every ``python -m qmoe_jax.*`` command ends: a short message for expected errors, a resume
hint on interrupts.

Wrap a command's ``main(argv)`` in ``run_cli``:

- an expected error (a ``ValueError``, which every checkpoint and option error
  is, an ``OSError`` such as a missing file or a full disk, or the bundled
  corpus being unavailable) prints ``error: <message>`` and exits 1;
- Ctrl-C (SIGINT) and SIGTERM print ``interrupted`` and exit 130 and 143;
- anything else is a bug and keeps its traceback.

In a multi-process run (``distributed.runtime``: the flags
``--coordinator_address``, ``--num_processes``, ``--process_id``, or a cluster
that JAX detects) ``run_cli`` joins it before ``main`` runs, and every message
names its process (``process 1/2: error: ...``). A process whose error the
others do not know of exits at once, without JAX's shutdown barrier (which
would wait for the others); they stop when JAX's heartbeat misses it.

A command adds what to do next to an error or an interrupt as an exception
note (``error.add_note("re-run the same command to resume ...")``); the notes
are printed after the message. ``--debug`` (add it with ``add_debug_flag``) or
``QMOE_JAX_DEBUG=1`` prints the traceback of expected errors too, and the log
messages of the libraries underneath (Orbax logs its failures through absl).
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import signal
import sys
import traceback
from collections.abc import Callable

from qmoe_jax.data.corpus import CorpusUnavailable
from qmoe_jax.distributed import runtime
from qmoe_jax.distributed.exchange import PeerError, is_shared

DEBUG_FLAG = "--debug"
DEBUG_ENVIRONMENT = "QMOE_JAX_DEBUG"
EXPECTED_ERRORS = (ValueError, OSError, CorpusUnavailable)
EXIT_ERROR = 1
EXIT_SIGINT = 128 + signal.SIGINT
EXIT_SIGTERM = 128 + signal.SIGTERM


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread as Ctrl-C raises ``KeyboardInterrupt``, so that the same
    cleanup runs."""


def add_debug_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        DEBUG_FLAG,
        action="store_true",
        help=f"print the Python traceback of an error (also {DEBUG_ENVIRONMENT}=1)",
    )


def finite_float(text: str) -> float:
    """The argparse ``type`` of every float flag: a finite number. NaN and ±inf are refused when
    the flags are parsed (exit 2), before anything is loaded."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
    return value


def _debugging(argv: list[str]) -> bool:
    return DEBUG_FLAG in argv or os.environ.get(DEBUG_ENVIRONMENT, "") not in ("", "0")


def _terminate(signal_number, frame) -> None:
    raise Terminated()


def _message(error: BaseException) -> str:
    if isinstance(error, OSError) and error.strerror and error.filename:
        return f"{error.strerror}: {error.filename}"
    return str(error) or type(error).__name__


def _with_notes(text: str, error: BaseException) -> str:
    text = "; ".join([text] + list(getattr(error, "__notes__", [])))
    process = runtime.label()
    return f"{process}: {text}" if process else text


def _exit(code: int, error: BaseException) -> None:
    """Exits with ``code``; at once (``os._exit``) when other processes of the run may be waiting
    for this one in a collective."""
    if runtime.process_count() > 1 and not is_shared(error):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


def run_cli(main: Callable[[list[str]], None], argv: list[str] | None = None) -> None:
    """Runs ``main(argv)`` (default: the process's arguments) and turns its expected failures into
    exit codes."""
    argv = sys.argv[1:] if argv is None else list(argv)
    debug = _debugging(argv)
    if not debug:
        logging.getLogger("absl").setLevel(logging.CRITICAL)  # Orbax's own warnings and tracebacks
    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        main(runtime.join_from_argv(argv))
    except KeyboardInterrupt as interruption:
        if debug:
            traceback.print_exc()
        print(_with_notes("interrupted", interruption), file=sys.stderr, flush=True)
        _exit(EXIT_SIGTERM if isinstance(interruption, Terminated) else EXIT_SIGINT, interruption)
    except PeerError as error:  # another process failed and printed why
        if debug:
            traceback.print_exc()
        print(_with_notes(f"stopped: {error}", error), file=sys.stderr, flush=True)
        _exit(EXIT_ERROR, error)
    except EXPECTED_ERRORS as error:
        if debug:
            traceback.print_exc()
        print(_with_notes(f"error: {_message(error)}", error), file=sys.stderr, flush=True)
        _exit(EXIT_ERROR, error)
    except Exception as error:  # a bug: its traceback, and no wait for the other processes
        if runtime.process_count() == 1 or is_shared(error):
            raise
        traceback.print_exc()
        print(_with_notes(f"error: {_message(error)}", error), file=sys.stderr, flush=True)
        _exit(EXIT_ERROR, error)
    finally:
        signal.signal(signal.SIGTERM, previous)
