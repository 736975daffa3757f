import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qmoe_jax.quant import accumulate_hessian, cap_tokens, expert_hessians, hessian, token_cap


def test_hessian_is_the_masked_sum_of_outer_products():
    rng = np.random.default_rng(0)
    tokens = rng.normal(size=(50, 12)).astype(np.float32)
    mask = rng.random(50) < 0.6
    expected = tokens[mask].T.astype(np.float64) @ tokens[mask].astype(np.float64)
    result = hessian(tokens, mask)
    assert result.dtype == jnp.float32 and result.shape == (12, 12)
    np.testing.assert_allclose(np.asarray(result), expected, rtol=1e-5, atol=1e-4)


def test_masked_tokens_contribute_nothing_even_when_not_finite():
    rng = np.random.default_rng(1)
    tokens = rng.normal(size=(20, 8)).astype(np.float32)
    mask = np.arange(20) % 3 != 0
    poisoned = tokens.copy()
    poisoned[~mask] = np.nan
    np.testing.assert_array_equal(
        np.asarray(hessian(poisoned, mask)), np.asarray(hessian(tokens, mask))
    )
    np.testing.assert_array_equal(np.asarray(hessian(tokens, np.zeros(20, bool))), 0.0)


def test_accumulating_in_chunks_equals_one_batch_and_bf16_is_computed_in_f32():
    rng = np.random.default_rng(2)
    tokens = jnp.asarray(rng.normal(size=(64, 16)), jnp.bfloat16)
    mask = jnp.ones(64, bool)
    running = jnp.zeros((16, 16), jnp.float32)
    for start in range(0, 64, 16):
        running = accumulate_hessian(running, tokens[start : start + 16], mask[start : start + 16])
    exact = np.asarray(tokens, np.float64).T @ np.asarray(tokens, np.float64)
    np.testing.assert_allclose(np.asarray(running), exact, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(np.asarray(hessian(tokens, mask)), exact, rtol=1e-5, atol=1e-4)


def test_shape_errors_name_the_expected_layout():
    with pytest.raises(ValueError, match=r"tokens \[n, cols\]"):
        accumulate_hessian(jnp.zeros((4, 4)), jnp.zeros((3, 5)), jnp.ones(3, bool))
    with pytest.raises(ValueError, match=r"tokens \[E, n, cols\]"):
        expert_hessians(jnp.zeros((3, 5)), jnp.ones(3, bool))
    with pytest.raises(ValueError, match="every expert"):
        token_cap(jnp.zeros((0,), jnp.int32))


def test_expert_hessians_match_each_expert_and_count_tokens():
    rng = np.random.default_rng(3)
    tokens = rng.normal(size=(3, 10, 6)).astype(np.float32)
    mask = np.array([np.arange(10) < 7, np.zeros(10, bool), np.arange(10) % 2 == 0])
    hessians, counts = jax.jit(expert_hessians)(tokens, mask)
    np.testing.assert_array_equal(np.asarray(counts), [7, 0, 5])
    for e in range(3):
        np.testing.assert_allclose(
            np.asarray(hessians[e]), np.asarray(hessian(tokens[e], mask[e])), rtol=1e-6, atol=1e-6
        )


def test_token_cap_is_four_times_the_layer_mean_floored_and_at_least_one():
    assert int(token_cap(np.array([10, 0, 3, 0]))) == 13
    assert int(token_cap(np.array([10, 0, 3, 0]), factor=2.0)) == 6
    assert int(token_cap(np.array([0, 0]))) == 1


def test_cap_tokens_keeps_the_first_admitted_tokens_in_buffer_order():
    mask = jnp.array(
        [
            [True, False, True, True, True, False, True],
            [False, False, True, False, False, False, False],
        ]
    )
    capped = jax.jit(cap_tokens)(mask, 3)
    np.testing.assert_array_equal(
        np.asarray(capped),
        [
            [True, False, True, True, False, False, False],
            [False, False, True, False, False, False, False],
        ],
    )
    np.testing.assert_array_equal(np.asarray(cap_tokens(mask, 100)), np.asarray(mask))
