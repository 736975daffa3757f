"""ops.matmul_routed: each token through the expert it names, against dense products, its jnp
twin and the gathered form other platforms run."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import compressed_data
from helpers.compressed_data import TOLERANCE
from helpers.compressed_data import cached_experts as _experts
from helpers.compressed_data import tokens as _tokens

from qmoe_jax.codec import CompressedExperts, CompressedMatrix
from qmoe_jax.kernels import bindings, ops

EXPERTS, ROWS, COLS = 5, 19, 37


def _assert_close(actual, expected, dtype):
    assert actual.dtype == dtype
    np.testing.assert_allclose(
        np.asarray(actual, np.float32), np.asarray(expected, np.float32), **TOLERANCE[dtype]
    )


def _routed_product(x, dense, expert_index) -> np.ndarray:
    """x [N, cols] times W_e [rows, cols] for each token's e; zero for e outside [0, E)."""
    index = np.asarray(expert_index, np.int64)
    kept = (index >= 0) & (index < len(dense))
    y = np.einsum("nc,nrc->nr", np.asarray(x, np.float32), dense[np.where(kept, index, 0)])
    return np.where(kept[:, None], y, 0.0)


def _index(tokens: int, seed: int = 0) -> np.ndarray:
    """Experts for ``tokens`` tokens, a few out of range (dropped), most experts named by several
    tokens so that the kernel's blocks of tokens run too."""
    rng = np.random.default_rng(seed)
    index = rng.integers(0, EXPERTS - 1, tokens)  # expert E-1 is never named
    index[rng.random(tokens) < 0.15] = -1
    if tokens > 2:
        index[1] = EXPERTS  # just past the end
    return index.astype(np.int32)


@pytest.mark.parametrize("isa", ops.cpu_isas())
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_routed_matches_dense_and_twin(dictionary, monkeypatch, isa, dtype):
    monkeypatch.setenv("QMOE_CPU_ISA", isa)
    stack, dense = _experts(EXPERTS, ROWS, COLS)
    routed = jax.jit(ops.matmul_routed, static_argnums=3)
    for tokens in (1, 3, 20, 70):
        x = _tokens((tokens, COLS), dtype)
        index = _index(tokens)
        expected = _routed_product(x, dense, index)
        y = routed(stack, x, index, dictionary)
        _assert_close(y, expected, dtype)
        dropped = (index < 0) | (index >= EXPERTS)
        assert not np.asarray(y, np.float32)[dropped].any()
        _assert_close(ops.matmul_routed_reference(stack, x, index, dictionary), expected, dtype)
    hlo = routed.lower(stack, x, index, dictionary).as_text()
    assert hlo.count("custom_call @qmoe_matmul_routed") == 1
    assert "custom_call @qmoe_matmul(" not in hlo and "custom_call @qmoe_matmul " not in hlo


@pytest.mark.parametrize("isa", ops.cpu_isas())
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_routed_input_gradient(dictionary, monkeypatch, isa, dtype):
    monkeypatch.setenv("QMOE_CPU_ISA", isa)
    stack, dense = _experts(EXPERTS, ROWS, COLS)
    for tokens in (3, 70):
        x = _tokens((tokens, COLS), dtype)
        index = _index(tokens, seed=tokens)
        cotangent = _tokens((tokens, ROWS), jnp.float32, seed=2)

        def loss(op, x, index=index, cotangent=cotangent):
            return (op(stack, x, index, dictionary).astype(jnp.float32) * cotangent).sum()

        grad = jax.jit(jax.grad(lambda x: loss(ops.matmul_routed, x)))(x)
        kept = (index >= 0) & (index < EXPERTS)
        expected = np.einsum("nr,nrc->nc", np.asarray(cotangent), dense[np.where(kept, index, 0)])
        _assert_close(grad, np.where(kept[:, None], expected, 0.0), dtype)
        assert not np.asarray(grad, np.float32)[~kept].any()
        twin = jax.grad(lambda x: loss(ops.matmul_routed_reference, x))(x)
        _assert_close(twin, grad, dtype)


def test_gathered_form_of_other_platforms(dictionary):
    """What platforms without the routed kernel run: the same products and the same zeros."""
    stack, dense = _experts(EXPERTS, ROWS, COLS)
    x = _tokens((20, COLS), jnp.float32)
    index = _index(20)
    gathered = jax.jit(ops._routed_gathered, static_argnums=3)(stack, x, index, dictionary)
    _assert_close(gathered, _routed_product(x, dense, index), jnp.float32)


