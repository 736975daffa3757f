"""The main job as one run of several processes (JAX's multi-process runtime on 127.0.0.1, 2
processes × 2 host devices, gloo collectives): the one-process output, bit for bit; a killed
process stops the run and the same command resumes it; the output-directory rules hold for every
process. Each process is a child under a watchdog (helpers.multiprocess)."""

import dataclasses
import json
import os
import time

import pytest
from helpers.compression_runs import (
    all_arrays,
    assert_same_arrays,
    cli_flags,
    manifest_checksums,
    options,
)
from helpers.multiprocess import ProcessGroup, describe, printed_nothing, run_processes
from helpers.switch_fixtures import TINY

from qmoe_jax.checkpoints.output_dir import locked
from qmoe_jax.compression.job import compress_checkpoint

pytestmark = pytest.mark.slow
WATCHDOG_SECONDS = 1200
HEARTBEAT = ["--heartbeat_timeout_seconds", "5"]  # a killed process stops the other within seconds


def compress(flags: list[str], processes: int = 2):
    return run_processes(["-m", "qmoe_jax.compress", *flags], processes, timeout=WATCHDOG_SECONDS)


@pytest.fixture(scope="module")
def config_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("config") / "tiny.json"
    path.write_text(json.dumps(dataclasses.asdict(TINY)))
    return str(path)


@pytest.fixture(scope="module")
def tiny_reference(tiny_setup, tmp_path_factory):
    """The tiny model compressed by one process: (directory, report)."""
    directory = tmp_path_factory.mktemp("reference") / "one_process"
    report = compress_checkpoint(
        options(tiny_setup, directory), log=lambda _: None, progress=False, config=TINY
    )
    return str(directory), report


def test_two_processes_write_the_one_process_checkpoint_of_the_bundled_model(
    one_device_checksums, tmp_path
):
    output_dir = str(tmp_path / "two_processes")
    results = compress(["--output_dir", output_dir])
    assert [r.returncode for r in results] == [0, 0], describe(results)
    lead, other = results
    assert "4 device(s) in 2 processes" in lead.stdout, describe(results)
    assert "validation loss" in lead.stdout and "compressed checkpoint: " in lead.stdout
    assert printed_nothing(other), describe(results)
    checksums = manifest_checksums(output_dir)
    assert len(checksums) == len(one_device_checksums) > 8
    assert [p for p in one_device_checksums if checksums.get(p) != one_device_checksums[p]] == []


def layers_finished(output_dir: str) -> int:
    try:
        with open(os.path.join(output_dir, "manifest.json")) as f:
            return len(json.load(f)["layers"])
    except (OSError, ValueError):
        return 0


@pytest.mark.parametrize("killed, resumed_by", [(0, 2), (1, 1)])
def test_a_killed_process_stops_the_run_and_the_same_command_resumes_it(
    killed, resumed_by, tiny_setup, config_file, tiny_reference, tmp_path
):
    """Either process is killed once a layer is written; the other stops by itself, and the same
    command resumes, in 2 processes or in one: the one-process output, its report in pass
    order."""
    output_dir = str(tmp_path / "resumed")
    flags = cli_flags(tiny_setup, output_dir, config_file) + HEARTBEAT
    with ProcessGroup(["-m", "qmoe_jax.compress", *flags]) as group:
        deadline = time.monotonic() + WATCHDOG_SECONDS
        while layers_finished(output_dir) < 1:
            assert time.monotonic() < deadline, group.output(0)[-3000:]
            assert all(child.poll() is None for child in group.children), group.output(0)[-3000:]
            time.sleep(0.05)
        group.kill(killed)
        results = group.wait(WATCHDOG_SECONDS)  # the survivor stops by itself
    survivor = results[1 - killed]
    assert survivor.returncode != 0, describe(results)
    assert 1 <= layers_finished(output_dir) < 2

    results = compress(flags, processes=resumed_by)
    assert [r.returncode for r in results] == [0] * resumed_by, describe(results)
    assert "resuming: 1 of 2 sparse layer(s) already finished" in results[0].stdout
    assert all(printed_nothing(r) for r in results[1:]), describe(results)
    reference_dir, reference = tiny_reference
    assert_same_arrays(all_arrays(reference_dir), all_arrays(output_dir))
    with open(os.path.join(output_dir, "report.json")) as f:
        report = json.load(f)
    assert [layer["name"] for layer in report["layers"]] == [
        layer["name"] for layer in reference["layers"]
    ]
    for ours, theirs in zip(report["layers"], reference["layers"], strict=True):
        assert {k: v for k, v in ours.items() if k != "seconds"} == {
            k: v for k, v in theirs.items() if k != "seconds"
        }


def test_every_process_refuses_what_the_lead_refuses(tiny_setup, config_file, tmp_path):
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("not a checkpoint")
    busy = tmp_path / "busy"
    busy.mkdir()
    for output_dir, problem in ((foreign, "is not empty"), (busy, "is being written by")):
        with locked(str(busy)):  # another run holds the busy directory
            results = compress(cli_flags(tiny_setup, str(output_dir), config_file))
        assert [r.returncode for r in results] == [1, 1], describe(results)
        lead_error = results[0].stderr.strip().splitlines()[-1]
        assert lead_error.startswith(f"process 0/2: error: {output_dir}"), describe(results)
        assert problem in lead_error
        other_error = results[1].stderr.strip().splitlines()[-1]
        assert other_error.startswith("process 1/2: stopped: process 0/2 failed: "), other_error
        assert problem in other_error
        assert results[0].stdout.count("error") == results[1].stdout.count("error") == 0
    assert sorted(os.listdir(foreign)) == ["notes.txt"]
    assert sorted(os.listdir(busy)) == [".qmoe_jax.lock"]
