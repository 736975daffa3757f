"""The fixed-to-variable dictionary of QMoE (Algorithm 1 of the paper).

Lingo: a *weight* is a ternary code (0 = zero, 1 = row min, 2 = row max); a
*pair symbol* is ``s = a + 3*b`` for two consecutive weights (a, b) in memory
order; an *entry* is a sequence of 1..14 pair symbols; the dictionary holds the
2^16 most probable entries under an i.i.d. model with P(0) = p0 and
P(1) = P(2) = (1 - p0) / 2, found best-first with a max-heap. An entry's index
is its pop order, so index 0 is the most probable entry.

Ties between equally probable sequences break as in the QMoE authors'
generator: the heap orders by (-probability, pair list), where the probability
is the left-to-right float product of the pair probabilities. This is what
makes ``build_dictionary(0.885)`` equal to the dictionary of their published
checkpoints.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import heapq

import jax
import numpy as np

NUM_ENTRIES = 1 << 16
MAX_PAIRS = 14
DEFAULT_P0 = 0.885
PAIR_COUNT_SHIFT = 28


def _pair_probabilities(p0: float) -> list[float]:
    weight_probs = [p0, (1.0 - p0) / 2, (1.0 - p0) / 2]
    # Index s = a + 3*b with a the first weight; the product is taken in the
    # generator's order (second weight's factor first), which is exact anyway
    # for a product of two floats.
    return [weight_probs[s // 3] * weight_probs[s % 3] for s in range(9)]


def _best_first_sequences(p0: float) -> list[list[int]]:
    pair_probs = _pair_probabilities(p0)
    heap: list[tuple[float, list[int]]] = [(-1.0, [])]
    sequences: list[list[int]] = []
    while len(sequences) < NUM_ENTRIES:
        negative_prob, pairs = heapq.heappop(heap)
        if pairs:
            sequences.append(pairs)
        if len(pairs) < MAX_PAIRS:
            for symbol, prob in enumerate(pair_probs):
                heapq.heappush(heap, (negative_prob * prob, pairs + [symbol]))
    return sequences


def _weights_of(pairs: list[int]) -> list[int]:
    weights = []
    for symbol in pairs:
        weights += [symbol % 3, symbol // 3]
    return weights


def _pack_entries(sequences: list[list[int]]) -> np.ndarray:
    entries = np.zeros((NUM_ENTRIES, 2), np.uint32)
    for index, pairs in enumerate(sequences):
        weights = _weights_of(pairs)
        for word in range(2):
            value = len(pairs)
            for k, code in enumerate(weights[14 * word : 14 * word + 14]):
                value |= code << (4 + 2 * k)
            entries[index, word] = value
    return entries


def entry_weights(entries: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Unpacks canonical entries.

    Args:
      entries: uint32[n, 2] in the format v1 layout.

    Returns:
      (weights uint8[n, 28], pair_count int32[n]); weights past 2*pair_count are 0.
    """
    entries = np.asarray(entries, np.uint32)
    shifts = 4 + 2 * np.arange(14, dtype=np.uint32)
    words = [(entries[:, w, None] >> shifts) & 3 for w in range(2)]
    weights = np.concatenate(words, axis=1).astype(np.uint8)
    pair_count = (entries[:, 0] & 15).astype(np.int32)
    return weights, pair_count


def masks_from_entries(entries: np.ndarray) -> np.ndarray:
    """The kernels' form of the dictionary (see xla_ffi/qmoe_format.h).

    Returns uint32[n, 2]: word 0 = plus mask (weights equal to 2, i.e. row max)
    | pair_count << 28; word 1 = minus mask (weights equal to 1, i.e. row min).
    """
    weights, pair_count = entry_weights(entries)
    bits = np.uint32(1) << np.arange(28, dtype=np.uint32)
    plus = ((weights == 2) * bits).sum(axis=1, dtype=np.uint32)
    minus = ((weights == 1) * bits).sum(axis=1, dtype=np.uint32)
    word0 = plus | (pair_count.astype(np.uint32) << PAIR_COUNT_SHIFT)
    return np.stack([word0, minus], axis=1)


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True, eq=False)
class Dictionary:
    """A 2^16-entry ternary dictionary.

    Attributes:
      entries: uint32[65536, 2], the canonical layout of docs/format.md §4.
      masks: uint32[65536, 2], the same entries as plus/minus bit masks for the
        kernels (see ``masks_from_entries``).
      p0: the zero probability the dictionary was built for.
      fingerprint: hex SHA-256 of ``entries``; checkpoints record it.

    A Dictionary is static under ``jax.jit`` (hashed by fingerprint); the ops
    turn its arrays into constants of the compiled program.
    """

    entries: np.ndarray
    masks: np.ndarray
    p0: float
    fingerprint: str

    def __hash__(self) -> int:
        return hash(self.fingerprint)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Dictionary) and other.fingerprint == self.fingerprint

    @classmethod
    def from_entries(cls, entries: np.ndarray, p0: float) -> Dictionary:
        """Wraps canonical entries (e.g. read from a checkpoint) after validating them."""
        entries = np.ascontiguousarray(entries, dtype=np.uint32)
        if entries.shape != (NUM_ENTRIES, 2):
            raise ValueError(
                f"dictionary entries must have shape ({NUM_ENTRIES}, 2), got {entries.shape}"
            )
        weights, pair_count = entry_weights(entries)
        if (pair_count < 1).any() or (pair_count > MAX_PAIRS).any():
            bad = int(np.argmax((pair_count < 1) | (pair_count > MAX_PAIRS)))
            raise ValueError(
                f"dictionary entry {bad} has pair count {pair_count[bad]}, expected "
                f"1..{MAX_PAIRS}; "
                "the dictionary is corrupt"
            )
        if (entries[:, 1] & 15 != entries[:, 0] & 15).any():
            raise ValueError("dictionary entries disagree on the pair count in their two words")
        used = np.arange(2 * MAX_PAIRS)[None, :] < 2 * pair_count[:, None]
        bad_slots = np.where(used, weights > 2, weights != 0).any(axis=1)
        if bad_slots.any():
            raise ValueError(
                f"dictionary entry {int(np.argmax(bad_slots))} holds weight code 3 or a non-zero "
                "weight "
                "past its pair count; the dictionary is corrupt"
            )
        entries.setflags(write=False)
        masks = masks_from_entries(entries)
        masks.setflags(write=False)
        return cls(entries, masks, float(p0), fingerprint_of(entries))


def fingerprint_of(entries: np.ndarray) -> str:
    """Stable hex SHA-256 of canonical dictionary entries (little-endian uint32)."""
    data = np.ascontiguousarray(entries, dtype="<u4").tobytes()
    return hashlib.sha256(data).hexdigest()


@functools.lru_cache(maxsize=8)
def build_dictionary(p0: float = DEFAULT_P0) -> Dictionary:
    """Builds the QMoE dictionary for zero probability ``p0`` (Algorithm 1).

    Takes about a second; results are cached per p0.
    """
    if not 0.0 < p0 < 1.0:
        raise ValueError(f"p0 must lie strictly between 0 and 1, got {p0}")
    entries = _pack_entries(_best_first_sequences(float(p0)))
    return Dictionary.from_entries(entries, p0)
