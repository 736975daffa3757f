import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from qmoe_jax.quant import GridConfig, dequantize_codes, grid_params, quantize

TERNARY = GridConfig()
MINMAX = [GridConfig("minmax", bits) for bits in (2, 3, 4, 8)]
GRIDS = [TERNARY, *MINMAX]

matrices = hnp.arrays(np.float32, (6, 10), elements=st.floats(-4, 4, width=32))


@functools.partial(jax.jit, static_argnums=1)
def roundtrip(weights, grid):
    params = grid_params(weights, grid)
    dequantized, codes = quantize(weights, params, grid)
    all_codes = jnp.broadcast_to(
        jnp.arange(grid.levels, dtype=jnp.uint8), (weights.shape[0], grid.levels)
    )
    levels = dequantize_codes(all_codes, params, grid)
    return params, dequantized, codes, dequantize_codes(codes, params, grid), levels


def test_config_rejects_bad_combinations():
    with pytest.raises(ValueError, match="bits"):
        GridConfig("ternary", bits=2)
    with pytest.raises(ValueError, match="bits in"):
        GridConfig("minmax", bits=1)
    with pytest.raises(ValueError, match="bits in"):
        GridConfig("minmax")
    with pytest.raises(ValueError, match="unknown grid kind"):
        GridConfig("binary")
    assert TERNARY.levels == 3 and GridConfig("minmax", 3).levels == 8


def test_grid_params_reject_non_matrices():
    with pytest.raises(ValueError, match="rows, cols"):
        grid_params(jnp.zeros(5), TERNARY)


def test_ternary_params_are_bf16_rounded_min_max_including_zero():
    weights = np.array(
        [[0.1234567, -0.7654321, 0.3], [1.0, 2.0, 3.0], [-1.0, -2.0, -0.5]], np.float32
    )
    params = grid_params(weights, TERNARY)
    assert params.dtype == jnp.bfloat16 and params.shape == (3, 2)
    expected = np.array([[-0.7654321, 0.3], [0.0, 3.0], [-2.0, 0.0]], np.float32).astype(
        ml_dtypes.bfloat16
    )
    np.testing.assert_array_equal(np.asarray(params), expected)


def test_ternary_rounds_to_nearest_level_ties_to_zero():
    params = jnp.array([[-2.0, 4.0]], jnp.bfloat16)
    values = jnp.array([[-3.0, -1.0, -0.99, 0.0, 1.99, 2.0, 2.01, 9.0]])
    dequantized, codes = quantize(values, params, TERNARY)
    np.testing.assert_array_equal(np.asarray(codes), [[1, 0, 0, 0, 0, 0, 2, 2]])
    np.testing.assert_array_equal(np.asarray(dequantized), [[-2, 0, 0, 0, 0, 0, 4, 4]])


def test_ternary_zero_levels_use_code_zero():
    params = jnp.array([[0.0, 1.0], [-1.0, 0.0]], jnp.bfloat16)
    _, codes = quantize(jnp.array([[-5.0, 5.0], [-5.0, 5.0]]), params, TERNARY)
    np.testing.assert_array_equal(np.asarray(codes), [[0, 2], [1, 0]])


@pytest.mark.parametrize("grid", GRIDS, ids=lambda g: f"{g.kind}{g.bits or ''}")
def test_all_zero_rows_quantize_to_exact_zero(grid):
    weights = jnp.zeros((3, 7))
    params = grid_params(weights, grid)
    dequantized, codes = quantize(weights, params, grid)
    assert np.all(np.isfinite(np.asarray(params, np.float32)))
    np.testing.assert_array_equal(np.asarray(dequantized), 0.0)
    np.testing.assert_array_equal(np.asarray(dequantize_codes(codes, params, grid)), 0.0)


@pytest.mark.parametrize("grid", MINMAX, ids=lambda g: f"minmax{g.bits}")
def test_minmax_codes_span_the_k_bit_range(grid):
    weights = jnp.linspace(-1.0, 3.0, 1000)[None, :]
    params = grid_params(weights, grid)
    assert params.dtype == jnp.float32
    dequantized, codes = quantize(weights, params, grid)
    assert codes.dtype == jnp.uint8
    assert int(codes.min()) == 0 and int(codes.max()) == grid.levels - 1
    scale = float(params[0, 0])
    np.testing.assert_allclose(scale, 4.0 / (grid.levels - 1), rtol=1e-6)
    assert float(jnp.abs(dequantized - weights).max()) <= scale * (1 + 1e-6)


@settings(max_examples=30, deadline=None)
@given(matrices)
@pytest.mark.slow
def test_quantize_lands_on_nearest_level_and_codes_decode_exactly(weights):
    for grid in GRIDS:
        _, dequantized, codes, decoded, levels = roundtrip(weights, grid)
        assert codes.dtype == jnp.uint8 and codes.shape == weights.shape
        assert int(codes.max()) < grid.levels
        np.testing.assert_array_equal(np.asarray(decoded), np.asarray(dequantized))
        distance = jnp.abs(weights[:, :, None] - levels[:, None, :]).min(-1)
        np.testing.assert_allclose(
            np.asarray(jnp.abs(weights - dequantized)), np.asarray(distance), rtol=1e-6, atol=1e-6
        )


@pytest.mark.parametrize("grid", GRIDS, ids=lambda g: f"{g.kind}{g.bits or ''}")
@pytest.mark.slow
def test_quantize_one_column_equals_the_matrix_column(grid):
    weights = np.random.default_rng(0).normal(size=(16, 5)).astype(np.float32)
    params = grid_params(weights, grid)
    whole_deq, whole_codes = quantize(weights, params, grid)
    column_deq, column_codes = quantize(weights[:, 3], params, grid)
    np.testing.assert_array_equal(np.asarray(column_codes), np.asarray(whole_codes[:, 3]))
    np.testing.assert_array_equal(np.asarray(column_deq), np.asarray(whole_deq[:, 3]))
