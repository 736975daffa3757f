"""Compression sharded over several host devices: it finishes, and its codes are the one-device
codes.

Each multi-device run is a child process (the device count is fixed when jax starts) under a
watchdog: batched LAPACK Cholesky kernels deadlock XLA's intra-op thread pool there (issue 18),
which is why GPTQ factors with its own Cholesky (quant/linalg.py), so a regression shows up as a
child that never returns. The pool has a thread per CPU, and the deadlock needs no more threads
than devices: the hang check pins its child to 2 CPUs so that it bites on any machine.
"""

import subprocess
import textwrap

import numpy as np
import pytest
from helpers.child_process import run_python
from helpers.compression_runs import manifest_checksums
from helpers.quant_helpers import bundled_size_groups

from qmoe_jax.quant import GridConfig, quantize_expert_group

WATCHDOG_SECONDS = 600


def run_on_devices(
    devices: int, args: list[str], watchdog: float = WATCHDOG_SECONDS
) -> subprocess.CompletedProcess:
    """`python *args` in a child with ``devices`` host devices; fails the test if it outlives the
    watchdog."""
    try:
        completed = run_python(
            args,
            timeout=watchdog,
            JAX_PLATFORMS="cpu",
            XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
        )
    except subprocess.TimeoutExpired:
        pytest.fail(
            f"{devices}-device child still running after {watchdog} s: sharded compression hangs"
        )
    assert completed.returncode == 0, completed.stdout[-2000:] + completed.stderr[-3000:]
    return completed


HANG_SCRIPT = textwrap.dedent("""
    import os
    if hasattr(os, "sched_setaffinity"):  # Linux; before jax starts: 2 intra-op threads
        os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:2])
    import jax
    import numpy as np
    from jax.sharding import Mesh, PartitionSpec
    from qmoe_jax.quant import hessian_factor

    spec = PartitionSpec("expert")
    mesh = Mesh(np.asarray(jax.devices()), ("expert",))
    # A matmul first: the program then continues on intra-op pool threads, where LAPACK's batch
    # tasks starved.
    def factor(x):
        return jax.vmap(hessian_factor)(x.mT @ x)

    factors = jax.jit(jax.shard_map(factor, mesh=mesh, in_specs=spec, out_specs=spec))
    inputs = jax.random.normal(jax.random.key(0), (8, 512, 256))
    for _ in range(20):  # with LAPACK, one call hung about every other time
        assert np.isfinite(np.asarray(factors(inputs))).all()
""")


def test_sharded_hessian_factors_on_four_devices_and_two_cpus_finish():
    run_on_devices(4, ["-c", HANG_SCRIPT], watchdog=180)


SHARDED_GROUPS_SCRIPT = textwrap.dedent("""
    import jax
    import numpy as np
    from helpers.quant_helpers import bundled_size_groups
    from qmoe_jax.quant import GridConfig, expert_mesh, quantize_expert_group

    out = {{}}
    for name, group in bundled_size_groups().items():
        for devices in {devices}:
            mesh = expert_mesh(jax.devices()[:devices])
            result = quantize_expert_group(*group, GridConfig(), mesh=mesh)
            for field, value in result._asdict().items():
                out[f"{{name}}/{{devices}}/{{field}}"] = np.asarray(value, np.float32)
    np.savez({path!r}, **out)
""")


@pytest.mark.slow
def test_bundled_size_layer_on_two_and_four_devices_gives_the_one_device_codes(tmp_path):
    path = str(tmp_path / "sharded.npz")
    run_on_devices(4, ["-c", SHARDED_GROUPS_SCRIPT.format(devices=(2, 4), path=path)])
    sharded = np.load(path)
    for name, group in bundled_size_groups().items():
        reference = quantize_expert_group(*group, GridConfig())
        np.testing.assert_array_equal(
            np.asarray(reference.fallback), [False, True, True] + [False] * 5, err_msg=name
        )
        for devices in (2, 4):
            for field in ("codes", "grid_params", "fallback"):
                np.testing.assert_array_equal(
                    sharded[f"{name}/{devices}/{field}"],
                    np.asarray(getattr(reference, field), np.float32),
                    err_msg=f"{name} on {devices} devices: {field}",
                )
            # The loss is a diagnostic: equal up to float rounding (XLA may fuse its sums into FMAs
            # per program).
            np.testing.assert_allclose(
                sharded[f"{name}/{devices}/loss"], np.asarray(reference.loss), rtol=1e-6
            )


def compressed_checksums(devices: int, output_dir: str) -> dict[str, str]:
    """SHA-256 of every array of the bundled model compressed by the CLI on ``devices`` host
    devices."""
    completed = run_on_devices(devices, ["-m", "qmoe_jax.compress", "--output_dir", output_dir])
    assert f"{devices} device(s)" in completed.stdout, completed.stdout[-2000:]
    return manifest_checksums(output_dir)


@pytest.mark.slow
@pytest.mark.parametrize("devices", [2, 4])
def test_cli_on_several_devices_writes_the_one_device_checkpoint(
    devices, one_device_checksums, tmp_path
):
    checksums = compressed_checksums(devices, str(tmp_path / f"{devices}_devices"))
    assert len(checksums) == len(one_device_checksums) > 8
    assert [
        path for path in one_device_checksums if checksums.get(path) != one_device_checksums[path]
    ] == []
