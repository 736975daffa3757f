"""The fused clipped AdamW: optax's math and state, updated in place."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from qmoe_jax.training.optimizer import ClippedAdamW


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


@pytest.mark.parametrize("gradient_scale", [1e-3, 10.0], ids=["below_clip", "clipped"])
def test_matches_the_optax_chain_over_steps(gradient_scale):
    optimizer = _optimizer()
    reference = optimizer.reference()
    params = _tree(jax.random.PRNGKey(0))
    state = optimizer.init(params)
    ref_params, ref_state = params, reference.init(params)
    apply = jax.jit(optimizer.apply)
    for step in range(4):
        grads = _tree(jax.random.PRNGKey(10 + step), gradient_scale)
        params, state, norm = apply(params, grads, state)
        updates, ref_state = reference.update(grads, ref_state, ref_params)
        ref_params = optax.apply_updates(ref_params, updates)
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
