import numpy as np
import pytest

from qmoe_jax.codec import build_dictionary
from qmoe_jax.codec.dictionary import Dictionary, entry_weights, masks_from_entries

# SHA-256 of the entries produced by the QMoE authors' generator (sub1.py,
# setup()) at ZEROS = .885, computed independently of this package.
AUTHORS_FINGERPRINT_0885 = "c09862c453fe122634070a475357ff81a679aff65829d84a56f806c02a54ed45"
# docs/format.md §3: entry-length histogram by pair count 1..14 at p0 = 0.885.
HISTOGRAM_0885 = [9, 65, 233, 577, 1161, 2049, 3305, 4993, 7177, 9921, 13289, 17345, 3843, 1569]


def test_matches_authors_generator():
    d = build_dictionary(0.885)
    assert d.fingerprint == AUTHORS_FINGERPRINT_0885
    assert d.entries.shape == (65536, 2) and d.entries.dtype == np.uint32


def test_length_histogram():
    _, pair_count = entry_weights(build_dictionary(0.885).entries)
    assert np.bincount(pair_count, minlength=15)[1:].tolist() == HISTOGRAM_0885


def test_entries_in_descending_probability():
    p0 = 0.885
    weights, pair_count = entry_weights(build_dictionary(p0).entries)
    used = np.arange(28)[None, :] < 2 * pair_count[:, None]
    log_p = np.where(weights == 0, np.log(p0), np.log((1 - p0) / 2))
    log_prob = np.where(used, log_p, 0.0).sum(axis=1)
    assert (np.diff(log_prob) <= 1e-9).all()
    # Index 0 is one zero pair; the most probable non-zero pair comes after the zero runs.
    assert pair_count[0] == 1 and weights[0, :2].tolist() == [0, 0]
    assert (weights[:12] == 0).all() and pair_count[:12].tolist() == list(range(1, 13))


def test_prefix_closed():
    weights, pair_count = entry_weights(build_dictionary(0.885).entries)
    keys = {tuple(w[: 2 * n]) for w, n in zip(weights.tolist(), pair_count.tolist())}
    for key in list(keys)[:5000]:
        for cut in range(2, len(key), 2):
            assert key[:cut] in keys


def test_layout_bits():
    d = build_dictionary(0.885)
    # Pair count sits in bits [3:0] of both words; unused weight slots are zero.
    assert ((d.entries[:, 0] & 15) == (d.entries[:, 1] & 15)).all()
    weights, pair_count = entry_weights(d.entries)
    used = np.arange(28)[None, :] < 2 * pair_count[:, None]
    assert (weights[~used] == 0).all()
    assert (weights <= 2).all()


def test_masks_agree_with_entries():
    d = build_dictionary(0.885)
    weights, pair_count = entry_weights(d.entries)
    masks = masks_from_entries(d.entries)
    bits = (masks[:, :1] >> np.arange(28, dtype=np.uint32)) & 1
    minus_bits = (masks[:, 1:] >> np.arange(28, dtype=np.uint32)) & 1
    assert ((bits == 1) == (weights == 2)).all()
    assert ((minus_bits == 1) == (weights == 1)).all()
    assert ((masks[:, 0] >> 28) == pair_count).all()


def test_other_p0_differs_and_is_cached():
    a = build_dictionary(0.90)
    assert a is build_dictionary(0.90)
    assert a.fingerprint != build_dictionary(0.885).fingerprint


@pytest.mark.parametrize("p0", [0.0, 1.0, -0.5])
def test_bad_p0(p0):
    with pytest.raises(ValueError, match="p0"):
        build_dictionary(p0)


def test_corrupt_entries_rejected():
    entries = build_dictionary(0.885).entries.copy()
    entries[7, 0] &= ~np.uint32(15)
    with pytest.raises(ValueError, match="entry 7"):
        Dictionary.from_entries(entries, 0.885)
    with pytest.raises(ValueError, match="shape"):
        Dictionary.from_entries(entries[:10], 0.885)


def test_non_ternary_or_stray_weights_rejected():
    entries = build_dictionary(0.885).entries.copy()
    entries[5, 0] |= np.uint32(3 << 4)  # Weight code 3 in a used slot.
    with pytest.raises(ValueError, match="entry 5 holds weight code 3"):
        Dictionary.from_entries(entries, 0.885)
    entries = build_dictionary(0.885).entries.copy()
    entries[9, 1] |= np.uint32(1 << 30)  # A weight past the pair count.
    with pytest.raises(ValueError, match="entry 9 holds"):
        Dictionary.from_entries(entries, 0.885)
