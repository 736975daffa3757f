import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qmoe_jax.data.span_corruption import (
    EOS_ID,
    noise_span_to_unique_sentinel,
    random_segmentation,
    random_spans_helper,
    random_spans_noise_mask,
    span_corrupt,
)

FIRST_SENTINEL = 32099


def test_random_spans_helper_matches_t5():
    # T5's span_corruption with inputs_length 512 uses 568 raw tokens and 114 targets.
    assert random_spans_helper(512) == (568, 114)
    assert random_spans_helper(128) == (141, 29)


@given(length=st.integers(2, 2000), seed=st.integers(0, 2**32 - 1))
@settings(max_examples=200, deadline=None)
def test_noise_mask_statistics(length, seed):
    mask = random_spans_noise_mask(length, np.random.default_rng(seed))
    noise = int(np.round(np.float32(length) * np.float32(0.15)))
    noise = min(max(noise, 1), length - 1)
    spans = max(int(np.round(np.float32(noise) / np.float32(3.0))), 1)
    assert mask.shape == (length,)
    assert mask.sum() == noise  # exact noise density after rounding
    starts = mask & ~np.concatenate([[False], mask[:-1]])
    assert starts.sum() == spans  # exact span count
    assert not mask[0] and mask[-1]  # non-noise first, noise last


def test_short_lengths():
    assert random_spans_noise_mask(1, np.random.default_rng(0)).tolist() == [False]
    assert random_spans_noise_mask(2, np.random.default_rng(0)).tolist() == [False, True]


@given(items=st.integers(1, 500), data=st.data())
@settings(max_examples=100, deadline=None)
def test_random_segmentation(items, data):
    segments = data.draw(st.integers(1, items))
    lengths = random_segmentation(items, segments, np.random.default_rng(items))
    assert lengths.shape == (segments,) and lengths.sum() == items and (lengths >= 1).all()


def test_segmentation_is_uniform_over_compositions():
    # 4 items in 2 segments: compositions (1,3), (2,2), (3,1) equally likely.
    rng = np.random.default_rng(0)
    firsts = [random_segmentation(4, 2, rng)[0] for _ in range(6000)]
    counts = np.bincount(firsts, minlength=4)[1:]
    assert np.all(np.abs(counts / 6000 - 1 / 3) < 0.03)


def test_noise_span_to_unique_sentinel():
    tokens = np.arange(10, 20)
    mask = np.array([0, 0, 1, 1, 0, 0, 0, 1, 0, 1], bool)
    assert noise_span_to_unique_sentinel(tokens, mask, 99).tolist() == [
        10,
        11,
        99,
        14,
        15,
        16,
        98,
        18,
        97,
    ]


@given(length=st.integers(2, 600), seed=st.integers(0, 1000))
@settings(max_examples=100, deadline=None)
def test_span_corrupt_round_trip(length, seed):
    tokens = np.arange(100, 100 + length, dtype=np.int32)
    inputs, targets = span_corrupt(tokens, np.random.default_rng(seed), FIRST_SENTINEL)
    assert inputs[-1] == EOS_ID and targets[-1] == EOS_ID
    sentinel_in = inputs[inputs > 30000]
    sentinel_out = targets[targets > 30000]
    # Sentinels appear in order <extra_id_0>, <extra_id_1>, ... on both sides.
    assert sentinel_in.tolist() == list(
        range(FIRST_SENTINEL, FIRST_SENTINEL - sentinel_in.size, -1)
    )
    assert sentinel_in.tolist() == sentinel_out.tolist()
    # Filling each input sentinel with the target span that follows it restores the chunk.
    spans, current = {}, None
    for token in targets[:-1].tolist():
        if token > 30000:
            current = token
            spans[current] = []
        else:
            spans[current].append(token)
    restored = []
    for token in inputs[:-1].tolist():
        restored += spans[token] if token > 30000 else [token]
    assert restored == tokens.tolist()


def test_corruption_is_seeded():
    tokens = np.arange(200, dtype=np.int32) + 10
    a = span_corrupt(tokens, np.random.default_rng((0, 5)), FIRST_SENTINEL)
    b = span_corrupt(tokens, np.random.default_rng((0, 5)), FIRST_SENTINEL)
    c = span_corrupt(tokens, np.random.default_rng((0, 6)), FIRST_SENTINEL)
    assert all((x == y).all() for x, y in zip(a, b))
    assert not np.array_equal(a[0], c[0])


def test_span_corrupt_rejects_empty():
    with pytest.raises(ValueError, match="non-empty"):
        span_corrupt(np.zeros(0, np.int32), np.random.default_rng(0), FIRST_SENTINEL)


def test_single_token_chunk_is_not_corrupted():
    # As in T5, a 1-token chunk gets no noise: inputs keep it, targets are one sentinel.
    inputs, targets = span_corrupt(
        np.asarray([7], np.int32), np.random.default_rng(0), FIRST_SENTINEL
    )
    assert inputs.tolist() == [7, EOS_ID] and targets.tolist() == [FIRST_SENTINEL, EOS_ID]
