import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from qmoe_jax.quant.int8 import INT8_LEVELS, dequantize_int8, quantize_int8


def test_int8_rounds_each_weight_to_its_rows_nearest_level():
    rng = np.random.default_rng(0)
    weights = rng.standard_normal((24, 40)).astype(np.float32) * rng.uniform(0.01, 3, (24, 1))
    codes, scales = quantize_int8(weights)
    assert codes.dtype == jnp.int8 and scales.dtype == jnp.float32
    assert codes.shape == weights.shape and scales.shape == (24,)
    codes, scales = np.asarray(codes), np.asarray(scales)
    np.testing.assert_allclose(scales, np.abs(weights).max(axis=1) / INT8_LEVELS, rtol=1e-7)
    # Each row's largest weight maps to ±127, and no code is -128.
    np.testing.assert_array_equal(np.abs(codes).max(axis=1), INT8_LEVELS)
    assert codes.min() >= -INT8_LEVELS
    error = np.abs(np.asarray(dequantize_int8(codes, scales)) - weights)
    assert np.all(error <= scales[:, None] / 2 * (1 + 1e-6))
    np.testing.assert_array_equal(codes, np.round(weights / scales[:, None]).astype(np.int8))


def test_int8_is_symmetric_and_keeps_zero_rows():
    rng = np.random.default_rng(1)
    weights = rng.standard_normal((6, 16)).astype(np.float32)
    weights[2] = 0.0
    codes, scales = quantize_int8(weights)
    negated, negated_scales = quantize_int8(-weights)
    np.testing.assert_array_equal(np.asarray(negated), -np.asarray(codes))
    np.testing.assert_array_equal(np.asarray(negated_scales), np.asarray(scales))
    assert float(scales[2]) == 0.0 and not np.asarray(codes[2]).any()
    assert np.isfinite(np.asarray(dequantize_int8(codes, scales))).all()


def test_int8_takes_bfloat16_and_rejects_non_matrices():
    weights = np.linspace(-1, 1, 32, dtype=np.float32).reshape(4, 8)
    codes, scales = quantize_int8(weights.astype(ml_dtypes.bfloat16))
    reference = quantize_int8(weights.astype(ml_dtypes.bfloat16).astype(np.float32))
    np.testing.assert_array_equal(np.asarray(codes), np.asarray(reference[0]))
    np.testing.assert_array_equal(np.asarray(scales), np.asarray(reference[1]))
    with pytest.raises(ValueError, match=r"matrix \[rows, cols\]"):
        quantize_int8(np.ones((2, 3, 4), np.float32))
