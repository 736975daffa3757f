import ml_dtypes
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import qmoe_jax_ext
from qmoe_jax.codec import (
    CompressedExperts,
    Dictionary,
    decode_codes,
    encode,
    encode_experts,
    encode_reference,
)
from qmoe_jax.codec.dictionary import entry_weights


def ternary(rng, shape, p0):
    """I.i.d. ternary codes with P(0) = p0 and P(1) = P(2)."""
    u = rng.random(shape)
    return np.where(u < p0, 0, np.where(u < p0 + (1 - p0) / 2, 1, 2)).astype(np.uint8)


def minmax_for(shape):
    rng = np.random.default_rng(0)
    low = -rng.random(shape[:-1] + (1,))
    return np.concatenate([low, -low], axis=-1).astype(ml_dtypes.bfloat16)


def assert_same_matrix(a, b):
    np.testing.assert_array_equal(np.asarray(a.codes), np.asarray(b.codes))
    np.testing.assert_array_equal(np.asarray(a.row_offsets), np.asarray(b.row_offsets))
    assert np.asarray(a.codes).dtype == np.uint16 and np.asarray(a.row_offsets).dtype == np.int32
    assert a.cols == b.cols


shapes_and_p0 = dict(
    rows=st.integers(1, 6),
    cols=st.integers(1, 90),
    p0=st.sampled_from([0.0, 1.0, 0.5, 0.85, 0.885, 0.95]) | st.floats(0.0, 1.0),
    seed=st.integers(0, 2**32 - 1),
)


@settings(max_examples=150, deadline=None)
@given(**shapes_and_p0)
@example(rows=1, cols=1, p0=0.0, seed=0)
@example(rows=1, cols=1, p0=1.0, seed=0)
@example(rows=3, cols=57, p0=1.0, seed=0)
@example(rows=2, cols=56, p0=0.0, seed=1)
def test_matches_reference_and_round_trips(dictionary, rows, cols, p0, seed):
    codes = ternary(np.random.default_rng(seed), (rows, cols), p0)
    minmax = minmax_for((rows, 2))
    encoded = encode(codes, minmax, dictionary)
    assert_same_matrix(encoded, encode_reference(codes, minmax, dictionary))
    np.testing.assert_array_equal(decode_codes(encoded, dictionary), codes)
    np.testing.assert_array_equal(encoded.minmax, minmax)


def test_golden_stream(dictionary):
    # Rows: all zero (4 zero pairs with the pad, entry 3 since entries 0..11 are
    # zero runs); one min then zeros; all max (pairs (2,2)(2,2)(2,2)(2,pad 0):
    # (2,2)(2,2) is not an entry, so two single-pair codewords, then
    # (2,2)(2,0)); and (0,1)(2,0)(0,0)(0,0).
    codes = np.array([[0] * 7, [1, 0, 0, 0, 0, 0, 0], [2] * 7, [0, 1, 2, 0, 0, 0, 0]], np.uint8)
    encoded = encode(codes, minmax_for((4, 2)), dictionary)
    assert encoded.codes.tolist() == [3, 42, 329, 329, 6651, 599]
    assert encoded.row_offsets.tolist() == [0, 1, 2, 5, 6]
    weights, pair_count = entry_weights(dictionary.entries)
    expected = {
        3: [0] * 8,
        42: [1] + [0] * 7,
        329: [2, 2],
        6651: [2, 2, 2, 0],
        599: [0, 1, 2, 0, 0, 0, 0, 0],
    }
    for code, entry in expected.items():
        assert weights[code, : 2 * pair_count[code]].tolist() == entry


def test_zero_rows_or_cols(dictionary):
    for rows, cols in [(0, 5), (3, 0)]:
        codes = np.zeros((rows, cols), np.uint8)
        encoded = encode(codes, minmax_for((rows, 2)), dictionary)
        assert encoded.codes.shape == (0,) and encoded.row_offsets.tolist() == [0] * (rows + 1)
        assert decode_codes(encoded, dictionary).shape == (rows, cols)


def test_threads_agree(dictionary):
    # 2 × 2^18 weights or more, so the rows are split over threads.
    codes = ternary(np.random.default_rng(1), (517, 1031), 0.885)
    minmax = minmax_for((517, 2))
    single = encode(codes, minmax, dictionary, num_threads=1)
    for threads in (2, 3, 7):
        assert_same_matrix(encode(codes, minmax, dictionary, num_threads=threads), single)


