"""The fused clipped AdamW: optax's math and state, updated in place."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from qmoe_jax.training.optimizer import ClippedAdafactor, ClippedAdamW


def _optimizer(clip_norm=1.0):
    schedule = optax.warmup_cosine_decay_schedule(0.0, 1e-2, 2, 10, 1e-3)
    return ClippedAdamW(schedule, clip_norm=clip_norm, weight_decay=0.05, b1=0.9, b2=0.98)


def _tree(key, scale=1.0):
    a, b, c = jax.random.split(key, 3)
    return {
        "dense": scale * jax.random.normal(a, (48, 32)),
        "block": {
            "bias": scale * jax.random.normal(b, (32,)),
            "scale": scale * jax.random.normal(c, (3, 5)),
        },
    }


def _jitted_step(reference):
    """One step of an optax chain, compiled: run op by op, its update took seconds per step."""

    @jax.jit
    def step(grads, state, params):
        updates, state = reference.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return step


@pytest.mark.parametrize("gradient_scale", [1e-3, 10.0], ids=["below_clip", "clipped"])
def test_matches_the_optax_chain_over_steps(gradient_scale):
    optimizer = _optimizer()
    reference = optimizer.reference()
    reference_step = _jitted_step(reference)
    params = _tree(jax.random.PRNGKey(0))
    state = optimizer.init(params)
    ref_params, ref_state = params, reference.init(params)
    apply = jax.jit(optimizer.apply)
    for step in range(4):
        grads = _tree(jax.random.PRNGKey(10 + step), gradient_scale)
        params, state, norm = apply(params, grads, state)
        ref_params, ref_state = reference_step(grads, ref_state, ref_params)
        norm_wanted = np.sqrt(sum(np.sum(np.square(g)) for g in jax.tree.leaves(grads)))
        np.testing.assert_allclose(norm, norm_wanted, rtol=1e-6)
        assert (norm > 1.0) == (gradient_scale > 1)
        for got, want in zip(
            jax.tree.leaves((params, state)), jax.tree.leaves((ref_params, ref_state))
        ):
            assert got.dtype == want.dtype
            np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-7)
    # the parameters moved: the comparison is not between two untouched trees
    assert not np.allclose(params["dense"], _tree(jax.random.PRNGKey(0))["dense"])


def test_state_is_the_optax_chains_so_checkpoints_restore_either_way():
    optimizer = _optimizer()
    params = _tree(jax.random.PRNGKey(1))
    state = optimizer.init(params)
    assert jax.tree.structure(state) == jax.tree.structure(optimizer.reference().init(params))
    _, new_state, _ = optimizer.apply(params, params, state)
    assert jax.tree.structure(new_state) == jax.tree.structure(state)
    adam, schedule = new_state[1][0], new_state[1][2]
    assert int(adam.count) == 1 and int(schedule.count) == 1


def test_donated_step_needs_no_temporary_the_size_of_the_parameters():
    # optax's update tree then apply_updates keeps a parameter-sized temporary on XLA:CPU;
    # the fused update writes the donated buffers in place
    optimizer = _optimizer()
    params = {"a": jnp.ones((256, 512)), "b": {"c": jnp.ones((128, 1024)), "d": jnp.ones((7,))}}
    state = optimizer.init(params)
    size = sum(x.nbytes for x in jax.tree.leaves(params))
    compiled = (
        jax.jit(optimizer.apply, donate_argnums=(0, 2)).lower(params, params, state).compile()
    )
    memory = compiled.memory_analysis()
    if memory is None:
        pytest.skip("this backend reports no memory analysis")
    assert memory.temp_size_in_bytes < 0.01 * size
    assert memory.alias_size_in_bytes >= 3 * size  # parameters and both moments in place


def _adafactor(weight_decay=0.0):
    schedule = optax.warmup_cosine_decay_schedule(0.0, 1e-2, 2, 10, 1e-3)
    return ClippedAdafactor(schedule, clip_norm=1.0, weight_decay=weight_decay)


def _factored_tree(key, scale=1.0):
    # factored both ways round (rows the larger axis, or columns), square (a tie: which axis is
    # "largest" decides the factors), a stacked 3-D array factored over its last two axes, one
    # below the factoring size, and vectors
    a, b, c, d, e, f, g = jax.random.split(key, 7)
    return {
        "tall": scale * jax.random.normal(a, (256, 130)),
        "wide": scale * jax.random.normal(b, (130, 256)),
        "square": scale * jax.random.normal(f, (160, 160)),
        "square_stack": scale * jax.random.normal(g, (2, 150, 150)),
        "stack": scale * jax.random.normal(c, (3, 140, 129)),
        "small": scale * jax.random.normal(d, (64, 300)),
        "bias": scale * jax.random.normal(e, (130,)),
    }


@pytest.mark.parametrize("gradient_scale", [1e-3, 10.0], ids=["below_clip", "clipped"])
def test_adafactor_matches_the_optax_chain_over_steps(gradient_scale):
    optimizer = _adafactor()
    reference = optimizer.reference()
    reference_step = _jitted_step(reference)
    params = _factored_tree(jax.random.PRNGKey(0))
    state = optimizer.init(params)
    factored = state[1][0]
    assert factored.v_row["tall"].shape == (130,) and factored.v_col["tall"].shape == (256,)
    assert factored.v_row["stack"].shape == (3, 129) and factored.v["small"].shape == (64, 300)
    ref_params, ref_state = params, reference.init(params)
    apply = jax.jit(optimizer.apply)
    for step in range(5):
        grads = _factored_tree(jax.random.PRNGKey(10 + step), gradient_scale)
        params, state, norm = apply(params, grads, state)
        ref_params, ref_state = reference_step(grads, ref_state, ref_params)
        assert (norm > 1.0) == (gradient_scale > 1)
        for got, want in zip(
            jax.tree.leaves((params, state)), jax.tree.leaves((ref_params, ref_state))
        ):
            assert got.dtype == want.dtype
            np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-7)
    assert not np.allclose(params["tall"], _factored_tree(jax.random.PRNGKey(0))["tall"])


def test_adafactor_weight_decay_is_decoupled_and_scaled_by_the_learning_rate():
    params = _factored_tree(jax.random.PRNGKey(2))
    grads = _factored_tree(jax.random.PRNGKey(3), 0.1)
    plain, decayed = _adafactor(), _adafactor(weight_decay=0.5)
    state = plain.init(params)
    plain_apply, decayed_apply = jax.jit(plain.apply), jax.jit(decayed.apply)
    for _ in range(3):  # the schedule's learning rate is 0 at step 0: take it past the warm-up
        new_plain, next_state, _ = plain_apply(params, grads, state)
        new_decayed, _, _ = decayed_apply(params, grads, state)
        learning_rate = plain.schedule(state[1][2].count)
        for a, b, p in zip(*map(jax.tree.leaves, (new_plain, new_decayed, params))):
            np.testing.assert_allclose(a - b, learning_rate * 0.5 * p, rtol=1e-4, atol=1e-7)
        state = next_state
    assert float(learning_rate) > 0


def test_adafactor_state_is_a_small_fraction_of_the_parameters():
    params = {"kernel": jnp.ones((768, 3072)), "embedding": jnp.ones((4096, 768))}
    state = _adafactor().init(params)
    size = sum(x.nbytes for x in jax.tree.leaves(params))
    assert sum(x.nbytes for x in jax.tree.leaves(state)) < 0.01 * size


def test_adafactor_donated_step_needs_no_temporary_the_size_of_the_parameters():
    optimizer = _adafactor(weight_decay=0.01)
    params = {"a": jnp.ones((256, 512)), "b": {"c": jnp.ones((1024, 128)), "d": jnp.ones((7,))}}
    state = optimizer.init(params)
    size = sum(x.nbytes for x in jax.tree.leaves(params))
    compiled = (
        jax.jit(optimizer.apply, donate_argnums=(0, 2)).lower(params, params, state).compile()
    )
    memory = compiled.memory_analysis()
    if memory is None:
        pytest.skip("this backend reports no memory analysis")
    # vectors of the factored moments only: no array the size of a parameter (the smallest
    # matrix here is a quarter of them)
    assert memory.temp_size_in_bytes < 0.05 * size
    assert memory.alias_size_in_bytes >= size  # the parameters in place
