"""The rows of capacity slots the compressed MoE layer inside T5X computes, and its per-token path
(interop/slot_rows.py): no flaxformer, so these run without T5X."""

import jax.numpy as jnp
import numpy as np
from helpers.compressed_data import cached_experts

from qmoe_jax.interop.slot_rows import (
    each_token_its_expert,
    maps_zero_to_zero,
    on_rows_in_use,
    row_buckets,
)


def test_the_mlp_runs_on_the_rows_in_use_of_the_smallest_bucket_that_holds_them():
    assert row_buckets(512) == [1, 2, 8, 32, 128, 512]
    assert row_buckets(6) == [1, 2, 6] and row_buckets(1) == [1]

    def mlp(tokens, counts):
        # Rows within their block's count times the rows per block the MLP was given (the
        # bucket), the others zero: in-use rows that did not come first would be lost.
        per_block = tokens.shape[1] // 2
        position = jnp.arange(tokens.shape[1]) % per_block
        block = jnp.arange(tokens.shape[1]) // per_block
        used = position[None, :] < counts[:, block]
        return jnp.where(used[..., None], tokens * per_block, 0.0)

    rng = np.random.default_rng(0)
    for most, bucket in [(0, 1), (1, 1), (2, 4), (5, 16), (9, 16)]:
        x = np.zeros((3, 32, 5), np.float32)  # 2 blocks of 16 rows: buckets 1, 4, 16
        for e in range(3):
            for b in range(2):
                count = most if (e, b) == (1, 1) else min(most, 1)
                rows = rng.choice(16, count, replace=False)
                x[e, 16 * b + rows] = rng.normal(size=(count, 5))
        got = on_rows_in_use(mlp, jnp.asarray(x), blocks=2)
        np.testing.assert_allclose(got, x * bucket, err_msg=f"largest count {most}")
    assert maps_zero_to_zero(("relu",)) and maps_zero_to_zero(("gelu", "linear"))
    assert maps_zero_to_zero(("sigmoid", "linear")) and not maps_zero_to_zero(("sigmoid",))


def test_each_token_its_expert_is_each_tokens_own_mlp(dictionary):
    """The per-token path: every nonzero token through its own expert's kernels (relu, then wo),
    against the dense twins; a zero token gives zero, and tokens routed to one expert share it."""
    wi, wi_dense = cached_experts(4, 24, 16)
    wo, wo_dense = cached_experts(4, 16, 24, seed=1)
    rng = np.random.default_rng(3)
    x = rng.normal(size=(7, 16)).astype(np.float32)
    x[2] = 0.0
    expert = np.array([3, 0, 1, 3, 2, 0, 3])
    got = each_token_its_expert(
        {"wi": wi, "wo": wo}, dictionary, [("wi", "relu")], jnp.asarray(x), jnp.asarray(expert)
    )
    hidden = np.maximum(np.einsum("nc,nrc->nr", x, wi_dense[expert]), 0.0)
    want = np.einsum("nc,nrc->nr", hidden, wo_dense[expert])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert not np.asarray(got)[2].any()
