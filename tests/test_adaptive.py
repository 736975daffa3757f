import math

import jax.numpy as jnp
import numpy as np
import pytest

from qmoe_jax.codec import (
    adaptive_dictionary,
    adaptive_p0,
    build_dictionary,
    dictionary_for,
    estimate_p0,
)


def test_estimate_p0_counts_zeros():
    codes = np.array([[0, 0, 1, 2], [0, 2, 0, 0]], np.uint8)
    assert estimate_p0(codes) == 5 / 8
    assert estimate_p0(jnp.asarray(codes)) == 5 / 8
    # A sequence of arrays is counted together, weighted by size.
    assert estimate_p0([codes, np.zeros((1, 8), np.uint8)]) == 13 / 16


@pytest.mark.parametrize(
    "codes, error, message",
    [
        (np.zeros((0, 4), np.uint8), ValueError, "zero codes"),
        ([], ValueError, "zero codes"),
        (np.array([0, 3], np.uint8), ValueError, "found 3"),
        (np.array([0, 1], np.int32), TypeError, "uint8"),
    ],
)
def test_estimate_p0_rejects_degenerate_input(codes, error, message):
    with pytest.raises(error, match=message):
        estimate_p0(codes)


def test_adaptive_p0_rounds_and_clamps():
    assert adaptive_p0(0.88649) == 0.886
    assert adaptive_p0(0.8865001) == 0.887
    assert adaptive_p0(1.0) == 0.99 and adaptive_p0(0.2) == 0.5
    for bad in (-0.1, 1.5, math.nan):
        with pytest.raises(ValueError, match="p0"):
            adaptive_p0(bad)


def test_adaptive_dictionary_is_built_for_the_rounded_p0():
    codes = np.zeros((100, 10), np.uint8)
    codes[:, :1] = 1  # p0 = 0.9 exactly.
    by_codes = adaptive_dictionary(codes)
    assert by_codes.p0 == 0.9
    assert by_codes is adaptive_dictionary(0.90004) is build_dictionary(0.9)
    assert dictionary_for("adaptive", codes) is by_codes


def test_static_mode_is_the_papers_dictionary():
    assert dictionary_for("static", None) is build_dictionary(0.885)
    with pytest.raises(ValueError, match="'static' or 'adaptive'"):
        dictionary_for("dynamic", 0.9)
