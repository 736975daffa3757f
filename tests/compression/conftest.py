import subprocess

import pytest
from helpers.child_process import run_python
from helpers.compression_runs import manifest_checksums

REFERENCE_WATCHDOG_SECONDS = 1200


@pytest.fixture(scope="session")
def one_device_checksums(tmp_path_factory):
    """SHA-256 of every array of the bundled model compressed by the CLI in a one-device child:
    what multi-device (test_multidevice.py) and multi-process (test_multihost.py) runs must
    write."""
    output_dir = str(tmp_path_factory.mktemp("compressed") / "one_device")
    try:
        completed = run_python(
            ["-m", "qmoe_jax.compress", "--output_dir", output_dir],
            timeout=REFERENCE_WATCHDOG_SECONDS,
            JAX_PLATFORMS="cpu",
            XLA_FLAGS="--xla_force_host_platform_device_count=1",
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"the one-device compression still ran after {REFERENCE_WATCHDOG_SECONDS} s")
    assert completed.returncode == 0, completed.stdout[-2000:] + completed.stderr[-3000:]
    assert "1 device(s)" in completed.stdout, completed.stdout[-2000:]
    return manifest_checksums(output_dir)
