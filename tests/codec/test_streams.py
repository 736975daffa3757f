"""Checking code streams and counting zeros without decoding (codec/streams.py) against the
reference decoder."""

import ml_dtypes
import numpy as np
import pytest

from qmoe_jax.codec import decode_codes, encode
from qmoe_jax.codec.streams import count_zeros


@pytest.mark.parametrize("cols", [64, 37])
def test_zero_count_equals_decoding(dictionary, cols):
    rng = np.random.default_rng(cols)
    codes = rng.choice(np.array([0, 1, 2], np.uint8), size=(12, cols), p=[0.8, 0.1, 0.1])
    minmax = np.stack([-rng.uniform(0.1, 1, 12), rng.uniform(0.1, 1, 12)], 1)
    minmax[3, 0] = 0  # a row without negative weights: its code 1 stands for 0
    minmax[5] = 0  # an all-zero row
    minmax = minmax.astype(ml_dtypes.bfloat16)
    matrix = encode(codes, minmax, dictionary)
    decoded = decode_codes(matrix, dictionary)
    levels = np.concatenate([np.zeros((12, 1)), np.asarray(minmax, np.float32)], 1)
    values = np.take_along_axis(levels, decoded.astype(np.int64), 1)
    padded = np.concatenate(
        [np.asarray(matrix.codes), np.zeros(3, np.uint16)]
    )  # padding is ignored
    assert count_zeros(padded, np.asarray(matrix.row_offsets), minmax, cols, dictionary) == int(
        (values == 0).sum()
    )


def test_malformed_streams_name_the_row(dictionary):
    codes = np.zeros((3, 40), np.uint8)
    minmax = np.ones((3, 2), ml_dtypes.bfloat16)
    matrix = encode(codes, minmax, dictionary)
    stream, offsets = np.asarray(matrix.codes), np.asarray(matrix.row_offsets)
    with pytest.raises(ValueError, match="row 0 decodes to"):
        count_zeros(
            stream, np.array([0, 0, offsets[2], offsets[3]], np.int32), minmax, 40, dictionary
        )
    with pytest.raises(ValueError, match="end within the"):
        count_zeros(stream[:-1], offsets, minmax, 40, dictionary)
    with pytest.raises(ValueError, match="never decrease"):
        count_zeros(stream, offsets[::-1].copy(), minmax, 40, dictionary)
