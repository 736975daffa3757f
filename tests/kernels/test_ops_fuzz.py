"""Property and fuzz tests of the kernels: random well-formed matrices agree with
the dense product; garbage operands give an error, never a crash; garbage
counts are clamped to [0, N]."""

import json
import os

import hypothesis.strategies as st
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import compressed_data
from helpers.child_process import run_python
from hypothesis import given, settings

from qmoe_jax.codec import build_dictionary
from qmoe_jax.kernels import ops


@settings(max_examples=25, deadline=None)
@given(
    rows=st.integers(1, 12),
    cols=st.integers(1, 70),
    tokens=st.integers(1, 20),
    count=st.integers(-3, 23),
    p0=st.sampled_from([0.5, 0.885, 0.97]),
    seed=st.integers(0, 2**31),
)
@pytest.mark.slow
def test_random_matrices_match_the_dense_product(rows, cols, tokens, count, p0, seed):
    dictionary = build_dictionary(0.885)
    rng = np.random.default_rng(seed)
    w, dense = compressed_data.matrix(rng, dictionary, rows, cols, p0)
    x = rng.standard_normal((tokens, cols)).astype(np.float32)
    np.testing.assert_allclose(ops.matmul(w, x, dictionary), x @ dense.T, rtol=1e-5, atol=1e-5)
    in_use = (np.arange(tokens) < count)[:, None]
    np.testing.assert_allclose(
        ops.matmul(w, x, dictionary, count), np.where(in_use, x @ dense.T, 0), rtol=1e-5, atol=1e-5
    )
    g = rng.standard_normal((tokens, rows)).astype(np.float32)
    dx = ops.bindings.matmul_transposed_call(
        ops.bindings.Static(dictionary, cols),
        w.codes,
        w.row_offsets,
        jnp.asarray(w.minmax),
        g,
        np.int32(count),
    )
    np.testing.assert_allclose(dx, np.where(in_use, g @ dense, 0), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(ops.dequantize(w, dictionary), np.float32), dense)


FUZZ_PROGRAM = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "helpers", "kernel_fuzz.py"
)


@pytest.mark.slow
def test_garbage_operands_error_and_never_crash():
    run = run_python([FUZZ_PROGRAM], timeout=900, ISAS=json.dumps(ops.cpu_isas()))
    assert run.returncode == 0, f"fuzz run died ({run.returncode}): {run.stderr[-3000:]}"
    result = json.loads(run.stdout.strip().splitlines()[-1])
    outcomes = result["outcomes"]
    assert outcomes.get("error", 0) > 0 and outcomes.get("ok", 0) > 0, result
    assert outcomes.get("exact", 0) > 0 and outcomes.get("wrong", 0) == 0, result
    for message in result["messages"]:
        assert "qmoe_" in message, message
