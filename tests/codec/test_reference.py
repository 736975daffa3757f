import jax
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qmoe_jax.codec import (
    CompressedMatrix,
    decode_codes,
    decode_codes_jnp,
    encode_experts,
    encode_reference,
)


def ternary(rng, shape, p0):
    u = rng.random(shape)
    return np.where(u < p0, 0, np.where(u < p0 + (1 - p0) / 2, 1, 2)).astype(np.uint8)


@settings(max_examples=25, deadline=None)
@given(
    rows=st.integers(1, 5),
    cols=st.integers(1, 70),
    p0=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**32 - 1),
)
def test_reference_round_trip(dictionary, rows, cols, p0, seed):
    codes = ternary(np.random.default_rng(seed), (rows, cols), p0)
    encoded = encode_reference(codes, np.zeros((rows, 2), ml_dtypes.bfloat16), dictionary)
    np.testing.assert_array_equal(decode_codes(encoded, dictionary), codes)


@pytest.mark.parametrize(
    "rows, cols, p0", [(1, 1, 0.5), (3, 57, 0.885), (4, 64, 0.0), (2, 301, 1.0)]
)
def test_jnp_decoder_matches_numpy(dictionary, rows, cols, p0):
    codes = ternary(np.random.default_rng(rows), (rows, cols), p0)
    encoded = encode_reference(codes, np.zeros((rows, 2), ml_dtypes.bfloat16), dictionary)
    decoded = jax.jit(decode_codes_jnp)(encoded, dictionary)
    assert decoded.dtype == np.uint8
    np.testing.assert_array_equal(np.asarray(decoded), codes)


def test_decode_stack(dictionary):
    codes = ternary(np.random.default_rng(0), (3, 7, 45), 0.85)
    codes[0] = 2  # The longest stream; the others are padded.
    encoded = encode_experts(codes, np.zeros((3, 7, 2), ml_dtypes.bfloat16), dictionary)
    np.testing.assert_array_equal(decode_codes(encoded, dictionary), codes)
    np.testing.assert_array_equal(np.asarray(jax.jit(decode_codes_jnp)(encoded, dictionary)), codes)


def test_jnp_decoder_drops_weights_outside_rows(dictionary):
    # Entry 11 is 12 zero pairs; a stream claiming it for a 4-weight row must not write past the
    # row.
    garbage = CompressedMatrix(
        np.array([53, 11, 11], np.uint16),
        np.array([0, 2, 3], np.int32),
        np.zeros((2, 2), ml_dtypes.bfloat16),
        4,
    )
    assert np.asarray(decode_codes_jnp(garbage, dictionary)).shape == (2, 4)


@pytest.mark.parametrize(
    "codes, row_offsets, message",
    [
        ([3, 3], [0, 1, 3], "end within"),
        ([3, 3], [1, 1, 2], "start at 0"),
        ([3, 3, 3], [0, 2, 1], "never decrease"),
        ([3, 3], [0, 2, 2], "row 0 decodes to 16 weights, expected 8"),
        ([3], [0, 1, 1], "row 1 decodes to 0 weights"),
        ([3], [0, 1], r"row_offsets has shape \(2,\), expected \(3,\)"),
    ],
)
def test_decode_rejects_corrupt_streams(dictionary, codes, row_offsets, message):
    matrix = CompressedMatrix(
        np.array(codes, np.uint16),
        np.array(row_offsets, np.int32),
        np.zeros((2, 2), ml_dtypes.bfloat16),
        8,
    )
    with pytest.raises(ValueError, match=message):
        decode_codes(matrix, dictionary)


def test_decode_rejects_wrong_code_dtype(dictionary):
    matrix = CompressedMatrix(
        np.array([3], np.int64), np.array([0, 1], np.int32), np.zeros((1, 2), ml_dtypes.bfloat16), 8
    )
    with pytest.raises(ValueError, match="uint16"):
        decode_codes(matrix, dictionary)
