"""GPTQ's native block kernel (xla_ffi/cpu_gptq.h) against its jnp twin, the levels of
quant/gptq.py's sweep."""

import dataclasses
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.child_process import run_python
from helpers.quant_helpers import correlated_problem, gptq_jit

from qmoe_jax.kernels.bindings import cpu_isas, gptq_block_call
from qmoe_jax.quant import GPTQConfig, GridConfig, grid_params

gptq_module = importlib.import_module("qmoe_jax.quant.gptq")
GRIDS = [GridConfig(), GridConfig("minmax", 2), GridConfig("minmax", 8)]


def block_problem(seed: int, m: int, rows: int, grid: GridConfig, dyadic: bool = False):
    """Operands of one block: W[rows, m], corrections, S (upper triangular, unit diagonal), R_kk and
      the row grids.

    ``dyadic``: every value a small multiple of a power of two, so that every sum either side forms
      is exact
    and the two must agree bit for bit."""
    rng = np.random.default_rng(seed)
    if dyadic:
        weights = rng.integers(-64, 65, size=(rows, m)) / 64.0
        corrections = rng.integers(-16, 17, size=(rows, m)) / 64.0
        scaled = rng.choice([0.0, 0.25, -0.25, 0.5, -0.5], size=(m, m))
        factor_diag = rng.choice([1.0, 2.0], size=m)
    else:
        weights = rng.normal(size=(rows, m))
        corrections = 0.1 * rng.normal(size=(rows, m))
        scaled = rng.normal(size=(m, m)) / np.sqrt(m)
        factor_diag = rng.uniform(0.5, 2.0, size=m)
    scaled = np.triu(scaled, 1) + np.eye(m)
    weights, corrections, scaled, factor_diag = (
        np.asarray(a, np.float32) for a in (weights, corrections, scaled, factor_diag)
    )
    params = grid_params(weights, grid)
    if dyadic and grid.kind == "ternary":  # grid levels on multiples of 1/8
        params = jnp.asarray(np.round(np.asarray(params, np.float32) * 8) / 8, params.dtype)
    elif dyadic:  # scale 1/32, zero in the middle: levels on multiples of 1/32
        params = jnp.asarray(np.broadcast_to(np.float32([1 / 32, grid.levels // 2]), (rows, 2)))
    return weights, corrections, scaled, factor_diag, params


def jnp_levels(weights, corrections, scaled, factor_diag, params, grid):
    return jax.jit(lambda *a: gptq_module._sweep(*a, params, grid, (1,)))(
        weights, corrections, scaled, factor_diag
    )


def native(weights, corrections, scaled, factor_diag, params, grid):
    return jax.jit(lambda *a: gptq_block_call(*a, levels=grid.levels))(
        weights, corrections, scaled, factor_diag, params
    )


@pytest.mark.parametrize("grid", GRIDS, ids=lambda g: f"{g.kind}{g.bits or ''}")
@pytest.mark.parametrize(("m", "rows"), [(1, 1), (16, 31), (37, 33), (128, 100)])
def test_exact_sums_give_the_jnp_levels_bits(grid, m, rows):
    operands = block_problem(m + rows, m, rows, grid, dyadic=True)
    twin = jnp_levels(*operands, grid)
    ours = native(*operands, grid)
    np.testing.assert_array_equal(np.asarray(ours[1]), np.asarray(twin[1]))  # codes
    np.testing.assert_array_equal(np.asarray(ours[0]), np.asarray(twin[0]))  # residuals
    np.testing.assert_allclose(
        np.asarray(ours[2]), np.asarray(twin[2]), rtol=1e-6
    )  # XLA may fuse e·e + sum


@pytest.mark.parametrize("grid", GRIDS, ids=lambda g: f"{g.kind}{g.bits or ''}")
def test_float_sums_differ_from_the_jnp_levels_by_rounding_only(grid):
    operands = block_problem(1, 128, 300, grid)
    twin = jnp_levels(*operands, grid)
    ours = native(*operands, grid)
    assert np.mean(np.asarray(ours[1]) == np.asarray(twin[1])) >= 0.999
    np.testing.assert_allclose(np.asarray(ours[2]), np.asarray(twin[2]), rtol=1e-3)
    same = np.asarray(ours[1]) == np.asarray(twin[1])
    np.testing.assert_allclose(np.asarray(ours[0])[same], np.asarray(twin[0])[same], atol=1e-5)


def test_batches_are_independent_items():
    grid = GridConfig()
    items = [block_problem(seed, 64, 70, grid) for seed in range(3)]
    stacked = [jnp.stack(parts) for parts in zip(*items)]
    batched = jax.jit(jax.vmap(lambda *a: gptq_block_call(*a, levels=3)))(*stacked)
    for index, item in enumerate(items):
        alone = native(*item, grid)
        for part, whole in zip(alone, batched):
            np.testing.assert_array_equal(np.asarray(part), np.asarray(whole[index]))


@pytest.mark.parametrize(
    "grid",
    GRIDS[:1] + [pytest.param(grid, marks=pytest.mark.slow) for grid in GRIDS[1:]],
    ids=lambda g: f"{g.kind}{g.bits or ''}",
)
@pytest.mark.parametrize(
    "unroll", [True, pytest.param(False, marks=pytest.mark.slow)], ids=["unrolled", "fori_loop"]
)
def test_gptq_with_the_native_block_matches_the_jnp_sweep(grid, unroll):
    # the problem shape and config of test_quant_gptq's and test_quant_linalg_native's GPTQ runs:
    # the fast run compiles ``ours`` once for all three
    weights, inputs = correlated_problem(11, rows=48, cols=300, rank=40)
    hessian = inputs.T @ inputs
    config = GPTQConfig(block_size=64, unroll_blocks=unroll)
    ours = gptq_jit(weights, hessian, grid=grid, config=config)
    twin = gptq_jit(
        weights, hessian, grid=grid, config=dataclasses.replace(config, native_block=False)
    )
    assert bool(ours.ok) and config.native_block
    assert np.mean(np.asarray(ours.codes) == np.asarray(twin.codes)) >= 0.995
    np.testing.assert_allclose(float(ours.loss), float(twin.loss), rtol=1e-3)


def test_every_instruction_set_gives_the_same_bits(tmp_path, monkeypatch):
    """Each product and sum is rounded on its own (cpu_gptq.cc is built with -ffp-contract=off), so
    a portable build must return what each AVX-512 or AVX2 build of this machine returns."""
    grid = GridConfig("minmax", 4)
    operands = block_problem(5, 128, 200, grid)
    np.savez(tmp_path / "operands.npz", *[np.asarray(a, np.float32) for a in operands])
    script = (
        "import numpy as np, jax; from qmoe_jax.kernels.bindings import gptq_block_call; "
        f"a = np.load({str(tmp_path / 'operands.npz')!r}); "
        "out = jax.jit(lambda *x: gptq_block_call(*x, levels=16))(*[a[f'arr_{i}'] for i in "
        "range(5)]); "
        f"np.savez({str(tmp_path / 'portable.npz')!r}, *[np.asarray(o) for o in out])"
    )
    completed = run_python(["-c", script], timeout=300, QMOE_CPU_ISA="portable")
    assert completed.returncode == 0, completed.stderr
    portable = np.load(tmp_path / "portable.npz")
    for isa in [isa for isa in cpu_isas() if isa != "portable"]:
        monkeypatch.setenv("QMOE_CPU_ISA", isa)  # read at each call
        for index, part in enumerate(native(*operands, grid)):
            np.testing.assert_array_equal(np.asarray(part), portable[f"arr_{index}"], err_msg=isa)


def test_bad_operands_raise_clear_errors():
    weights, corrections, scaled, factor_diag, params = block_problem(2, 16, 8, GridConfig())
    with pytest.raises(ValueError, match=r"scaled \[B\.\.\., m, m\]"):
        gptq_block_call(weights, corrections, scaled[:8], factor_diag, params, levels=3)
    with pytest.raises(ValueError, match=r"params \[B\.\.\., rows, 2\]"):
        gptq_block_call(weights, corrections, scaled, factor_diag, params[:4], levels=3)
    with pytest.raises(Exception, match="levels must be 3"):
        jax.block_until_ready(
            gptq_block_call(weights, corrections, scaled, factor_diag, params, levels=1000)
        )
