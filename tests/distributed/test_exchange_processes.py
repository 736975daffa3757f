"""What the processes of a run tell each other, in 2 real processes (127.0.0.1, gloo, one child
each under a watchdog): objects of different sizes meet in process order, and an error in one
process is raised in both, as its own error there and as a PeerError naming it in the other."""

import pytest
from helpers.multiprocess import describe, run_processes

pytestmark = pytest.mark.slow

SCRIPT = """
import sys
from qmoe_jax.distributed import exchange, runtime
runtime.join_from_argv(sys.argv[1:])
import numpy as np

me = runtime.process_index()
gathered = exchange.allgather_objects({"me": me, "values": np.arange(100_000 * (me + 1.0))})
assert [g["me"] for g in gathered] == [0, 1]
assert [g["values"].size for g in gathered] == [100_000, 200_000]
assert (gathered[1]["values"] == np.arange(200_000.0)).all()
assert exchange.gathered(lambda: me * 10) == [0, 10]
assert exchange.decided(lambda: f"lead {me}") == "lead 0"
assert exchange.checked(lambda: me) == me
try:
    exchange.gathered(lambda: 1 / (me - 1))
except ZeroDivisionError as error:
    print("own", me, exchange.is_shared(error))
except exchange.PeerError as error:
    print("peer", me, error)
"""


def test_objects_meet_in_process_order_and_an_error_stops_both():
    results = run_processes(["-c", SCRIPT], processes=2, devices=2, timeout=300)
    assert [r.returncode for r in results] == [0, 0], describe(results)
    assert "peer 0 process 1/2 failed: ZeroDivisionError: " in results[0].stdout
    assert "own 1 True" in results[1].stdout
