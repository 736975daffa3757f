"""Adaptive dictionaries: one QMoE dictionary per model, chosen for its quantized weights.

The paper builds a single dictionary for P(0) = 0.885. Its entries are the 2^16
most probable sequences under the i.i.d. ternary model, so a model whose
quantized experts are sparser or denser codes better with a dictionary built
for its own P(0) ("adaptive"). Most probable is not quite best for greedy
parsing, though: on i.i.d. codes, dictionaries built for a p0 a few hundredths
below the measured one give fewer codewords (benchmarks/codec_rate.py compares
them; docs/measurements.md), so "tuned" builds
candidates around the measured p0 and keeps the one that encodes a sample
into the fewest codewords (the paper's dictionary is always a candidate).

Lingo: p0 = fraction of zero codes (0 = zero, 1 = row min, 2 = row max). A
dictionary's p0 is rounded to ``P0_DECIMALS`` decimals, so it is reproducible
from the number stored with the checkpoint and shared by models that differ
only in noise, and clamped to ``P0_RANGE``.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import Literal

import numpy as np

from qmoe_jax.codec.dictionary import DEFAULT_P0, Dictionary, build_dictionary
from qmoe_jax.codec.encoder import count_codewords

P0_DECIMALS = 3
# Below 0.5 the codes are not the sparse ternary QMoE targets; above 0.99 the
# 14-pair cap of an entry (at most 28 weights per 16-bit codeword) bounds the
# rate, whatever the dictionary.
P0_RANGE = (0.5, 0.99)
# "tuned" tries the measured p0 plus these offsets (and the paper's 0.885).
TUNE_OFFSETS = tuple(round(0.01 * k, 2) for k in range(-8, 3))

DictionaryMode = Literal["static", "adaptive", "tuned"]


def _code_arrays(codes: np.ndarray | Sequence[np.ndarray]) -> list[np.ndarray]:
    arrays = [codes] if hasattr(codes, "dtype") else list(codes)
    arrays = [np.asarray(array) for array in arrays]
    for array in arrays:
        if array.dtype != np.uint8:
            raise TypeError(f"codes must be uint8 ternary codes, got dtype {array.dtype}")
    return arrays


def estimate_p0(codes: np.ndarray | Sequence[np.ndarray]) -> float:
    """The fraction of zero codes.

    Args:
      codes: uint8 ternary codes of any shape (e.g. [rows, cols] or
        [E, rows, cols]), or a sequence of such arrays, counted together (e.g.
        every expert stack of a model).

    Raises:
      TypeError: codes that are not uint8.
      ValueError: no codes at all, or a value outside {0, 1, 2}.
    """
    zeros = 0
    total = 0
    for array in _code_arrays(codes):
        if array.size and array.max() > 2:
            raise ValueError(f"codes must be 0, 1 or 2; found {int(array.max())}")
        zeros += int(np.count_nonzero(array == 0))
        total += array.size
    if total == 0:
        raise ValueError(
            "cannot estimate p0 from zero codes; pass the quantized weights of at least one matrix"
        )
    return zeros / total


def adaptive_p0(p0: float) -> float:
    """A measured zero fraction as the dictionary parameter: rounded to 3 decimals, clamped to
      P0_RANGE.

    Raises:
      ValueError: p0 that is not a fraction in [0, 1] (NaN included).
    """
    p0 = float(p0)
    if not 0.0 <= p0 <= 1.0:  # Also rejects NaN.
        raise ValueError(f"p0 is the fraction of zero codes and must lie in [0, 1], got {p0}")
    low, high = P0_RANGE
    return min(max(round(p0, P0_DECIMALS), low), high)


def adaptive_dictionary(codes_or_p0: float | np.ndarray | Sequence[np.ndarray]) -> Dictionary:
    """The dictionary for a model's measured zero fraction (cached per rounded p0).

    Args:
      codes_or_p0: uint8 ternary codes (see ``estimate_p0``), or their zero
        fraction as a float.
    """
    if isinstance(codes_or_p0, numbers.Real):
        p0 = float(codes_or_p0)
    else:
        p0 = estimate_p0(codes_or_p0)
    return build_dictionary(adaptive_p0(p0))


def tuned_dictionary(
    codes: np.ndarray | Sequence[np.ndarray], candidates: Sequence[float] | None = None
) -> Dictionary:
    """Among candidate dictionaries, the one that encodes ``codes`` into the fewest codewords.

    Each candidate costs a dictionary build (~1.5 s) and an encode of
    ``codes``, so pass a sample of the model (a few million weights).

    Args:
      codes: uint8[rows, cols] or uint8[E, rows, cols] ternary codes, or a
        sequence of such arrays.
      candidates: p0 values to build dictionaries for; by default the measured
        p0 plus ``TUNE_OFFSETS``. Each goes through ``adaptive_p0``; the paper's
        0.885 is always tried first and wins ties.
    """
    arrays = _code_arrays(codes)
    if candidates is None:
        measured = estimate_p0(arrays)
        candidates = [min(max(measured + offset, 0.0), 1.0) for offset in TUNE_OFFSETS]
    p0s = list(dict.fromkeys([DEFAULT_P0, *(adaptive_p0(p0) for p0 in candidates)]))
    codewords = [
        sum(count_codewords(array, build_dictionary(p0)) for array in arrays) for p0 in p0s
    ]
    return build_dictionary(p0s[int(np.argmin(codewords))])


def dictionary_for(
    mode: DictionaryMode, codes_or_p0: float | np.ndarray | Sequence[np.ndarray]
) -> Dictionary:
    """The dictionary of a compression run.

    Args:
      mode: "static" for the paper's dictionary (p0 = 0.885, readable by the
        QMoE authors' checkpoints), "adaptive" for ``adaptive_dictionary``,
        "tuned" for ``tuned_dictionary`` (needs codes, not a p0).
      codes_or_p0: what "adaptive" and "tuned" measure; ignored by "static".
    """
    if mode == "static":
        return build_dictionary(DEFAULT_P0)
    if mode == "adaptive":
        return adaptive_dictionary(codes_or_p0)
    if mode == "tuned":
        if isinstance(codes_or_p0, numbers.Real):
            raise ValueError("the 'tuned' dictionary mode needs a sample of codes, not a p0")
        return tuned_dictionary(codes_or_p0)
    raise ValueError(f"dictionary mode must be 'static', 'adaptive' or 'tuned', got {mode!r}")
