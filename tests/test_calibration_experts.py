"""Token bookkeeping of a sparse layer: sorting tokens by expert, the Hessian token cap, gathering a group."""

import numpy as np
import pytest

from qmoe_jax.calibration.experts import gather_group, hessian_token_cap, hessian_width, sort_by_expert


def test_sort_by_expert_groups_kept_rows_in_buffer_order():
    expert = np.array([2, 0, 2, 1, 0, 2])
    kept = np.array([True, True, False, True, True, True])
    order, starts = sort_by_expert(expert, kept, num_experts=4)
    np.testing.assert_array_equal(order, [1, 4, 3, 0, 5])
    np.testing.assert_array_equal(starts, [0, 2, 3, 5, 5])  # expert 3 has no tokens


@pytest.mark.parametrize(
    "expert,premask,expected_counts",
    [
        ([0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 0, 1], [2, 3, 0, 0]),  # the last experts have no tokens
        ([3, 3, 3, 1], [1, 1, 1, 1], [0, 1, 0, 3]),  # the first and a middle expert have none
        ([2, 2, 2, 2], [1, 0, 1, 1], [0, 0, 3, 0]),  # one expert has all tokens
        ([], [], [0, 0, 0, 0]),  # no tokens at all
    ],
)
def test_hessian_token_cap_counts_every_expert(expert, premask, expected_counts):
    expert = np.asarray(expert, np.int64)
    order, starts = sort_by_expert(expert, np.ones(expert.size, bool), num_experts=4)
    mean = sum(expected_counts) / 4
    expected = max(1, int(np.floor(2.0 * mean)))
    assert hessian_token_cap(np.asarray(premask, bool), order, starts, factor=2.0) == expected


def test_gather_group_pads_and_caps():
    expert = np.array([0, 1, 1, 1, 1, 0, 3])
    premask = np.array([True, True, False, True, True, True, True])
    order, starts = sort_by_expert(expert, np.ones(expert.size, bool), num_experts=4)
    group = gather_group(order, starts, range(1, 4), premask, cap=2)
    assert group.rows.shape == (3, 8)  # 4 tokens at most, padded to the bucket of 8
    np.testing.assert_array_equal(group.rows[0, :4], [1, 2, 3, 4])
    np.testing.assert_array_equal(group.valid.sum(axis=1), [4, 0, 1])
    # Expert 1: rows 1, 3 and 4 are premasked; the cap of 2 keeps two of them, never row 2.
    assert group.hessian_mask[0].sum() == 2 and not group.hessian_mask[0, 1]
    assert not group.hessian_mask[1].any() and group.hessian_mask[2, 0]
    assert not (group.hessian_mask & ~group.valid).any()


def test_experts_per_call_fits_the_memory_and_splits_evenly():
    from qmoe_jax.calibration.experts import HESSIAN_COPIES, WEIGHT_COPIES, ExpertCompressionConfig

    def per_expert(rows, cols):
        return 4 * cols * (HESSIAN_COPIES * cols + WEIGHT_COPIES * rows)

    settings = ExpertCompressionConfig(group_size=16, gptq_memory=10 * per_expert(768, 3072))
    step = settings.experts_per_call(768, 3072, 16)
    assert step == 8  # 10 fit; two even calls of 8 instead of 10 + 6
    assert settings.experts_per_call(3072, 768, 16) == 16  # the narrow kernel fits whole
    assert settings.experts_per_call(768, 3072, 5) == 5  # a short last group
    tiny = ExpertCompressionConfig(group_size=16, gptq_memory=1)
    assert tiny.experts_per_call(768, 3072, 16) == 1  # never zero experts per call
    # Weights count, not only Hessians: a tall matrix with few columns is split too.
    tall = ExpertCompressionConfig(group_size=16, gptq_memory=4 * per_expert(3072, 768))
    assert tall.experts_per_call(3072, 768, 16) == 4


@pytest.mark.parametrize(("last", "size", "width"), [
    (0, 16, 8),  # no kept token: the smallest width
    (5, 5, 5),  # never past the buffer
    (8, 1024, 8), (9, 1024, 9), (100, 1024, 104), (700, 1024, 704), (1000, 1024, 1024),
    (2049, 4096, 2304), (3000, 4096, 3072), (4096, 4096, 4096),
])
def test_hessian_width_covers_every_kept_token(last, size, width):
    mask = np.zeros((3, size), bool)
    if last:
        mask[1, last - 1] = True  # the last kept token of the group, in its middle expert
        mask[0, : last // 2] = True
    assert hessian_width(mask) == width
    assert width >= last and (width - last) * 8 <= max(last, 64)  # at most 12.5% over (beyond tiny widths)


@pytest.mark.parametrize("cols", [768, 3072])
def test_hessians_of_trimmed_tokens_are_bit_identical(cols):
    """The calibration pass computes Hessians on ``hessian_width`` columns of the padded buffer, not all of it:
    XLA's matmul must sum a product alike whatever zero (masked) rows follow, so the codes cannot change."""
    import jax.numpy as jnp

    from qmoe_jax.quant import expert_hessians

    rng = np.random.default_rng(cols)
    tokens = rng.standard_normal((3, 4096, cols)).astype(np.float32)
    mask = np.zeros((3, 4096), bool)
    for expert, count in enumerate((2500, 3000, 2049)):
        mask[expert, :count] = rng.random(count) < 0.9
    full, full_counts = expert_hessians(jnp.asarray(tokens), jnp.asarray(mask))
    width = hessian_width(mask)
    assert width == 3072
    trimmed, counts = expert_hessians(jnp.asarray(tokens[:, :width]), jnp.asarray(mask[:, :width]))
    np.testing.assert_array_equal(np.asarray(counts), np.asarray(full_counts))
    np.testing.assert_array_equal(np.asarray(trimmed), np.asarray(full))
