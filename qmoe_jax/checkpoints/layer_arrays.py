"""The arrays of one stored sparse layer (docs/format.md §8): their names, dtypes and shapes.

Per expert kernel (``wi`` or ``wi_0``/``wi_1``, and ``wo``), the stack of E
matrices W[E, rows, cols] in y = W·x orientation (rows = output features, the
T5X kernel transposed) is stored as

- ternary: ``codes uint16[E, n]`` (each expert's code stream, zero padded to
  the longest), ``row_offsets int32[E, rows + 1]``, ``minmax bfloat16[E, rows, 2]``;
- k-bit: ``codes uint8[E, rows, cols]``, ``grid_params float32[E, rows, 2]``
  (scale, zero point per row).

This module is the one place that spells those names; the writer, the
calibration replay and the loaders go through it.
"""

from __future__ import annotations

from collections.abc import Sequence

import ml_dtypes
import numpy as np

from qmoe_jax.codec import CompressedExperts

TERNARY_DTYPES = {
    "codes": np.dtype(np.uint16),
    "row_offsets": np.dtype(np.int32),
    "minmax": np.dtype(ml_dtypes.bfloat16),
}
KBIT_DTYPES = {"codes": np.dtype(np.uint8), "grid_params": np.dtype(np.float32)}


def kernel_cols(kernel: str, d_model: int, d_ff: int) -> int:
    """Input features (cols) of an expert kernel: d_ff for ``wo``, d_model for the input kernels."""
    return d_ff if kernel == "wo" else d_model


def ternary_arrays(stacks: Sequence[CompressedExperts]) -> dict[str, np.ndarray]:
    """One kernel's stored arrays from the stacks of consecutive expert groups (codes padded to the
    longest)."""
    length = max(s.codes.shape[1] for s in stacks)
    codes = np.concatenate(
        [np.pad(np.asarray(s.codes), ((0, 0), (0, length - s.codes.shape[1]))) for s in stacks]
    )
    return {
        "codes": codes,
        "row_offsets": np.concatenate([np.asarray(s.row_offsets) for s in stacks]),
        "minmax": np.concatenate([np.asarray(s.minmax) for s in stacks]),
    }


def kbit_arrays(
    codes: Sequence[np.ndarray], grid_params: Sequence[np.ndarray]
) -> dict[str, np.ndarray]:
    """One kernel's stored arrays from the codes and grid parameters of consecutive expert
    groups."""
    return {"codes": np.concatenate(codes), "grid_params": np.concatenate(grid_params)}


def compressed_stack(arrays: dict, cols: int, experts: slice = slice(None)) -> CompressedExperts:
    """The ``CompressedExperts`` of a ternary kernel's stored arrays (optionally some of its
    experts)."""
    return CompressedExperts(
        np.asarray(arrays["codes"])[experts],
        np.asarray(arrays["row_offsets"])[experts],
        np.asarray(arrays["minmax"])[experts],
        cols,
    )


def check_kernel_arrays(arrays: dict, ternary: bool, where: str) -> None:
    """Raises ValueError unless ``arrays`` has exactly the names and dtypes of its grid."""
    expected = TERNARY_DTYPES if ternary else KBIT_DTYPES
    if set(arrays) != set(expected):
        raise ValueError(f"{where} holds arrays {sorted(arrays)}, expected {sorted(expected)}")
    for name, dtype in expected.items():
        if np.asarray(arrays[name]).dtype != dtype:
            raise ValueError(
                f"{where}/{name} is {np.asarray(arrays[name]).dtype}, expected {dtype}"
            )