@pytest.mark.parametrize("threads", [1, 3])
def test_experts_equal_stack_of_matrices(dictionary, threads):
    # Rows of 5 experts split over 3 threads: chunks cut experts in the middle.
    # Expert 2 is all zero, so the experts' streams differ in length.
    rng = np.random.default_rng(2)
    codes = ternary(rng, (5, 41, 1500), 0.87)
    codes[2] = 0
    minmax = minmax_for((5, 41, 2))
    stacked = encode_experts(codes, minmax, dictionary, num_threads=threads)
    one_by_one = CompressedExperts.stack(
        [encode(codes[e], minmax[e], dictionary) for e in range(5)]
    )
    np.testing.assert_array_equal(stacked.codes, np.asarray(one_by_one.codes))
    np.testing.assert_array_equal(stacked.row_offsets, np.asarray(one_by_one.row_offsets))
    np.testing.assert_array_equal(stacked.minmax, np.asarray(one_by_one.minmax))
    assert stacked.shape == (5, 41, 1500)
    np.testing.assert_array_equal(decode_codes(stacked, dictionary), codes)


def test_experts_of_zero_width_keep_one_code(dictionary):
    encoded = encode_experts(np.zeros((2, 3, 0), np.uint8), minmax_for((2, 3, 2)), dictionary)
    assert encoded.codes.shape == (2, 1)
    assert encoded.row_offsets.tolist() == [[0] * 4] * 2


def test_noncontiguous_input(dictionary):
    codes = ternary(np.random.default_rng(3), (40, 60), 0.8)
    minmax = minmax_for((30, 2))
    view = codes.T[:30, ::2]
    assert_same_matrix(encode(view, minmax, dictionary), encode_reference(view, minmax, dictionary))


def test_dictionary_that_is_not_prefix_closed(dictionary):
    """The walk stops at the first missing prefix, and the last of duplicate entries wins, as in
    the reference."""
    weights, pair_count = entry_weights(dictionary.entries)
    entries = dictionary.entries.copy()
    # Overwrite every 2-pair entry that starts with a zero pair by a copy of an
    # entry further on: its extensions become unreachable and the copied key
    # now has two indices.
    two_pairs = np.flatnonzero((pair_count == 2) & (weights[:, 0] == 0) & (weights[:, 1] == 0))
    entries[two_pairs] = entries[-len(two_pairs) :]
    # And drop the one-pair entry (2, 2): rows that must restart on it fail.
    single_22 = int(
        np.flatnonzero((pair_count == 1) & (weights[:, 0] == 2) & (weights[:, 1] == 2))[0]
    )
    entries[single_22] = entries[-1]
    holey = Dictionary.from_entries(entries, 0.885)
    # A codeword may start with (2, 2) when it grows into an entry ...
    starts_with_22 = np.array([[2, 2, 0, 0, 0, 1]], np.uint8)
    assert_same_matrix(
        encode(starts_with_22, minmax_for((1, 2)), holey),
        encode_reference(starts_with_22, minmax_for((1, 2)), holey),
    )
    # ... but not end as the lone pair (2, 2).
    with pytest.raises(ValueError, match=r"\(2, 2\) at row 1, column 2"):
        encode(np.array([[0] * 4, [0, 0, 2, 2]], np.uint8), minmax_for((2, 2)), holey)
    rng = np.random.default_rng(4)
    for _ in range(30):
        codes = ternary(rng, (3, int(rng.integers(1, 60))), float(rng.uniform(0.6, 1.0)))
        minmax = minmax_for((3, 2))
        try:
            expected = encode_reference(codes, minmax, holey)
        except KeyError:
            with pytest.raises(ValueError, match=r"no one-pair entry for the weights \(2, 2\)"):
                encode(codes, minmax, holey)
            continue
        assert_same_matrix(encode(codes, minmax, holey), expected)


def test_value_outside_ternary_names_its_place(dictionary):
    codes = np.zeros((4, 9), np.uint8)
    codes[2, 7] = 3
    with pytest.raises(ValueError, match="found 3 at row 2, column 7"):
        encode(codes, minmax_for((4, 2)), dictionary)
    stack = np.zeros((3, 4, 9), np.uint8)
    stack[1, 3, 0] = 255
    with pytest.raises(ValueError, match="found 255 at expert 1, row 3, column 0"):
        encode_experts(stack, minmax_for((3, 4, 2)), dictionary)


