"""Round-to-nearest (RTN): the data-free baseline of QMoE's Tables.

Every weight goes to the nearest level of its row's grid, independently of the
others. RTN equals GPTQ with an identity Hessian (no error feedback between
columns), which is also what GPTQ falls back to for experts without tokens or
with a Hessian that is not positive definite.
"""

from __future__ import annotations

import jax

from qmoe_jax.quant.grids import GridConfig, grid_params, quantize


def rtn(weights: jax.Array, grid: GridConfig) -> tuple[jax.Array, jax.Array]:
    """Round one matrix to its per-row grid.

    Args:
      weights: float[rows, cols], y = W·x orientation.
      grid: which grid.

    Returns:
      (codes uint8[rows, cols], grid_params[rows, 2]; bfloat16 for ternary, float32 for minmax).
    """
    params = grid_params(weights, grid)
    _, codes = quantize(weights, params, grid)
    return codes, params
