import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qmoe_jax.quant.linalg import (
    BASE_SIZE,
    cholesky,
    exact_product,
    pairwise_sum,
    reversed_cholesky,
)


def _reversed_as_lower(factor):
    """reversed_cholesky seen as a lower Cholesky: J·R(J·A·J)·J is the L of A (J reverses rows or
      columns), with
    the same failure columns, batch behaviour and triangle read, so every test below runs on both.
    """
    return lambda matrices: factor(np.asarray(matrices)[..., ::-1, ::-1])[..., ::-1, ::-1]


def _variants(factor, name):
    """The factor with its diagonal blocks in the CPU kernel (the default) and in the jnp loop (its
    twin)."""
    return {
        name: functools.partial(factor, native=True),
        f"{name}_jnp": functools.partial(factor, native=False),
    }


_FUNCTIONS = {
    **_variants(cholesky, "cholesky"),
    **_variants(reversed_cholesky, "reversed_cholesky"),
}
_AS_LOWER = {
    name: _reversed_as_lower if name.startswith("reversed") else (lambda factor: factor)
    for name in _FUNCTIONS
}
FACTORS = {name: _AS_LOWER[name](jax.jit(function)) for name, function in _FUNCTIONS.items()}
BATCHED = {
    name: _AS_LOWER[name](jax.jit(jax.vmap(function))) for name, function in _FUNCTIONS.items()
}
factors = pytest.mark.parametrize("name", list(FACTORS))


def spd_matrix(size: int, seed: int = 0) -> np.ndarray:
    """A damped Gram matrix XᵀX + 0.1·mean(diag)·I, like GPTQ's Hessians (condition number ~10³)."""
    rng = np.random.default_rng(seed)
    inputs = rng.normal(size=(size + 16, 8)) @ rng.normal(size=(8, size)) + 0.3 * rng.normal(
        size=(size + 16, size)
    )
    gram = inputs.T @ inputs
    return (gram + 0.1 * np.mean(np.diag(gram)) * np.eye(size)).astype(np.float32)


# 300: three blocks, the last one partial; the batch and failure tests below reuse its programs.
@factors
@pytest.mark.parametrize(
    "size", [1, 7, BASE_SIZE, BASE_SIZE + 1, 300, pytest.param(600, marks=pytest.mark.slow)]
)
def test_cholesky_matches_float64_lapack(name, size):
    matrix = spd_matrix(size, seed=size)
    lower = np.asarray(FACTORS[name](matrix), np.float64)
    reference = np.linalg.cholesky(matrix.astype(np.float64))
    np.testing.assert_array_equal(np.triu(lower, 1), 0.0)
    # float32 LAPACK (jnp.linalg.cholesky) is off by ~1e-6 relative here; allow 10× that
    np.testing.assert_allclose(lower, reference, rtol=0, atol=1e-5 * np.abs(reference).max())
    reconstructed = lower @ lower.T
    assert np.abs(reconstructed - matrix).max() <= 1e-5 * np.abs(matrix).max()


@factors
def test_cholesky_reads_only_the_lower_triangle(name):  # reversed_cholesky: the upper one
    matrix = spd_matrix(300)
    scrambled = np.tril(matrix) + np.triu(np.full_like(matrix, np.nan), 1)
    np.testing.assert_array_equal(
        np.asarray(FACTORS[name](scrambled)), np.asarray(FACTORS[name](matrix))
    )


@factors
def test_vmapped_cholesky_is_batch_invariant(name):
    """Each matrix gets the same bits alone, in a batch of 3 and in a batch of 6 (what sharding
    relies on)."""
    matrices = np.stack([spd_matrix(300, seed) for seed in range(6)])  # three blocks
    batch_of_6 = np.asarray(BATCHED[name](matrices))
    batches_of_3 = np.concatenate([np.asarray(BATCHED[name](matrices[i : i + 3])) for i in (0, 3)])
    alone = np.stack([np.asarray(FACTORS[name](m)) for m in matrices])
    np.testing.assert_array_equal(batch_of_6, batches_of_3)
    np.testing.assert_array_equal(batch_of_6, alone)


