import jax.numpy as jnp
import numpy as np
import pytest
from helpers.quant_helpers import correlated_problem, gptq_jit

from qmoe_jax.quant import GPTQConfig, GridConfig, dequantize_codes, grid_params, rtn

GRIDS = [GridConfig(), GridConfig("minmax", 2), GridConfig("minmax", 4)]


@pytest.mark.parametrize("grid", GRIDS, ids=lambda g: f"{g.kind}{g.bits or ''}")
def test_rtn_rounds_every_weight_to_its_nearest_level(grid):
    weights, _ = correlated_problem(0, rows=16, cols=40)
    codes, params = rtn(weights, grid)
    assert codes.shape == weights.shape and codes.dtype == jnp.uint8
    np.testing.assert_array_equal(np.asarray(params), np.asarray(grid_params(weights, grid)))
    decoded = dequantize_codes(codes, params, grid)
    levels = dequantize_codes(
        jnp.broadcast_to(jnp.arange(grid.levels, dtype=jnp.uint8), (16, grid.levels)), params, grid
    )
    nearest = jnp.abs(weights[:, :, None] - levels[:, None, :]).min(-1)
    np.testing.assert_allclose(
        np.asarray(jnp.abs(weights - decoded)), np.asarray(nearest), atol=1e-6
    )


@pytest.mark.parametrize("grid", GRIDS, ids=lambda g: f"{g.kind}{g.bits or ''}")
def test_rtn_equals_gptq_with_identity_hessian(grid):
    weights, _ = correlated_problem(1)
    codes, params = rtn(weights, grid)
    result = gptq_jit(weights, jnp.eye(160), grid=grid)
    assert bool(result.ok)
    np.testing.assert_array_equal(np.asarray(result.codes), np.asarray(codes))
    np.testing.assert_array_equal(np.asarray(result.grid_params), np.asarray(params))


def test_rtn_equals_gptq_with_identity_hessian_under_act_order_and_small_blocks():
    weights, _ = correlated_problem(2)
    codes, _ = rtn(weights, GridConfig())
    result = gptq_jit(
        weights, jnp.eye(160), grid=GridConfig(), config=GPTQConfig(block_size=32, act_order=True)
    )
    np.testing.assert_array_equal(np.asarray(result.codes), np.asarray(codes))
