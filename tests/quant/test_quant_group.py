import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.child_process import run_python
from helpers.quant_helpers import expert_group, gptq_jit

from qmoe_jax.quant import GPTQConfig, GridConfig, gptq_experts, quantize_expert_group, rtn
from qmoe_jax.quant.group import default_sequential

TERNARY = GridConfig()


@pytest.mark.parametrize("sequential", [True, False], ids=["sequential", "vmapped"])
def test_group_equals_a_loop_over_experts_and_flags_fallbacks(sequential):
    weights, hessians, tokens = expert_group(6)
    result = quantize_expert_group(weights, hessians, tokens, TERNARY, sequential=sequential)
    np.testing.assert_array_equal(
        np.asarray(result.fallback), [False, True, True, True, False, False]
    )
    assert result.codes.shape == (6, 32, 160) and result.codes.dtype == jnp.uint8
    assert result.grid_params.shape == (6, 32, 2) and result.grid_params.dtype == jnp.bfloat16
    for e in (0, 4, 5):
        single = gptq_jit(weights[e], hessians[e], grid=TERNARY)
        np.testing.assert_array_equal(np.asarray(result.codes[e]), np.asarray(single.codes))
        np.testing.assert_array_equal(
            np.asarray(result.grid_params[e]), np.asarray(single.grid_params)
        )
        np.testing.assert_allclose(float(result.loss[e]), float(single.loss), rtol=1e-5)
    for e in (1, 2, 3):
        codes, params = rtn(weights[e], TERNARY)
        np.testing.assert_array_equal(np.asarray(result.codes[e]), np.asarray(codes))
        np.testing.assert_array_equal(np.asarray(result.grid_params[e]), np.asarray(params))


def test_shape_errors_and_bad_meshes_are_explained():
    weights, hessians, tokens = expert_group(4)
    with pytest.raises(ValueError, match=r"hessians \[E, cols, cols\]"):
        quantize_expert_group(weights, hessians[:, :10], tokens, TERNARY)
    with pytest.raises(ValueError, match="tokens_per_expert"):
        quantize_expert_group(weights, hessians, tokens[:3], TERNARY)
    bad_mesh = jax.sharding.Mesh(np.asarray(jax.local_devices()[:1]), ("data",))
    with pytest.raises(ValueError, match="expert_mesh"):
        quantize_expert_group(weights, hessians, tokens, TERNARY, mesh=bad_mesh)


SHARDED_SCRIPT = textwrap.dedent("""
    import jax
    import numpy as np
    from helpers.quant_helpers import expert_group
    from qmoe_jax.quant import GridConfig, expert_mesh, quantize_expert_group

    assert jax.local_device_count() == 4, jax.local_device_count()
    out = {{}}
    for num_experts in (6, 8):
        weights, hessians, tokens = expert_group(num_experts)
        result = quantize_expert_group(weights, hessians, tokens, GridConfig())
        if num_experts == 8:
            assert len(result.codes.sharding.device_set) == 4, result.codes.sharding
        for name, value in result._asdict().items():
            dtype = np.float32 if name == "grid_params" else None
            out[f"{{name}}_{{num_experts}}"] = np.asarray(value, dtype)
    one_mesh = expert_mesh(jax.devices()[:1])
    one_device = quantize_expert_group(*expert_group(6), GridConfig(), mesh=one_mesh)
    out["codes_6_mesh1"] = np.asarray(one_device.codes)
    vmapped = quantize_expert_group(*expert_group(8), GridConfig(), sequential=False)
    out["codes_8_vmapped"] = np.asarray(vmapped.codes)
    np.savez({path!r}, **out)
""")


@pytest.mark.slow
def test_sharded_over_four_devices_is_bit_identical_to_one_device(tmp_path):
    path = str(tmp_path / "sharded.npz")
    completed = run_python(
        ["-c", SHARDED_SCRIPT.format(path=path)],
        timeout=600,
        JAX_PLATFORMS="cpu",
        XLA_FLAGS="--xla_force_host_platform_device_count=4",
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    sharded = np.load(path)
    for num_experts in (6, 8):
        reference = quantize_expert_group(*expert_group(num_experts), TERNARY)
        for name, value in reference._asdict().items():
            expected = np.asarray(value, np.float32 if name == "grid_params" else None)
            np.testing.assert_array_equal(sharded[f"{name}_{num_experts}"], expected, err_msg=name)
    np.testing.assert_array_equal(sharded["codes_6_mesh1"], sharded["codes_6"])
    np.testing.assert_array_equal(sharded["codes_8_vmapped"], sharded["codes_8"])


def test_cpus_run_a_groups_experts_one_after_another():
    class Device:
        def __init__(self, platform):
            self.platform = platform

    assert default_sequential(jax.local_devices()) == (jax.default_backend() == "cpu")
    assert default_sequential([Device("cpu")] * 2) and not default_sequential([Device("gpu")])
    # the sequential program loops over the experts; the vmapped one has no loop at the expert level
    weights, hessians, tokens = expert_group(4)
    lowered = {
        sequential: jax.jit(
            lambda w, h, t, sequential=sequential: gptq_experts(
                w, h, t, TERNARY, GPTQConfig(block_size=32), sequential=sequential
            )
        )
        .lower(weights, hessians, tokens)
        .as_text()
        for sequential in (True, False)
    }
    assert "stablehlo.while" in lowered[True]
    assert lowered[True].count("stablehlo.while") > lowered[False].count("stablehlo.while")
