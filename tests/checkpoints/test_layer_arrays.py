import ml_dtypes
import numpy as np
import pytest
from helpers.compressed_data import experts

from qmoe_jax.checkpoints.layer_arrays import (
    check_kernel_arrays,
    compressed_stack,
    kbit_arrays,
    kernel_cols,
    ternary_arrays,
)


def test_ternary_arrays_round_trip_through_groups(dictionary):
    rng = np.random.default_rng(0)
    first, _ = experts(rng, dictionary, 3, 5, 40)
    second, _ = experts(rng, dictionary, 2, 5, 40)
    arrays = ternary_arrays([first, second])
    check_kernel_arrays(arrays, ternary=True, where="layer/wi")
    assert arrays["codes"].shape[0] == 5 and arrays["row_offsets"].shape == (5, 6)
    back = compressed_stack(arrays, 40, slice(3, 5))
    length = second.codes.shape[1]
    np.testing.assert_array_equal(back.codes[:, :length], second.codes)
    assert (back.codes[:, length:] == 0).all()  # padding to the longer group's streams
    np.testing.assert_array_equal(back.row_offsets, second.row_offsets)
    assert back.cols == 40


def test_kbit_arrays_and_their_check():
    codes = [np.zeros((2, 3, 4), np.uint8), np.ones((1, 3, 4), np.uint8)]
    params = [np.zeros((2, 3, 2), np.float32), np.ones((1, 3, 2), np.float32)]
    arrays = kbit_arrays(codes, params)
    assert arrays["codes"].shape == (3, 3, 4)
    check_kernel_arrays(arrays, ternary=False, where="layer/wo")
    with pytest.raises(
        ValueError, match=r"layer/wo holds arrays \['codes', 'grid_params'\], expected"
    ):
        check_kernel_arrays(arrays, ternary=True, where="layer/wo")
    with pytest.raises(ValueError, match="layer/wo/grid_params is bfloat16, expected float32"):
        check_kernel_arrays(
            arrays | {"grid_params": arrays["grid_params"].astype(ml_dtypes.bfloat16)},
            ternary=False,
            where="layer/wo",
        )


def test_kernel_cols():
    assert kernel_cols("wo", 8, 32) == 32 and kernel_cols("wi_1", 8, 32) == 8
