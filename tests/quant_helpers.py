"""Shared data and a textbook GPTQ reference for the quant tests."""

import jax
import numpy as np

from qmoe_jax.quant import dequantize_codes, gptq, grid_params

gptq_jit = jax.jit(gptq, static_argnames=("grid", "config"))


def correlated_problem(seed: int, rows: int = 32, cols: int = 160, tokens: int = 1024, rank: int = 32):
    """W[rows, cols] ~ N(0, 1) and inputs X[tokens, cols] with a strong rank-`rank` correlation plus noise."""
    rng = np.random.default_rng(seed)
    weights = rng.normal(size=(rows, cols)).astype(np.float32)
    inputs = rng.normal(size=(tokens, rank)) @ rng.normal(size=(rank, cols)) + 0.3 * rng.normal(size=(tokens, cols))
    return weights, inputs.astype(np.float32)


def textbook_gptq(weights, hessian, grid, damping=0.1):
    """Column-by-column GPTQ in float64 numpy with U = upper Cholesky of H⁻¹ (no blocks, no tricks); returns codes.

    Each column goes to the nearest level of its row (ties to the lower code, so ternary ties go to 0).
    """
    weights = np.array(weights, np.float64)
    hessian = np.array(hessian, np.float64)
    params = grid_params(weights.astype(np.float32), grid)
    all_codes = np.broadcast_to(np.arange(grid.levels, dtype=np.uint8), (weights.shape[0], grid.levels))
    levels = np.asarray(dequantize_codes(all_codes, params, grid), np.float64)
    dead = np.diag(hessian) == 0
    hessian[dead, dead] = 1.0
    weights[:, dead] = 0.0
    hessian += damping * np.mean(np.diag(hessian)) * np.eye(len(hessian))
    upper = np.linalg.cholesky(np.linalg.inv(hessian)).T
    codes = np.zeros(weights.shape, np.uint8)
    rows = np.arange(weights.shape[0])
    for i in range(weights.shape[1]):
        codes[:, i] = np.argmin(np.abs(weights[:, i, None] - levels), axis=1)
        error = (weights[:, i] - levels[rows, codes[:, i]]) / upper[i, i]
        weights[:, i:] -= np.outer(error, upper[i, i:])
    return codes
