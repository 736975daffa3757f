"""Shared data and a textbook GPTQ reference for the quant tests."""

import jax
import numpy as np

from qmoe_jax.quant import dequantize_codes, gptq, grid_params

gptq_jit = jax.jit(gptq, static_argnames=("grid", "config"))


def correlated_problem(
    seed: int, rows: int = 32, cols: int = 160, tokens: int = 1024, rank: int = 32
):
    """W[rows, cols] ~ N(0, 1) and inputs X[tokens, cols] with a strong rank-`rank` correlation plus
    noise."""
    rng = np.random.default_rng(seed)
    weights = rng.normal(size=(rows, cols)).astype(np.float32)
    inputs = rng.normal(size=(tokens, rank)) @ rng.normal(size=(rank, cols)) + 0.3 * rng.normal(
        size=(tokens, cols)
    )
    return weights, inputs.astype(np.float32)


def textbook_gptq(weights, hessian, grid, damping=0.1):
    """Column-by-column GPTQ in float64 numpy with U = upper Cholesky of H⁻¹ (no blocks, no tricks);
    returns codes.

    Each column goes to the nearest level of its row (ties to the lower code, so ternary ties go to
    0).
    """
    weights = np.array(weights, np.float64)
    hessian = np.array(hessian, np.float64)
    params = grid_params(weights.astype(np.float32), grid)
    all_codes = np.broadcast_to(
        np.arange(grid.levels, dtype=np.uint8), (weights.shape[0], grid.levels)
    )
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


def expert_group(num_experts: int, seed: int = 0):
    """W[E, 32, 160], H[E, 160, 160], tokens[E]; expert 1 has no tokens, expert 2 a NaN Hessian,
    expert 3 a negative one."""
    problems = [correlated_problem(seed + e) for e in range(num_experts)]
    weights = np.stack([w for w, _ in problems])
    hessians = np.stack([x.T @ x for _, x in problems])
    tokens = np.full(num_experts, 1024, np.int32)
    tokens[1] = 0
    hessians[1] = 0.0
    hessians[2] = np.nan
    hessians[3] = -hessians[3]
    return weights, hessians, tokens


BUNDLED_EXPERTS, BUNDLED_D_MODEL, BUNDLED_D_FF = 8, 128, 512  # switch-mini-8


def bundled_size_groups(seed: int = 0) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """One sparse layer at the bundled model's sizes: (W, H, tokens per expert) for "wi" (W[8, 512,
    128]) and "wo" (W[8, 128, 512], H from ReLU activations, so with dead columns). Expert 1 has no
    tokens and expert 2 an indefinite Hessian (both fall back to RTN). Token counts are in the
    bundled encoder's range; the Hessians come from 2048 synthetic tokens each."""
    rng = np.random.default_rng(seed)
    inputs = (
        rng.normal(size=(BUNDLED_EXPERTS, 2048, 16)) @ rng.normal(size=(16, BUNDLED_D_MODEL))
        + 0.3 * rng.normal(size=(BUNDLED_EXPERTS, 2048, BUNDLED_D_MODEL))
    ).astype(np.float32)
    wi = (
        rng.normal(size=(BUNDLED_EXPERTS, BUNDLED_D_FF, BUNDLED_D_MODEL)).astype(np.float32)
        / BUNDLED_D_MODEL**0.5
    )
    wo = (
        rng.normal(size=(BUNDLED_EXPERTS, BUNDLED_D_MODEL, BUNDLED_D_FF)).astype(np.float32)
        / BUNDLED_D_FF**0.5
    )
    hidden = np.maximum(np.einsum("etd,efd->etf", inputs, wi), 0.0)
    hidden[..., ::50] = 0.0  # units that never fire: dead columns of H
    tokens = rng.integers(11_000, 22_000, size=BUNDLED_EXPERTS).astype(np.int32)
    tokens[1] = 0
    groups = {}
    for name, weights, activations in (("wi", wi, inputs), ("wo", wo, hidden)):
        hessians = np.einsum("etc,etd->ecd", activations, activations).astype(np.float32)
        hessians[2] = -hessians[2]
        groups[name] = (weights, hessians, tokens)
    return groups
