"""The Cholesky's native kernel for its diagonal blocks (xla_ffi/cpu_cholesky.h) against its jnp
twin, quant/linalg.py's ``_base_factor``."""

import dataclasses
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.child_process import run_python
from helpers.quant_helpers import correlated_problem, gptq_jit

from qmoe_jax.kernels.bindings import CHOLESKY_BASE, cholesky_base_call, cpu_isas
from qmoe_jax.quant import GPTQConfig, GridConfig
from qmoe_jax.quant.linalg import reversed_cholesky

linalg = importlib.import_module("qmoe_jax.quant.linalg")
native = jax.jit(cholesky_base_call)
twin = jax.jit(linalg._base_factor)


def spd_block(size: int, seed: int = 0) -> np.ndarray:
    """A damped Gram matrix, like the Hessian blocks the Cholesky factors."""
    rng = np.random.default_rng(seed)
    inputs = rng.normal(size=(size + 8, size)) + 0.5 * rng.normal(size=(size + 8, 1))
    gram = inputs.T @ inputs
    return (gram + 0.1 * np.mean(np.diag(gram)) * np.eye(size)).astype(np.float32)


@pytest.mark.parametrize("size", [1, 2, 17, 64, 128])
def test_exact_sums_give_the_twins_bits(size):
    """A = L0·L0ᵀ with L0 unit lower triangular and small integer entries: every pivot is 1 and
    every sum is an exact integer either way, so both must return L0 and its (integer) inverse bit
    for bit."""
    rng = np.random.default_rng(size)
    unit = np.tril(
        rng.integers(-1, 2, size=(size, size)) * (rng.random((size, size)) < 4 / size), -1
    )
    unit = (unit + np.eye(size)).astype(np.float32)
    matrix = unit @ unit.T
    assert np.abs(matrix).max() < 2**24  # exact in float32
    lower, inverse = (np.asarray(part) for part in native(matrix))
    np.testing.assert_array_equal(lower, unit)
    np.testing.assert_array_equal(
        inverse, np.round(np.linalg.inv(unit.astype(np.float64))).astype(np.float32)
    )
    for ours, theirs in zip((lower, inverse), twin(matrix)):
        np.testing.assert_array_equal(ours, np.asarray(theirs))


@pytest.mark.parametrize("size", [3, 100, 128])
def test_float_sums_differ_from_the_twin_by_rounding_only(size):
    matrix = spd_block(size, seed=size)
    ours, theirs = native(matrix), twin(matrix)
    for mine, other in zip(ours, theirs):
        mine, other = np.asarray(mine), np.asarray(other)
        np.testing.assert_array_equal(np.triu(mine, 1), 0.0)
        np.testing.assert_allclose(mine, other, rtol=0, atol=2e-5 * np.abs(other).max())
    lower, inverse = (np.asarray(part, np.float64) for part in ours)
    np.testing.assert_allclose(lower @ lower.T, matrix, rtol=0, atol=1e-5 * np.abs(matrix).max())
    np.testing.assert_allclose(inverse @ lower, np.eye(size), rtol=0, atol=1e-4)


def test_only_the_lower_triangle_is_read():
    matrix = spd_block(50)
    scrambled = np.tril(matrix) + np.triu(np.full_like(matrix, np.nan), 1)
    for ours, clean in zip(native(scrambled), native(matrix)):
        np.testing.assert_array_equal(np.asarray(ours), np.asarray(clean))


@pytest.mark.parametrize("failing_column", [0, 5, 39])
def test_failures_give_the_twins_non_finite_entries(failing_column):
    matrix = spd_block(40, seed=3)
    matrix[failing_column, failing_column] = -1.0
    ours, theirs = native(matrix), twin(matrix)
    for mine, other in zip(ours, theirs):
        np.testing.assert_array_equal(np.isfinite(np.asarray(mine)), np.isfinite(np.asarray(other)))
    lower = np.asarray(ours[0])
    assert np.isfinite(lower[:, :failing_column]).all()
    failed = lower[failing_column:, failing_column:]
    assert np.isnan(failed[np.tril(np.ones_like(failed, bool))]).all()


def test_batches_are_independent_items():
    matrices = np.stack([spd_block(70, seed) for seed in range(5)])
    matrices[2, 10, 10] = -5.0  # one item fails
    batched = [np.asarray(part) for part in jax.jit(jax.vmap(cholesky_base_call))(matrices)]
    for index, matrix in enumerate(matrices):
        for whole, alone in zip(batched, native(matrix)):
            np.testing.assert_array_equal(whole[index], np.asarray(alone))
    assert [bool(np.isfinite(item).all()) for item in batched[0]] == [True, True, False, True, True]


