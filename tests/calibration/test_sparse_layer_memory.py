"""compress_layer returns each expert group's freed memory to the system before the next group.

The main job's peak RSS (benchmarks/streaming.py) depends on it: glibc otherwise keeps the
freed blocks of every group in its heaps.
"""

import weakref

import ml_dtypes
import numpy as np
import pytest
from helpers.tiny_model import TINY

from qmoe_jax.calibration import sparse_layer
from qmoe_jax.calibration.expert_groups import ExpertCompressionConfig
from qmoe_jax.calibration.sparse_layer import LayerTokens, compress_layer
from qmoe_jax.codec import DEFAULT_P0, build_dictionary


@pytest.mark.parametrize("method", ["rtn", "gptq"])
def test_each_groups_arrays_are_dropped_and_trimmed_before_the_next_group(monkeypatch, method):
    rng = np.random.default_rng(0)
    d, f, experts = TINY.d_model, TINY.d_ff, TINY.num_experts
    # bfloat16 as T5X stores them (a float32 array may be aliased by jax until its first call's
    # compilation is done, which would say nothing about compress_layer)
    kernels = {
        "wi": rng.standard_normal((experts, d, f), np.float32).astype(ml_dtypes.bfloat16),
        "wo": rng.standard_normal((experts, f, d), np.float32).astype(ml_dtypes.bfloat16),
    }
    n = 64
    tokens = LayerTokens(
        inputs=rng.standard_normal((n, d), np.float32),
        expert=(np.arange(n) % experts).astype(np.int32),
        gate=rng.uniform(0.2, 1.0, n).astype(np.float32),
        kept=np.ones(n, bool),
        premask=np.ones(n, bool),
    )
    read = []  # weak references to each group's kernels, as read

    def read_kernels(group: range) -> dict[str, np.ndarray]:
        part = {name: kernel[group.start : group.stop].copy() for name, kernel in kernels.items()}
        read.append([weakref.ref(array) for array in part.values()])
        return part

    trims = []  # at each trim: how many groups were read, and whether their kernels were alive

    def release_free_memory() -> None:
        trims.append((len(read), [r() is not None for refs in read for r in refs]))

    monkeypatch.setattr(sparse_layer, "release_free_memory", release_free_memory)
    settings = ExpertCompressionConfig(method=method, group_size=2)
    compress_layer(
        TINY, settings, tokens, read_kernels, lambda quantized: build_dictionary(DEFAULT_P0)
    )

    assert [groups for groups, _ in trims] == [1, 2]  # once per group, after reading it
    for _, alive in trims:
        assert not any(alive), "a group's kernels were still referenced when memory was trimmed"
