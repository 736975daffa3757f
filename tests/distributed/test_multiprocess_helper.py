"""The multi-process tests' check that a process other than 0 printed nothing of its own: gloo's
connection lines, however its threads interleave them, are not output; anything else is."""

from helpers.multiprocess import Finished, printed_nothing

ONE = "[Gloo] Rank 1 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1\n"
# Two threads' lines, interleaved piece by piece, as gloo printed them in a CI run.
INTERLEAVED = (
    "[Gloo] Rank 1 is connected to 1 peer ranks. [Gloo] Rank 1 is connected to 1 peer ranks. "
    "Expected number of connected peer ranks is : 1\n"
    "Expected number of connected peer ranks is : 1\n"
    "[Gloo] Rank 3 is connected to 3 peer ranks. Expected number of connected peer ranks is : 3\n"
)


def test_gloo_connection_lines_are_not_output():
    assert printed_nothing(Finished(0, "", ""))
    assert printed_nothing(Finished(0, ONE, "I1204 jax log line\n"))
    assert printed_nothing(Finished(0, INTERLEAVED, ""))


def test_own_output_and_errors_are_seen():
    assert not printed_nothing(Finished(0, INTERLEAVED + '{"loss": 2.5}\n', ""))
    assert not printed_nothing(Finished(0, ONE.replace("peer ranks.", "peer ranks. hello"), ""))
    assert not printed_nothing(Finished(0, "", "RuntimeError: gloo timed out\n"))