def test_the_whole_cholesky_with_the_kernel_matches_the_jnp_one():
    matrix = spd_block(300, seed=9)
    ours = np.asarray(jax.jit(reversed_cholesky)(matrix))
    theirs = np.asarray(jax.jit(lambda m: reversed_cholesky(m, native=False))(matrix))
    np.testing.assert_array_equal(np.tril(ours, -1), 0.0)
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=2e-5 * np.abs(theirs).max())


def test_gptq_with_the_kernel_matches_gptq_without_it():
    # the problem shape and config of test_quant_gptq's and test_quant_gptq_native's GPTQ runs:
    # the fast run compiles ``ours`` once for all three
    weights, inputs = correlated_problem(4, rows=48, cols=300, rank=40)
    hessian = inputs.T @ inputs
    grid = GridConfig()
    config = GPTQConfig(block_size=64)
    ours = gptq_jit(weights, hessian, grid=grid, config=config)
    theirs = gptq_jit(
        weights, hessian, grid=grid, config=dataclasses.replace(config, native_cholesky=False)
    )
    assert bool(ours.ok) and bool(theirs.ok)
    assert np.mean(np.asarray(ours.codes) == np.asarray(theirs.codes)) >= 0.995
    np.testing.assert_allclose(float(ours.loss), float(theirs.loss), rtol=1e-3)


def test_every_instruction_set_gives_the_same_bits(tmp_path, monkeypatch):
    """Each product and sum is rounded on its own (cpu_cholesky.cc is built with -ffp-contract=off),
    so a portable build must return what each AVX-512 or AVX2 build of this machine returns."""
    matrix = spd_block(128, seed=11)
    np.save(tmp_path / "matrix.npy", matrix)
    script = (
        "import numpy as np, jax; from qmoe_jax.kernels.bindings import cholesky_base_call; "
        f"out = jax.jit(cholesky_base_call)(np.load({str(tmp_path / 'matrix.npy')!r})); "
        f"np.savez({str(tmp_path / 'portable.npz')!r}, *[np.asarray(o) for o in out])"
    )
    completed = run_python(["-c", script], timeout=300, QMOE_CPU_ISA="portable")
    assert completed.returncode == 0, completed.stderr
    portable = np.load(tmp_path / "portable.npz")
    for isa in [isa for isa in cpu_isas() if isa != "portable"]:
        monkeypatch.setenv("QMOE_CPU_ISA", isa)  # read at each call
        for index, part in enumerate(native(matrix)):
            np.testing.assert_array_equal(np.asarray(part), portable[f"arr_{index}"], err_msg=isa)


def test_bad_operands_raise_clear_errors():
    with pytest.raises(ValueError, match=r"matrices \[B\.\.\., n, n\]"):
        cholesky_base_call(np.zeros((4, 5), np.float32))
    result = jax.ShapeDtypeStruct((4, 4), jnp.float32)
    wrong = jax.ShapeDtypeStruct((4, 3), jnp.float32)
    with pytest.raises(Exception, match="lower and inverse must have the matrix's shape"):
        jax.block_until_ready(
            jax.ffi.ffi_call(CHOLESKY_BASE, (result, wrong))(np.eye(4, dtype=np.float32))
        )


def test_the_kernel_runs_inside_shard_map_with_its_type_checks():
    """ffi_call results carry no varying mesh axes; inside shard_map (default check_vma) the
    kernel's results are cast to its operand's varying axes, else lax.platform_dependent rejects its
    two branches as different types."""
    from jax.sharding import Mesh, PartitionSpec

    matrices = np.stack([spd_block(150, seed) for seed in range(2)])
    mesh = Mesh(np.asarray(jax.devices()[:1]), ("expert",))
    factor = jax.jit(
        jax.shard_map(
            jax.vmap(reversed_cholesky),
            mesh=mesh,
            in_specs=PartitionSpec("expert"),
            out_specs=PartitionSpec("expert"),
        )
    )
    unsharded = jax.jit(jax.vmap(reversed_cholesky))(matrices)
    np.testing.assert_array_equal(np.asarray(factor(matrices)), np.asarray(unsharded))
