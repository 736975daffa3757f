import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from qmoe_jax.codec import CompressedExperts, CompressedMatrix, encode, encode_experts


def ternary(rng, shape, p0):
    u = rng.random(shape)
    return np.where(u < p0, 0, np.where(u < p0 + (1 - p0) / 2, 1, 2)).astype(np.uint8)


def test_bits_per_weight_of_a_matrix(dictionary):
    rows, cols = 12, 301
    encoded = encode(
        ternary(np.random.default_rng(0), (rows, cols), 0.885),
        np.zeros((rows, 2), ml_dtypes.bfloat16),
        dictionary,
    )
    n_codes = int(encoded.row_offsets[-1])
    assert encoded.n_codes == n_codes == encoded.codes.shape[0]
    # docs/format.md §7: 16 bits per codeword, 64 bits per row (offset + min/max).
    assert encoded.bits_per_weight() == pytest.approx((16 * n_codes + 64 * rows) / (rows * cols))


def test_bits_per_weight_of_a_stack_ignores_padding(dictionary):
    codes = ternary(np.random.default_rng(1), (3, 10, 200), 0.885)
    codes[1] = 0  # A short stream: padded to the longest in the stack.
    encoded = encode_experts(codes, np.zeros((3, 10, 2), ml_dtypes.bfloat16), dictionary)
    used = encoded.row_offsets[:, -1].astype(np.int64)
    assert encoded.codes.shape == (3, used.max()) and used[1] < used.max()
    assert encoded.bits_per_weight() == pytest.approx(
        (16 * used.sum() + 64 * 3 * 10) / (3 * 10 * 200)
    )
    per_expert = [encoded[e].bits_per_weight() for e in range(3)]
    assert encoded.bits_per_weight() == pytest.approx(np.mean(per_expert))


def test_expert_indexing_and_shapes(dictionary):
    codes = ternary(np.random.default_rng(2), (4, 6, 33), 0.8)
    minmax = np.ones((4, 6, 2), ml_dtypes.bfloat16)
    encoded = encode_experts(codes, minmax, dictionary)
    assert encoded.shape == (4, 6, 33) and encoded.num_experts == 4 and encoded.rows == 6
    second = encoded[1]
    assert isinstance(second, CompressedMatrix) and second.shape == (6, 33)
    np.testing.assert_array_equal(second.row_offsets, encoded.row_offsets[1])


def test_take_stacks_the_experts_asked_for_in_their_order(dictionary):
    codes = ternary(np.random.default_rng(3), (4, 6, 33), 0.8)
    encoded = encode_experts(codes, np.ones((4, 6, 2), ml_dtypes.bfloat16), dictionary)
    taken = encoded.take(jnp.asarray([3, 0, 3]))
    assert isinstance(taken, CompressedExperts) and taken.shape == (3, 6, 33)
    for position, expert in enumerate([3, 0, 3]):
        for field in ("codes", "row_offsets", "minmax"):
            np.testing.assert_array_equal(
                getattr(taken, field)[position], getattr(encoded, field)[expert]
            )


def test_pytree_keeps_cols_static(dictionary):
    encoded = encode(
        ternary(np.random.default_rng(3), (5, 17), 0.9),
        np.zeros((5, 2), ml_dtypes.bfloat16),
        dictionary,
    )
    leaves, treedef = jax.tree_util.tree_flatten(encoded)
    assert len(leaves) == 3
    assert jax.tree_util.tree_unflatten(treedef, leaves).cols == 17

    @jax.jit
    def total_codes(matrix: CompressedMatrix):
        assert matrix.cols == 17  # Static under jit.
        return matrix.row_offsets[-1]

    assert int(total_codes(jax.device_put(encoded))) == encoded.n_codes


def test_stack_errors():
    with pytest.raises(ValueError, match="empty"):
        CompressedExperts.stack([])
    a = CompressedMatrix(
        np.zeros(1, np.uint16), np.zeros(3, np.int32), jnp.zeros((2, 2), jnp.bfloat16), 4
    )
    b = CompressedMatrix(
        np.zeros(1, np.uint16), np.zeros(3, np.int32), jnp.zeros((2, 2), jnp.bfloat16), 6
    )
    with pytest.raises(ValueError, match="one shape"):
        CompressedExperts.stack([a, b])
