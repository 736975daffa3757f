"""Containers of compressed ternary matrices (format v1, docs/format.md §6).

Lingo: W[rows, cols] in y = W·x orientation (rows = output features); a row's
codewords are ``codes[row_offsets[r]:row_offsets[r+1]]``; ``minmax[r] =
(min_r, max_r)`` in bfloat16; an expert stack holds E matrices of one layer,
each padded to the longest code stream of the stack (offsets stay per expert,
so int32 never overflows however large the layer).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


def _bits_per_weight(row_offsets, rows: int, cols: int, matrices: int) -> float:
    n_codes = int(np.asarray(row_offsets)[..., -1].astype(np.int64).sum())
    return (16.0 * n_codes + 64.0 * rows * matrices) / (rows * cols * matrices)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class CompressedMatrix:
    """One compressed matrix W[rows, cols].

    Attributes:
      codes: uint16[n_codes_padded]; only the first ``row_offsets[-1]`` are used.
      row_offsets: int32[rows + 1], in codewords, starting at 0.
      minmax: bfloat16[rows, 2], per-row (min, max) of the ternary grid.
      cols: static number of columns.
    """

    codes: jax.Array
    row_offsets: jax.Array
    minmax: jax.Array
    cols: int = dataclasses.field(metadata=dict(static=True))

    @property
    def rows(self) -> int:
        return self.minmax.shape[-2]

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows, self.cols)

    @property
    def n_codes(self) -> int:
        """Codewords in use (needs concrete arrays)."""
        return int(np.asarray(self.row_offsets)[-1])

    def bits_per_weight(self) -> float:
        """(16·n_codes + 64·rows) / (rows·cols): codes plus row offsets and min/max."""
        return _bits_per_weight(self.row_offsets, self.rows, self.cols, 1)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class CompressedExperts:
    """A stack of E compressed matrices of one layer, each W_e[rows, cols].

    Attributes:
      codes: uint16[E, n_codes_padded]; expert e uses ``codes[e, :row_offsets[e, -1]]``.
      row_offsets: int32[E, rows + 1], per expert, starting at 0.
      minmax: bfloat16[E, rows, 2].
      cols: static number of columns.
    """

    codes: jax.Array
    row_offsets: jax.Array
    minmax: jax.Array
    cols: int = dataclasses.field(metadata=dict(static=True))

    @property
    def num_experts(self) -> int:
        return self.minmax.shape[0]

    @property
    def rows(self) -> int:
        return self.minmax.shape[-2]

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.num_experts, self.rows, self.cols)

    def __getitem__(self, expert: int) -> CompressedMatrix:
        return CompressedMatrix(
            self.codes[expert], self.row_offsets[expert], self.minmax[expert], self.cols
        )

    def take(self, experts: jax.Array) -> CompressedExperts:
        """The stack of experts ``experts`` (int[N], in range), in that order: one matrix per
        entry, e.g. each token's own expert."""
        return CompressedExperts(
            *(
                jnp.take(array, experts, axis=0, mode="clip")
                for array in (self.codes, self.row_offsets, self.minmax)
            ),
            self.cols,
        )

    def bits_per_weight(self) -> float:
        """Over the whole stack, counted as for one matrix; padding is not counted."""
        return _bits_per_weight(self.row_offsets, self.rows, self.cols, self.num_experts)

    @classmethod
    def stack(cls, matrices: list[CompressedMatrix]) -> CompressedExperts:
        """Stacks matrices of one shape, padding code streams to the longest."""
        if not matrices:
            raise ValueError("cannot stack an empty list of compressed matrices")
        shapes = {m.shape for m in matrices}
        if len(shapes) != 1:
            raise ValueError(f"all experts of a stack must share one shape, got {sorted(shapes)}")
        length = max(1, max(int(np.asarray(m.row_offsets)[-1]) for m in matrices))
        codes = np.zeros((len(matrices), length), np.uint16)
        for e, m in enumerate(matrices):
            used = int(np.asarray(m.row_offsets)[-1])
            codes[e, :used] = np.asarray(m.codes)[:used]
        return cls(
            jnp.asarray(codes),
            jnp.stack([jnp.asarray(m.row_offsets, jnp.int32) for m in matrices]),
            jnp.stack([jnp.asarray(m.minmax, jnp.bfloat16) for m in matrices]),
            matrices[0].cols,
        )
