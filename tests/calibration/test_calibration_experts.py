"""Token bookkeeping of a sparse layer: sorting tokens by expert, the Hessian token cap, gathering
a group, and the per-expert widths its Hessians and forward run on."""

import numpy as np
import pytest

from qmoe_jax.calibration.expert_groups import (
    FORWARD_MIN_TOKENS,
    gather_group,
    hessian_token_cap,
    sort_by_expert,
    token_width,
)


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
    from qmoe_jax.calibration.expert_groups import (
        HESSIAN_COPIES,
        WEIGHT_COPIES,
        ExpertCompressionConfig,
    )

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


def test_a_sequential_call_counts_one_experts_working_copies_per_device():
    from qmoe_jax.calibration.expert_groups import (
        SEQUENTIAL_HESSIAN_COPIES,
        SEQUENTIAL_WEIGHT_COPIES,
        ExpertCompressionConfig,
    )

    rows, cols = 768, 3072
    working = 4 * cols * (SEQUENTIAL_HESSIAN_COPIES * cols + SEQUENTIAL_WEIGHT_COPIES * rows)
    held = 4 * cols * (cols + rows) + rows * cols  # each expert's Hessian, weights and codes

    settings = ExpertCompressionConfig(group_size=16, gptq_memory=working + 6 * held)
    assert settings.experts_per_call(rows, cols, 16, sequential=True) == 6  # 6 fit: three calls
    assert settings.experts_per_call(rows, cols, 12, sequential=True) == 6
    assert (
        settings.experts_per_call(rows, cols, 16, sequential=False) == 2
    )  # vmapped: every expert's copies
    # Two devices each run one expert at a time: two working sets, room for 2 experts' inputs.
    assert settings.experts_per_call(rows, cols, 12, sequential=True, devices=2) == 2
    assert (
        ExpertCompressionConfig(gptq_memory=working - 1).experts_per_call(
            rows, cols, 16, sequential=True
        )
        == 1
    )
    roomy = ExpertCompressionConfig(group_size=16, gptq_memory=1 << 40)
    assert (
        roomy.experts_per_call(rows, cols, 16, sequential=True) == 16
    )  # never past the group size


@pytest.mark.parametrize(
    ("last", "size", "width"),
    [
        (0, 16, 8),  # no kept token: the smallest width
        (5, 5, 5),  # never past the buffer
        (8, 1024, 8),
        (9, 1024, 9),
        (100, 1024, 104),
        (700, 1024, 704),
        (1000, 1024, 1024),
        (2049, 4096, 2304),
        (3000, 4096, 3072),
        (4096, 4096, 4096),
    ],
)
def test_token_width_covers_every_kept_token(last, size, width):
    mask = np.zeros((3, size), bool)
    if last:
        mask[1, last - 1] = True  # the last kept token of the group, in its middle expert
        mask[0, : last // 2] = True
    assert token_width(mask) == width
    assert token_width(mask[1]) == width  # one expert's row
    assert width >= last and (width - last) * 8 <= max(
        last, 64
    )  # at most 12.5% over (beyond tiny widths)


def test_token_width_floor_stays_inside_the_buffer():
    mask = np.zeros(1024, bool)
    mask[:10] = True
    assert token_width(mask) == 10
    assert token_width(mask, floor=64) == 64
    assert token_width(mask[:32], floor=64) == 32  # a buffer narrower than the floor


def _uneven_group(cols: int, counts, size: int, seed: int):
    rng = np.random.default_rng(seed)
    tokens = np.zeros((len(counts), size, cols), np.float32)
    mask = np.zeros((len(counts), size), bool)
    for expert, count in enumerate(counts):
        tokens[expert, :count] = rng.standard_normal((count, cols))
        mask[expert, :count] = rng.random(count) < 0.9
    return tokens, mask


@pytest.mark.parametrize("cols", [768, pytest.param(3072, marks=pytest.mark.slow)])
def test_hessians_on_each_experts_own_width_match_the_padded_group(cols):
    """The calibration pass computes each expert's Hessian on its own ``token_width``, not the
    group's padded
    length: the same sums up to float rounding (the matmul splits a different number of rows)."""
    import jax.numpy as jnp

    from qmoe_jax.quant import expert_hessians, hessian

    tokens, mask = _uneven_group(cols, (2500, 300, 517, 64), 4096, cols)
    padded, _ = expert_hessians(jnp.asarray(tokens), jnp.asarray(mask))
    for expert in range(len(tokens)):
        width = token_width(mask[expert])
        own = hessian(jnp.asarray(tokens[expert, :width]), jnp.asarray(mask[expert, :width]))
        scale = float(jnp.abs(padded[expert]).max())
        np.testing.assert_allclose(
            np.asarray(own), np.asarray(padded[expert]), rtol=0, atol=1e-5 * scale
        )


def test_expert_outputs_on_their_own_width_match_the_padded_buffer():
    """An expert's forward runs on its tokens' width (at least FORWARD_MIN_TOKENS), zero past it;
    the rows it computes equal the padded buffer's (bit for bit on XLA:CPU from 64 rows on, as
    measured; checked to rounding here)."""
    import jax.numpy as jnp

    from qmoe_jax.calibration.expert_groups import _expert_outputs
    from qmoe_jax.calibration.sublayers import expert_outputs
    from qmoe_jax.models import get_config

    config = get_config("switch-mini-8")
    rng = np.random.default_rng(3)
    in_kernels = {
        "wi": jnp.asarray(
            rng.standard_normal((config.d_model, config.d_ff)).astype(np.float32) * 0.1
        )
    }
    out_kernel = jnp.asarray(
        rng.standard_normal((config.d_ff, config.d_model)).astype(np.float32) * 0.1
    )
    for count in (0, 5, 200, 1024):
        inputs = np.zeros((1024, config.d_model), np.float32)
        inputs[:count] = rng.standard_normal((count, config.d_model))
        gates = np.zeros(1024, np.float32)
        gates[:count] = rng.random(count)
        valid = np.arange(1024) < count
        padded = np.asarray(
            expert_outputs(config, in_kernels, out_kernel, jnp.asarray(inputs), jnp.asarray(gates))
        )
        own = _expert_outputs(config, in_kernels, out_kernel, inputs, gates, valid)
        width = token_width(valid, floor=FORWARD_MIN_TOKENS)
        assert width >= max(count, 1) and width >= min(FORWARD_MIN_TOKENS, 1024)
        np.testing.assert_allclose(own[valid], padded[valid], rtol=1e-6, atol=1e-6)
        assert not own[width:].any()
