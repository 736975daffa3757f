"""Joining a multi-process run: the flags, JAX's cluster detection, and the CLI's messages."""

import pytest

from qmoe_jax.cli import run_cli
from qmoe_jax.distributed import exchange, runtime
from qmoe_jax.distributed.runtime import Cluster, cluster_from, split_flags

SLURM_TASK = {
    "SLURM_JOB_ID": "4242",
    "SLURM_STEP_NODELIST": "node[001-002]",
    "SLURM_PROCID": "1",
    "SLURM_LOCALID": "0",
}


@pytest.fixture
def no_cluster(monkeypatch):
    for name in (*SLURM_TASK, "SLURM_NTASKS", "OMPI_MCA_orte_hnp_uri", "KUBERNETES_SERVICE_HOST"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_the_flags_are_taken_out_of_the_arguments_in_both_spellings():
    values, rest = split_flags(
        ["--output_dir", "out", "--coordinator_address=10.0.0.1:1234", "--num_processes", "2"]
        + ["--process_id=1", "--debug"]
    )
    assert values == {
        "coordinator_address": "10.0.0.1:1234",
        "num_processes": "2",
        "process_id": "1",
    }
    assert rest == ["--output_dir", "out", "--debug"]
    with pytest.raises(ValueError, match="--process_id needs a value"):
        split_flags(["--process_id", "--debug"])


def test_the_flags_describe_the_run_to_join(no_cluster):
    assert cluster_from({}) is None
    assert cluster_from(
        {"coordinator_address": "h:1", "num_processes": "4", "process_id": "3"}
    ) == Cluster("h:1", 4, 3)
    assert (
        cluster_from({"coordinator_address": "h:1", "num_processes": "1", "process_id": "0"})
        is None
    )
    assert (
        cluster_from(
            {
                "coordinator_address": "h:1",
                "num_processes": "2",
                "process_id": "0",
                "heartbeat_timeout_seconds": "7",
            }
        ).heartbeat_timeout_seconds
        == 7
    )


@pytest.mark.parametrize(
    "values, message",
    [
        ({"coordinator_address": "h:1"}, "--num_processes, --process_id missing"),
        ({"num_processes": "2", "process_id": "0"}, "--coordinator_address missing"),
        ({"coordinator_address": "h:1", "num_processes": "2", "process_id": "2"}, "not one of"),
        ({"coordinator_address": "h:1", "num_processes": "two", "process_id": "0"}, "integer"),
        ({"coordinator_address": "h:1", "num_processes": "0", "process_id": "0"}, "at least 1"),
    ],
)
def test_an_incomplete_or_wrong_run_is_refused(no_cluster, values, message):
    with pytest.raises(ValueError, match=message):
        cluster_from(values)


def test_a_detected_cluster_of_several_processes_is_joined(no_cluster):
    for name, value in SLURM_TASK.items():
        no_cluster.setenv(name, value)
    no_cluster.setenv("SLURM_NTASKS", "1")
    assert cluster_from({}) is None  # srun -n 1: one process, nothing to join
    no_cluster.setenv("SLURM_NTASKS", "2")
    assert cluster_from({}) == Cluster(detected="slurm")
    # JAX fills in what the flags leave out
    assert cluster_from({"coordinator_address": "h:1"}) == Cluster("h:1", detected="slurm")


def test_a_bad_flag_is_an_error_message_and_a_lone_process_has_no_label(no_cluster, capsys):
    ran = []
    run_cli(ran.append, ["--verbose"])
    assert ran == [["--verbose"]]
    with pytest.raises(SystemExit) as exit_info:
        run_cli(ran.append, ["--num_processes=two"])
    assert exit_info.value.code == 1
    assert capsys.readouterr().err.strip() == "error: --num_processes must be an integer, got 'two'"
    assert runtime.label() == "" and runtime.process_count() == 1 and runtime.is_lead()


def test_a_lone_process_exchanges_nothing():
    assert exchange.gathered(lambda: 3) == [3]
    assert exchange.checked(lambda: 4) == 4
    assert exchange.decided(lambda: 5) == 5
    assert exchange.allgather_objects({"a": 1}) == [{"a": 1}]
    with pytest.raises(KeyError):
        exchange.gathered(lambda: {}["missing"])
