import math

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from qmoe_jax.codec import (
    adaptive_dictionary,
    adaptive_p0,
    build_dictionary,
    count_codewords,
    dictionary_for,
    encode_experts,
    estimate_p0,
    tuned_dictionary,
)
from qmoe_jax.codec.adaptive import TUNE_OFFSETS


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


@pytest.mark.slow
def test_adaptive_dictionary_is_built_for_the_rounded_p0():
    codes = np.zeros((100, 10), np.uint8)
    codes[:, :1] = 1  # p0 = 0.9 exactly.
    by_codes = adaptive_dictionary(codes)
    assert by_codes.p0 == 0.9
    assert by_codes is adaptive_dictionary(0.90004) is build_dictionary(0.9)
    assert dictionary_for("adaptive", codes) is by_codes


@pytest.mark.slow
def test_static_mode_is_the_papers_dictionary():
    assert dictionary_for("static", None) is build_dictionary(0.885)
    with pytest.raises(ValueError, match="'static', 'adaptive' or 'tuned'"):
        dictionary_for("dynamic", 0.9)


def ternary(rng, shape, p0):
    u = rng.random(shape)
    return np.where(u < p0, 0, np.where(u < p0 + (1 - p0) / 2, 1, 2)).astype(np.uint8)


def test_tuned_dictionary_is_the_best_candidate():
    codes = ternary(np.random.default_rng(0), (64, 2048), 0.9)
    tuned = tuned_dictionary([codes[:10], codes[10:]], candidates=[0.9, 0.90002])
    counts = {p0: count_codewords(codes, build_dictionary(p0)) for p0 in (0.885, 0.9)}
    assert counts[0.885] != counts[0.9]
    assert tuned.p0 == min(counts, key=counts.get)


@pytest.mark.slow
def test_tuned_mode_searches_around_the_measured_p0():
    codes = ternary(np.random.default_rng(2), (64, 2048), 0.9)
    tuned = dictionary_for("tuned", [codes[:32], codes[32:]])
    measured = estimate_p0(codes)
    grid = {0.885, *(adaptive_p0(measured + offset) for offset in TUNE_OFFSETS)}
    assert tuned.p0 in grid
    assert count_codewords(codes, tuned) <= count_codewords(codes, build_dictionary(0.885))


def test_tuned_mode_needs_codes():
    with pytest.raises(ValueError, match="sample of codes"):
        dictionary_for("tuned", 0.9)


def test_count_codewords_matches_encode():
    codes = ternary(np.random.default_rng(1), (3, 7, 100), 0.8)
    dictionary = build_dictionary(0.885)
    encoded = encode_experts(codes, np.zeros((3, 7, 2), ml_dtypes.bfloat16), dictionary)
    assert count_codewords(codes, dictionary) == int(encoded.row_offsets[:, -1].sum())
    assert count_codewords(codes[1], dictionary) == int(encoded.row_offsets[1, -1])