def test_experts_no_token_names_are_not_read(dictionary):
    stack, dense = _experts(3, 13, 21)
    decreasing = np.asarray(stack.row_offsets[1]).copy()
    decreasing[5], decreasing[6] = decreasing[6], decreasing[5]
    narrow, _ = compressed_data.cached_matrix(13, 19)  # rows decode to 20 weights, not 22
    corrupt = CompressedExperts.stack(
        [
            stack[0],
            compressed_data.with_arrays(stack[1], row_offsets=decreasing),
            CompressedMatrix(narrow.codes, narrow.row_offsets, narrow.minmax, 21),
        ]
    )
    x = np.asarray(_tokens((4, 21), jnp.float32)).copy()
    x[2:] = np.nan  # dropped tokens' rows are not read either
    index = np.array([0, 0, -1, 7], np.int32)
    y = ops.matmul_routed(corrupt, x, index, dictionary)
    _assert_close(y, _routed_product(np.nan_to_num(x), dense, index), jnp.float32)
    grad = jax.grad(lambda x: ops.matmul_routed(corrupt, x, index, dictionary).sum())(
        jnp.asarray(x)
    )
    assert np.isfinite(np.asarray(grad)).all()
    x = np.nan_to_num(x)
    with pytest.raises(Exception, match=r"row_offsets of batch index 1 .* decrease at row 5"):
        ops.matmul_routed(corrupt, x, np.array([0, 1, 0, 0], np.int32), dictionary)
    with pytest.raises(Exception, match=r"row 0 of batch index 2 .* decodes to 20 weights"):
        ops.matmul_routed(corrupt, x, np.array([0, 2, 2, 2], np.int32), dictionary)
    with pytest.raises(Exception, match=r"row 0 of batch index 2 .* decodes to 20 weights"):
        jax.grad(lambda x: ops.matmul_routed(corrupt, x, np.array([2, 0, 0, 0]), dictionary).sum())(
            jnp.asarray(x)
        )


def test_wide_indexes_out_of_range_stay_dropped(dictionary):
    stack, dense = _experts(EXPERTS, ROWS, COLS)
    x = _tokens((4, COLS), jnp.float32)
    index = np.array([2, 2**32 + 1, -(2**40), 4], np.int64)  # would wrap to 1 and 0 as int32
    with jax.enable_x64(True):
        y = ops.matmul_routed(stack, x, jnp.asarray(index), dictionary)
    _assert_close(y, _routed_product(x, dense, np.array([2, -1, -1, 4])), jnp.float32)


def test_vmap_runs_each_entry(dictionary):
    stack, dense = _experts(EXPERTS, ROWS, COLS)
    x = _tokens((3, 6, COLS), jnp.float32)
    index = np.stack([_index(6, seed=s) for s in range(3)])
    y = jax.vmap(lambda x, i: ops.matmul_routed(stack, x, i, dictionary))(x, index)
    expected = np.stack([_routed_product(x[v], dense, index[v]) for v in range(3)])
    _assert_close(y, expected, jnp.float32)


def test_empty_calls(dictionary):
    stack, _ = _experts(EXPERTS, ROWS, COLS)
    y = ops.matmul_routed(stack, jnp.zeros((0, COLS)), np.zeros(0, np.int32), dictionary)
    assert y.shape == (0, ROWS)
    y = ops.matmul_routed(stack, jnp.ones((2, COLS)), np.array([-1, -1], np.int32), dictionary)
    assert y.shape == (2, ROWS) and not np.asarray(y).any()


def test_bad_inputs_raise_clear_errors(dictionary):
    stack, _ = _experts(EXPERTS, ROWS, COLS)
    x = _tokens((4, COLS), jnp.float32)
    index = np.zeros(4, np.int32)
    with pytest.raises(TypeError, match="needs a CompressedExperts stack"):
        ops.matmul_routed(stack[0], x, index, dictionary)
    with pytest.raises(TypeError, match="x_tokens must be float32 or bfloat16"):
        ops.matmul_routed(stack, x.astype(jnp.int32), index, dictionary)
    with pytest.raises(ValueError, match=r"takes \[N, 37\]"):
        ops.matmul_routed(stack, x[None], index, dictionary)
    with pytest.raises(ValueError, match=r"takes \[N, 37\]"):
        ops.matmul_routed(stack, x[:, :5], index, dictionary)
    with pytest.raises(TypeError, match="expert_index must be an integer array"):
        ops.matmul_routed(stack, x, index.astype(np.float32), dictionary)
    with pytest.raises(ValueError, match=r"expert_index must be int\[4\], one expert per token"):
        ops.matmul_routed(stack, x, index[:3], dictionary)
    masks, slots, words = bindings.dictionary_operands(dictionary)
    call = jax.ffi.ffi_call(bindings.MATMUL_ROUTED, jax.ShapeDtypeStruct((4, ROWS), jnp.float32))
    with pytest.raises(Exception, match=r"expert_index must be i32\[4\], one expert per token"):
        call(masks, slots, words, stack.codes, stack.row_offsets, stack.minmax, x, index[:3])
    with pytest.raises(Exception, match=r"minmax must be \[E, rows, 2\], an expert stack"):
        call(masks, slots, words, stack.codes[0], stack.row_offsets[0], stack.minmax[0], x, index)
    wrong = jax.ffi.ffi_call(
        bindings.MATMUL_ROUTED, jax.ShapeDtypeStruct((4, ROWS + 1), jnp.float32)
    )
    with pytest.raises(Exception, match=r"y must have 19 columns \(rows of minmax\)"):
        wrong(masks, slots, words, stack.codes, stack.row_offsets, stack.minmax, x, index)


def test_routed_kernels_are_on_the_cpu_only():
    assert bindings.has_routed_kernels("cpu")
    assert not bindings.has_routed_kernels("CUDA")
    assert not bindings.has_routed_kernels("gpu")
