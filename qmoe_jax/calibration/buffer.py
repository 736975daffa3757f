"""The calibration token buffer (QMoE's list buffer) in host RAM.

Lingo: every calibration sample's hidden states live in one flat array
``states [total_tokens, d]`` with sample delimiters ``offsets [samples + 1]``
(sample i owns rows offsets[i]:offsets[i+1]); no padding is stored. Dense
sublayers see padded ``[B, L, d]`` batches of consecutive samples; experts see
the rows routed to them, gathered with one vectorized index.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np


class TokenBuffer:
    """Hidden states of variable-length samples, stored flat.

    Attributes:
      states: float[total_tokens, d].
      offsets: int64[samples + 1], sample delimiters.
    """

    def __init__(self, lengths: np.ndarray, width: int, dtype=np.float32):
        lengths = np.asarray(lengths, np.int64)
        if (lengths <= 0).any():
            raise ValueError("every calibration sample needs at least one token")
        self.offsets = np.concatenate([[0], np.cumsum(lengths)])
        self.states = np.zeros((int(self.offsets[-1]), width), dtype)

    @property
    def num_samples(self) -> int:
        return self.offsets.size - 1

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def padded_index(self, first: int, last: int, length: int) -> tuple[np.ndarray, np.ndarray]:
        """Rows of samples [first, last) laid out as [last-first, length]; -1 marks padding.

        Returns (rows int64[B, length], valid bool[B, length]).
        """
        lengths = self.lengths[first:last]
        if (lengths > length).any():
            raise ValueError(
                f"a sample has {lengths.max()} tokens, more than the batch length {length}"
            )
        positions = np.arange(length)[None, :]
        valid = positions < lengths[:, None]
        rows = np.where(valid, self.offsets[first:last, None] + positions, -1)
        return rows, valid

    def gather(self, rows: np.ndarray, valid: np.ndarray) -> np.ndarray:
        """``states`` at ``rows`` (any shape), zero where not ``valid``."""
        out = self.states[np.where(valid, rows, 0)]
        out[~valid] = 0
        return out

    def scatter(self, rows: np.ndarray, valid: np.ndarray, values: np.ndarray) -> None:
        """Writes ``values [..., d]`` back at the valid ``rows``."""
        self.states[rows[valid]] = values[valid]

    def batches(self, batch_size: int) -> Iterator[tuple[int, int]]:
        """Consecutive sample ranges [first, last) of at most ``batch_size`` samples."""
        for first in range(0, self.num_samples, batch_size):
            yield first, min(first + batch_size, self.num_samples)
