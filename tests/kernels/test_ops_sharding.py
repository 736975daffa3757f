"""Expert-parallel ops on 4 host CPU devices (in a subprocess: the device count
is fixed when jax starts)."""

import json
import textwrap

import pytest
from helpers.child_process import run_python

SCRIPT = textwrap.dedent(
    """
    import json
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from helpers import compressed_data
    from qmoe_jax.kernels import ops
    from qmoe_jax.codec import build_dictionary

    dictionary = build_dictionary(0.885)
    rng = np.random.default_rng(0)
    stack, dense = compressed_data.experts(rng, dictionary, 8, 13, 21)
    x = jnp.asarray(rng.standard_normal((8, 5, 21)), jnp.float32)
    mesh = Mesh(np.array(jax.devices()), ("expert",))
    sharding = NamedSharding(mesh, P("expert"))
    stack, x = jax.device_put((stack, x), sharding)
    matmul = jax.jit(ops.expert_parallel(ops.matmul, mesh), static_argnums=2)
    y = matmul(stack, x, dictionary)
    grad = jax.jit(jax.grad(lambda x: matmul(stack, x, dictionary).sum()))(x)
    hlo = matmul.lower(stack, x, dictionary).compile().as_text()
    counts = jax.device_put(jnp.asarray([0, 1, 5, 2, 0, 0, 3, 9], jnp.int32), sharding)
    in_use = (np.arange(5) < np.asarray(counts)[:, None])[..., None]
    counted = matmul(stack, x, dictionary, counts)
    counted_grad = jax.jit(jax.grad(lambda x: matmul(stack, x, dictionary, counts).sum()))(x)
    product = np.einsum("ecj,erj->ecr", np.asarray(x), dense)
    print(json.dumps(dict(
        devices=len(jax.devices()),
        error=float(np.abs(np.asarray(y) - product).max()),
        grad_error=float(np.abs(np.asarray(grad) - dense.sum(1)[:, None, :]).max()),
        counts_error=float(np.abs(np.asarray(counted) - np.where(in_use, product, 0)).max()),
        counts_grad_error=float(
            np.abs(np.asarray(counted_grad) - np.where(in_use, dense.sum(1)[:, None, :], 0)).max()
        ),
        output_sharded=y.sharding.spec == P("expert"),
        collectives=[op for op in ("all-gather", "all-reduce", "all-to-all") if op in hlo],
        local_shape=list(y.addressable_shards[0].data.shape),
    )))
    """
)


@pytest.mark.slow
def test_expert_parallel_on_four_devices():
    run = run_python(
        ["-c", SCRIPT], timeout=600, XLA_FLAGS="--xla_force_host_platform_device_count=4"
    )
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["devices"] == 4
    assert result["error"] < 1e-5 and result["grad_error"] < 1e-5
    assert result["counts_error"] < 1e-5 and result["counts_grad_error"] < 1e-5
    assert result["output_sharded"]
    assert result["collectives"] == []
    assert result["local_shape"] == [2, 5, 13]