@pytest.mark.parametrize(
    "codes, minmax, error, message",
    [
        (np.zeros((2, 4), np.int32), np.zeros((2, 2), ml_dtypes.bfloat16), TypeError, "uint8"),
        (
            np.zeros(8, np.uint8),
            np.zeros((2, 2), ml_dtypes.bfloat16),
            ValueError,
            r"\[rows, cols\]",
        ),
        (np.zeros((2, 4), np.uint8), np.zeros((2, 2), np.float32), TypeError, "bfloat16"),
        (np.zeros((2, 4), np.uint8), np.zeros((3, 2), ml_dtypes.bfloat16), ValueError, r"\(2, 2\)"),
    ],
)
def test_bad_input(dictionary, codes, minmax, error, message):
    with pytest.raises(error, match=message):
        encode(codes, minmax, dictionary)


def test_bad_expert_input(dictionary):
    with pytest.raises(ValueError, match=r"\[E, rows, cols\]"):
        encode_experts(np.zeros((2, 4), np.uint8), np.zeros((2, 2), ml_dtypes.bfloat16), dictionary)
    with pytest.raises(ValueError, match="at least one expert"):
        encode_experts(
            np.zeros((0, 2, 4), np.uint8), np.zeros((0, 2, 2), ml_dtypes.bfloat16), dictionary
        )
    with pytest.raises(ValueError, match=r"\(2, 3, 2\)"):
        encode_experts(
            np.zeros((2, 3, 4), np.uint8), np.zeros((3, 2), ml_dtypes.bfloat16), dictionary
        )
    with pytest.raises(ValueError, match="num_threads"):
        encode(
            np.zeros((2, 4), np.uint8),
            np.zeros((2, 2), ml_dtypes.bfloat16),
            dictionary,
            num_threads=0,
        )


def test_native_table_rejects_corrupt_entries(dictionary):
    entries = dictionary.entries.copy()
    with pytest.raises(ValueError, match="uint32"):
        qmoe_jax_ext.EncoderTable(entries.astype(np.int64))
    with pytest.raises(ValueError, match="uint32"):
        qmoe_jax_ext.EncoderTable(entries[:100])
    entries[5, 0] |= np.uint32(3 << 4)  # Weight code 3 in a used slot.
    with pytest.raises(ValueError, match="entry 5 holds weight code 3"):
        qmoe_jax_ext.EncoderTable(entries)
    entries = dictionary.entries.copy()
    entries[9, 1] |= np.uint32(1 << 30)  # A weight past the pair count.
    with pytest.raises(ValueError, match="entry 9 has a non-zero weight past"):
        qmoe_jax_ext.EncoderTable(entries)
    entries = dictionary.entries.copy()
    entries[11, 1] = (entries[11, 1] & ~np.uint32(15)) | np.uint32(15)
    with pytest.raises(ValueError, match="entry 11 has pair counts"):
        qmoe_jax_ext.EncoderTable(entries)


def test_native_encode_rejects_bad_arrays(dictionary):
    table = qmoe_jax_ext.EncoderTable(dictionary.entries)
    with pytest.raises(TypeError, match="uint8"):
        table.encode(np.zeros((2, 2), np.float32))
    with pytest.raises(ValueError, match="dimensions"):
        table.encode(np.zeros((1, 2, 2, 2), np.uint8))


def random_entries(rng, max_pairs):
    """Canonical-layout entries with random pair counts and weights (duplicates, holes)."""
    pair_count = rng.integers(1, max_pairs + 1, size=65536).astype(np.uint32)
    weights = rng.integers(0, 3, size=(65536, 28)).astype(np.uint32)
    weights[np.arange(28)[None, :] >= 2 * pair_count[:, None]] = 0
    shifts = 4 + 2 * np.arange(14, dtype=np.uint32)
    words = [
        pair_count | (weights[:, 14 * w : 14 * w + 14] << shifts).sum(axis=1, dtype=np.uint32)
        for w in (0, 1)
    ]
    return np.stack(words, axis=1)


@pytest.mark.parametrize("max_pairs", [1, 3, 9])
def test_random_dictionaries_match_reference(max_pairs):
    rng = np.random.default_rng(max_pairs)
    random_dictionary = Dictionary.from_entries(random_entries(rng, max_pairs), 0.5)
    for _ in range(20):
        codes = ternary(rng, (2, int(rng.integers(1, 40))), float(rng.uniform(0.3, 0.9)))
        minmax = minmax_for((2, 2))
        try:
            expected = encode_reference(codes, minmax, random_dictionary)
        except KeyError:
            with pytest.raises(ValueError, match="no one-pair entry"):
                encode(codes, minmax, random_dictionary)
            continue
        assert_same_matrix(encode(codes, minmax, random_dictionary), expected)