@factors
@pytest.mark.parametrize("failing_column", [0, BASE_SIZE - 1, BASE_SIZE, 299])
def test_not_positive_definite_gives_nans_from_the_failing_column_on(name, failing_column):
    matrix = spd_matrix(300)
    matrix[failing_column, failing_column] = -1.0
    lower = np.asarray(FACTORS[name](matrix))
    on_and_below = np.tril(np.ones_like(lower, bool))
    assert np.isfinite(lower[:, :failing_column]).all()
    assert np.isnan(lower[:, failing_column:][on_and_below[:, failing_column:]]).all()


@factors
def test_failures_stay_inside_their_batch_item(name):
    good, other = spd_matrix(300), spd_matrix(300, seed=1)
    rotation, _ = np.linalg.qr(np.random.default_rng(1).normal(size=(300, 300)))
    indefinite = (
        rotation * np.r_[np.ones(299), -1.0]
    ) @ rotation.T  # one negative eigenvalue, nothing on the diagonal
    batch = np.stack(
        [good, indefinite, np.zeros_like(good), np.full_like(good, np.nan), good, other]
    ).astype(np.float32)
    lower = np.asarray(BATCHED[name](batch))
    finite = [bool(np.isfinite(item).all()) for item in lower]
    assert finite == [True, False, False, False, True, True]
    np.testing.assert_array_equal(lower[0], np.asarray(FACTORS[name](good)))
    np.testing.assert_array_equal(lower[5], np.asarray(FACTORS[name](other)))


@pytest.mark.parametrize("size", [1, 2, 3, 7, 128, 513])
def test_pairwise_sum_is_a_sum(size):
    values = np.random.default_rng(size).normal(size=size).astype(np.float32)
    np.testing.assert_allclose(
        float(jax.jit(pairwise_sum)(values)), math.fsum(values.tolist()), rtol=1e-5, atol=1e-5
    )


def test_pairwise_sum_is_batch_invariant_where_jnp_sum_need_not_be():
    values = np.random.default_rng(0).normal(size=(8, 512)).astype(np.float32)
    batched = np.asarray(jax.jit(jax.vmap(pairwise_sum))(values))
    alone = np.asarray([jax.jit(pairwise_sum)(row) for row in values])
    np.testing.assert_array_equal(batched, alone)
    np.testing.assert_allclose(batched, np.asarray(jnp.sum(values, axis=1)), rtol=1e-5, atol=1e-5)


def test_exact_product_is_exact_so_an_fma_cannot_change_a_later_sum():
    a, b = np.random.default_rng(0).normal(size=(2, 1000)).astype(np.float32)
    product = np.asarray(jax.jit(exact_product)(a, b), np.float64)
    coarse = [np.asarray(jax.lax.reduce_precision(x, 8, 11), np.float64) for x in (a, b)]
    np.testing.assert_array_equal(product, coarse[0] * coarse[1])  # the float64 product, unrounded
    np.testing.assert_allclose(product, a.astype(np.float64) * b, rtol=2**-10)


@pytest.mark.parametrize("factor", [cholesky, reversed_cholesky])
def test_cholesky_rejects_batches(factor):
    with pytest.raises(ValueError, match="vmap it for a batch"):
        factor(jnp.zeros((2, 3, 3)))


@pytest.mark.parametrize("name", list(_FUNCTIONS))
@pytest.mark.parametrize("size", [7, pytest.param(BASE_SIZE, marks=pytest.mark.slow), 300])
def test_a_given_diagonal_factors_like_the_matrix_with_it_written_in(name, size):
    """GPTQ damps H's diagonal through ``diagonal`` instead of copying H: the bits must be the
    same."""
    matrix = spd_matrix(size, seed=size)
    diagonal = (np.diag(matrix) * np.float32(1.25) + 1).astype(np.float32)
    written = matrix.copy()
    np.fill_diagonal(written, diagonal)
    if size == 300:  # a NaN on the diagonal the argument replaces must not reach the result
        np.fill_diagonal(matrix, np.nan)
    function = _FUNCTIONS[name]
    given = jax.jit(lambda m, d: function(m, diagonal=d))(matrix, diagonal)
    np.testing.assert_array_equal(np.asarray(given), np.asarray(jax.jit(function)(written)))


@pytest.mark.parametrize("factor", [cholesky, reversed_cholesky])
def test_cholesky_rejects_a_diagonal_of_the_wrong_size(factor):
    with pytest.raises(ValueError, match=r"diagonal must have shape \(3,\)"):
        factor(jnp.eye(3), diagonal=jnp.ones(4))
