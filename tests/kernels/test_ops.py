import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import compressed_data
from helpers.compressed_data import TOLERANCE
from helpers.compressed_data import cached_experts as _experts
from helpers.compressed_data import cached_matrix as _matrix
from helpers.compressed_data import tokens as _tokens

from qmoe_jax.codec import CompressedExperts, CompressedMatrix, decode_codes
from qmoe_jax.kernels import bindings, ops


def _assert_close(actual, expected, dtype):
    assert actual.dtype == dtype
    np.testing.assert_allclose(
        np.asarray(actual, np.float32), np.asarray(expected, np.float32), **TOLERANCE[dtype]
    )


# Each shape compiles the jnp twin; test_each_instruction_set checks the kernels on more token
# counts against the dense product, so the fast run keeps four shapes here.
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize(
    "rows,cols,tokens",
    [
        (1, 1, 1),
        pytest.param(5, 2, 3, marks=pytest.mark.slow),
        pytest.param(13, 21, 1, marks=pytest.mark.slow),
        (13, 21, 2),
        (37, 101, 17),
        pytest.param(64, 64, 40, marks=pytest.mark.slow),
        (3, 300, 65),
    ],
)
def test_matmul_matches_twin_and_dense(dictionary, dtype, rows, cols, tokens):
    w, dense = _matrix(rows, cols)
    x = _tokens((tokens, cols), dtype)
    expected = np.asarray(x, np.float32) @ dense.T
    y = jax.jit(ops.matmul, static_argnums=2)(w, x, dictionary)
    _assert_close(y, expected, dtype)
    _assert_close(ops.matmul_reference(w, x, dictionary), expected, dtype)


def test_dequantize_is_exact(dictionary):
    w, dense = _matrix(37, 101)
    for result in (ops.dequantize(w, dictionary), ops.dequantize_reference(w, dictionary)):
        assert result.dtype == jnp.bfloat16 and result.shape == (37, 101)
        np.testing.assert_array_equal(np.asarray(result, np.float32), dense)


def test_dequantize_agrees_with_reference_decoder(dictionary):
    w, _ = _matrix(13, 21)
    codes = decode_codes(w, dictionary)
    minmax = np.asarray(w.minmax)
    np.testing.assert_array_equal(
        np.asarray(ops.dequantize(w, dictionary), np.float32), compressed_data.dense(codes, minmax)
    )


@pytest.mark.parametrize("token_shape", [(), (1,), (2, 3), (0,)])
def test_matvec_keeps_leading_dims(dictionary, token_shape):
    w, dense = _matrix(13, 21)
    x = _tokens((*token_shape, 21), jnp.float32)
    y = ops.matvec(w, x, dictionary)
    assert y.shape == (*token_shape, 13)
    _assert_close(y, np.asarray(x) @ dense.T, jnp.float32)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_expert_stack_in_one_call(dictionary, dtype):
    stack, dense = _experts(4, 13, 21)
    x = _tokens((4, 5, 21), dtype)
    expected = np.einsum("ecj,erj->ecr", np.asarray(x, np.float32), dense)
    _assert_close(ops.matmul(stack, x, dictionary), expected, dtype)
    _assert_close(ops.matmul_reference(stack, x, dictionary), expected, dtype)
    _assert_close(ops.matvec(stack, x[:, 0], dictionary), expected[:, 0], dtype)
    np.testing.assert_array_equal(np.asarray(ops.dequantize(stack, dictionary), np.float32), dense)
    hlo = jax.jit(ops.matmul, static_argnums=2).lower(stack, x, dictionary).as_text()
    assert hlo.count("custom_call @qmoe_matmul") == 1


def test_vmap_folds_into_one_call(dictionary):
    w, dense = _matrix(13, 21)
    x = _tokens((3, 4, 21), jnp.float32)
    batched = jax.jit(jax.vmap(jax.vmap(lambda x: ops.matvec(w, x, dictionary))))
    _assert_close(batched(x), np.asarray(x) @ dense.T, jnp.float32)
    assert batched.lower(x).as_text().count("custom_call @qmoe_matmul") == 1


def test_vmap_over_a_stack_of_matrices(dictionary):
    stack, dense = _experts(3, 13, 21)
    x = _tokens((3, 2, 21), jnp.float32)

    def one(codes, row_offsets, minmax, x):
        return ops.matmul(CompressedMatrix(codes, row_offsets, minmax, 21), x, dictionary)

    y = jax.vmap(one)(stack.codes, stack.row_offsets, stack.minmax, x)
    _assert_close(y, np.einsum("ecj,erj->ecr", np.asarray(x), dense), jnp.float32)
    shared_x = jax.vmap(one, in_axes=(0, 0, 0, None))(
        stack.codes, stack.row_offsets, stack.minmax, x[0]
    )
    _assert_close(shared_x, np.einsum("cj,erj->ecr", np.asarray(x[0]), dense), jnp.float32)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_input_gradient_is_transposed_product(dictionary, dtype):
    w, dense = _matrix(37, 101)
    x = _tokens((5, 101), dtype)
    cotangent = _tokens((5, 37), jnp.float32, seed=2)

    def loss(op, x):
        return (op(w, x, dictionary).astype(jnp.float32) * cotangent).sum()

    grad = jax.jit(jax.grad(functools.partial(loss, ops.matmul)))(x)
    assert grad.dtype == dtype
    _assert_close(grad, np.asarray(cotangent) @ dense, dtype)
    _assert_close(jax.grad(functools.partial(loss, ops.matmul_reference))(x), grad, dtype)


def test_gradient_under_vmap_and_for_stacks(dictionary):
    stack, dense = _experts(3, 13, 21)
    x = _tokens((3, 4, 21), jnp.float32)
    grad = jax.grad(lambda x: ops.matmul(stack, x, dictionary).sum())(x)
    _assert_close(grad, np.broadcast_to(dense.sum(axis=1)[:, None], x.shape), jnp.float32)
    w, dense = _matrix(13, 21)
    per_example = jax.vmap(jax.grad(lambda x: ops.matvec(w, x, dictionary).sum()))(x[0])
    _assert_close(per_example, np.broadcast_to(dense.sum(axis=0), (4, 21)), jnp.float32)


def test_compressed_weights_are_frozen(dictionary):
    w, _ = _matrix(13, 21)
    x = _tokens((2, 21), jnp.float32)

    def loss(minmax):
        return ops.matmul(CompressedMatrix(w.codes, w.row_offsets, minmax, 21), x, dictionary).sum()

    grad = jax.grad(loss)(jnp.asarray(w.minmax))
    assert grad.dtype == jnp.bfloat16 and not np.asarray(grad, np.float32).any()


@pytest.mark.parametrize("isa", ops.cpu_isas())
@pytest.mark.parametrize("cols", [21, 64, 300])
def test_each_instruction_set(dictionary, monkeypatch, isa, cols):
    monkeypatch.setenv("QMOE_CPU_ISA", isa)
    w, dense = _matrix(19, cols, seed=3)
    for tokens in (1, 5, 20, 70):
        x = _tokens((tokens, cols), jnp.float32)
        _assert_close(ops.matmul(w, x, dictionary), np.asarray(x) @ dense.T, jnp.float32)
    for tokens in (1, 70):
        g = _tokens((tokens, 19), jnp.float32)
        x = _tokens((tokens, cols), jnp.float32)
        _, pullback = jax.vjp(lambda x: ops.matmul(w, x, dictionary), x)
        _assert_close(pullback(g)[0], np.asarray(g) @ dense, jnp.float32)
    np.testing.assert_array_equal(np.asarray(ops.dequantize(w, dictionary), np.float32), dense)


@pytest.mark.slow
def test_words_form_lists_each_entrys_nonzero_weights():
    """The compact form against the masks: positions, class, length and the table flags."""
    from qmoe_jax.codec import build_dictionary

    for p0, overflows, has_fourth in ((0.885, False, False), (0.8, False, True), (0.6, True, True)):
        masks = np.asarray(build_dictionary(p0).masks, np.uint32)
        words = bindings.words_from_masks(masks).astype(np.int64)
        assert bool(words[0] & bindings.WORDS_TABLE_OVERFLOWS) == overflows
        assert bool(words[0] & bindings.WORDS_TABLE_HAS_FOURTH) == has_fourth
        kind = (words >> bindings.WORD_CLASS_SHIFT) & 31
        np.testing.assert_array_equal(
            (words >> bindings.WORD_LENGTH_SHIFT) & 31, 2 * (masks[:, 0] >> 28)
        )
        plus_bits = masks[:, 0].astype(np.int64) & ((1 << 28) - 1)
        minus_bits = masks[:, 1].astype(np.int64)
        nonzeros = np.array(
            [bin(p).count("1") + bin(m).count("1") for p, m in zip(plus_bits, minus_bits)]
        )
        np.testing.assert_array_equal(kind == bindings.WORD_OVERFLOW_CLASS, nonzeros > 4)
        for entry in np.flatnonzero(nonzeros <= 4)[::97]:
            plus_count, minus_count = divmod(int(kind[entry]), 5)
            fields = [(int(words[entry]) >> (5 * i)) & 31 for i in range(4)]
            assert sum(1 << f for f in fields[:plus_count]) == plus_bits[entry]
            assert (
                sum(1 << f for f in fields[plus_count : plus_count + minus_count])
                == minus_bits[entry]
            )
            assert fields[:plus_count] == sorted(fields[:plus_count])


@pytest.mark.parametrize("isa", ops.cpu_isas())
@pytest.mark.parametrize("p0", [pytest.param(0.8, marks=pytest.mark.slow), 0.6])
def test_each_instruction_set_with_wider_dictionary_entries(monkeypatch, isa, p0):
    """Dictionaries for smaller p0: entries with 4 nonzero weights (0.8) and entries that overflow
    the compact form and the slots (0.6, which has entries of both kinds; each p0 is a dictionary
    build of seconds), which kernels read from the masks."""
    from qmoe_jax.codec import build_dictionary

    monkeypatch.setenv("QMOE_CPU_ISA", isa)
    dictionary = build_dictionary(p0)
    rng = np.random.default_rng(7)
    w, dense = compressed_data.matrix(rng, dictionary, 23, 301, p0=p0)
    for tokens in (1, 3, 20):
        x = _tokens((tokens, 301), jnp.float32)
        _assert_close(ops.matmul(w, x, dictionary), np.asarray(x) @ dense.T, jnp.float32)
    g = _tokens((20, 23), jnp.float32)
    _, pullback = jax.vjp(lambda x: ops.matmul(w, x, dictionary), _tokens((20, 301), jnp.float32))
    _assert_close(pullback(g)[0], np.asarray(g) @ dense, jnp.float32)
    np.testing.assert_array_equal(np.asarray(ops.dequantize(w, dictionary), np.float32), dense)


def test_empty_shapes(dictionary):
    w, _ = _matrix(13, 21)
    assert ops.matmul(w, jnp.zeros((0, 21)), dictionary).shape == (0, 13)
    no_rows, _ = _matrix(0, 21)
    assert ops.matmul(no_rows, _tokens((3, 21), jnp.float32), dictionary).shape == (3, 0)
    assert ops.dequantize(no_rows, dictionary).shape == (0, 21)
    grad = jax.grad(lambda x: ops.matmul(no_rows, x, dictionary).sum())(
        _tokens((3, 21), jnp.float32)
    )
    np.testing.assert_array_equal(grad, np.zeros((3, 21)))


def test_bad_inputs_raise_clear_errors(dictionary):
    w, _ = _matrix(13, 21)
    with pytest.raises(TypeError, match="float32 or bfloat16"):
        ops.matvec(w, jnp.zeros(21, jnp.int32), dictionary)
    with pytest.raises(ValueError, match="needs 21 columns"):
        ops.matvec(w, jnp.zeros(20), dictionary)
    with pytest.raises(ValueError, match=r"x_tokens must be \[N, cols\]"):
        ops.matmul(w, jnp.zeros((2, 3, 21)), dictionary)
    wide_codes = compressed_data.with_arrays(w, codes=np.asarray(w.codes, np.int32))
    with pytest.raises(TypeError, match="codes must be uint16"):
        ops.matvec(wide_codes, jnp.zeros(21), dictionary)


def test_corrupt_matrices_raise_naming_the_row(dictionary):
    w, _ = _matrix(13, 21)
    offsets = np.asarray(w.row_offsets).copy()
    offsets[5], offsets[6] = offsets[6], offsets[5]
    with pytest.raises(Exception, match="row_offsets decrease at row 5"):
        ops.matvec(compressed_data.with_arrays(w, row_offsets=offsets), jnp.zeros(21), dictionary)
    offsets = np.asarray(w.row_offsets).copy()
    offsets[-1] += 1000
    with pytest.raises(Exception, match=r"past the .* codewords"):
        ops.dequantize(compressed_data.with_arrays(w, row_offsets=offsets), dictionary)
    narrow, _ = _matrix(13, 19)
    wide = CompressedMatrix(narrow.codes, narrow.row_offsets, narrow.minmax, 21)
    with pytest.raises(Exception, match="row 0 decodes to 20 weights, expected 22"):
        ops.matmul(wide, jnp.zeros((3, 21)), dictionary)


def test_unknown_instruction_set_is_an_error(dictionary, monkeypatch):
    w, _ = _matrix(13, 21)
    monkeypatch.setenv("QMOE_CPU_ISA", "sse9")
    with pytest.raises(Exception, match="QMOE_CPU_ISA must be"):
        ops.matvec(w, jnp.zeros(21), dictionary)


def test_bfloat16_results_round_to_nearest_even(dictionary):
    w, dense = _matrix(37, 101)
    x = _tokens((4, 101), jnp.bfloat16)
    exact = (np.asarray(x, np.float32) @ dense.T).astype(ml_dtypes.bfloat16)
    mismatch = np.asarray(ops.matmul(w, x, dictionary)) != exact
    assert mismatch.mean() < 0.05  # only f32 summation-order ties differ


# Tokens in use per expert of a [5, 9, cols] dispatch buffer: single tokens
# (one-token dots), blocks, and counts the kernels clamp to [0, 9].
COUNTS = {
    "all_empty": [0, 0, 0, 0, 0],
    "one_expert": [0, 0, 1, 0, 0],
    "all_full": [9, 9, 9, 9, 9],
    "mixed": [3, 0, 9, 1, 7],
    "out_of_range": [-4, 12, 2**31 - 1, -(2**31), 5],
}


def _in_use(counts, tokens: int) -> np.ndarray:
    """bool[..., tokens]: token n of each entry is in use."""
    return np.arange(tokens) < np.clip(np.asarray(counts, np.int64), 0, tokens)[..., None]


def _masked_product(x, dense, counts) -> np.ndarray:
    """x [E, C, cols] times W [E, rows, cols], zero for tokens not in use."""
    y = np.einsum("ecj,erj->ecr", np.asarray(x, np.float32), dense)
    return np.where(_in_use(counts, x.shape[1])[..., None], y, 0.0)


@pytest.mark.parametrize("isa", ops.cpu_isas())
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_counts_compute_only_the_tokens_in_use(dictionary, monkeypatch, isa, dtype):
    monkeypatch.setenv("QMOE_CPU_ISA", isa)
    stack, dense = _experts(5, 19, 37)
    x = _tokens((5, 9, 37), dtype)
    matmul = jax.jit(ops.matmul, static_argnums=2)
    for counts in COUNTS.values():
        counts = np.asarray(counts, np.int32)
        expected = _masked_product(x, dense, counts)
        y = matmul(stack, x, dictionary, counts)
        _assert_close(y, expected, dtype)
        assert not np.asarray(y, np.float32)[~_in_use(counts, 9)].any()
        _assert_close(ops.matmul_reference(stack, x, dictionary, counts), expected, dtype)
    hlo = matmul.lower(stack, x, dictionary, counts).as_text()
    assert hlo.count("custom_call @qmoe_matmul") == 1


@pytest.mark.parametrize("isa", ops.cpu_isas())
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_input_gradient_with_counts(dictionary, monkeypatch, isa, dtype):
    monkeypatch.setenv("QMOE_CPU_ISA", isa)
    stack, dense = _experts(5, 19, 37)
    x = _tokens((5, 9, 37), dtype)
    cotangent = _tokens((5, 9, 19), jnp.float32, seed=2)

    def loss(op, x, counts):
        return (op(stack, x, dictionary, counts).astype(jnp.float32) * cotangent).sum()

    kernel_grad = jax.jit(jax.grad(functools.partial(loss, ops.matmul)))
    twin_grad = jax.grad(functools.partial(loss, ops.matmul_reference))
    for counts in COUNTS.values():
        counts = jnp.asarray(counts, jnp.int32)
        grad = kernel_grad(x, counts)
        assert grad.dtype == dtype
        in_use = _in_use(counts, 9)
        expected = np.einsum("ecr,erj->ecj", np.asarray(cotangent), dense)
        _assert_close(grad, np.where(in_use[..., None], expected, 0.0), dtype)
        assert not np.asarray(grad, np.float32)[~in_use].any()
        _assert_close(twin_grad(x, counts), grad, dtype)


def test_counts_under_vmap(dictionary):
    stack, dense = _experts(3, 13, 21)
    x = _tokens((4, 3, 6, 21), jnp.float32)
    counts = np.random.default_rng(0).integers(-1, 8, (4, 3)).astype(np.int32)
    expected = np.stack([_masked_product(x[v], dense, counts[v]) for v in range(4)])
    per_step = jax.jit(jax.vmap(lambda x, counts: ops.matmul(stack, x, dictionary, counts)))
    _assert_close(per_step(x, counts), expected, jnp.float32)
    assert per_step.lower(x, counts).as_text().count("custom_call @qmoe_matmul") == 1
    shared = jax.vmap(lambda x: ops.matmul(stack, x, dictionary, counts[0]))(x)
    expected_shared = np.stack([_masked_product(step, dense, counts[0]) for step in x])
    _assert_close(shared, expected_shared, jnp.float32)

    def one(codes, row_offsets, minmax, x, count):
        w = CompressedMatrix(codes, row_offsets, minmax, 21)
        return ops.matmul(w, x, dictionary, count)

    matrices = jax.vmap(one)(stack.codes, stack.row_offsets, stack.minmax, x[0], counts[0])
    _assert_close(matrices, expected[0], jnp.float32)
    grads = jax.vmap(jax.grad(lambda x, c: ops.matmul(stack, x, dictionary, c).sum()))(x, counts)
    row_sums = np.broadcast_to(dense.sum(axis=1)[None, :, None], x.shape)
    _assert_close(grads, np.where(_in_use(counts, 6)[..., None], row_sums, 0.0), jnp.float32)


def test_matvec_counts_entries_over_the_flattened_dims(dictionary):
    stack, dense = _experts(4, 13, 21)
    x = _tokens((4, 21), jnp.float32)
    used = np.array([1, 0, 0, 1], np.int32)
    expected = np.einsum("ej,erj->er", np.asarray(x), dense) * used[:, None]
    _assert_close(ops.matvec(stack, x, dictionary, used), expected, jnp.float32)
    x = _tokens((4, 2, 3, 21), jnp.float32)
    counts = np.array([6, 0, 4, 2], np.int32)
    expected = _masked_product(x.reshape(4, 6, 21), dense, counts).reshape(4, 2, 3, 13)
    _assert_close(ops.matvec(stack, x, dictionary, counts), expected, jnp.float32)
    _assert_close(ops.matvec_reference(stack, x, dictionary, counts), expected, jnp.float32)
    w, dense = _matrix(13, 21)
    y = ops.matvec(w, x[0], dictionary, 4)
    _assert_close(
        y, np.where(_in_use(4, 6).reshape(2, 3, 1), np.asarray(x[0]) @ dense.T, 0.0), jnp.float32
    )


def test_experts_without_tokens_are_not_read(dictionary):
    stack, dense = _experts(3, 13, 21)
    decreasing = np.asarray(stack.row_offsets[1]).copy()
    decreasing[5], decreasing[6] = decreasing[6], decreasing[5]
    narrow, _ = _matrix(13, 19)  # its rows decode to 20 weights, not 22
    corrupt = CompressedExperts.stack(
        [
            stack[0],
            compressed_data.with_arrays(stack[1], row_offsets=decreasing),
            CompressedMatrix(narrow.codes, narrow.row_offsets, narrow.minmax, 21),
        ]
    )
    x = np.asarray(_tokens((3, 4, 21), jnp.float32)).copy()
    x[:, 2:] = np.nan  # slots not in use are not read either
    counts = np.array([2, 0, 0], np.int32)
    y = ops.matmul(corrupt, x, dictionary, counts)
    _assert_close(y, _masked_product(np.nan_to_num(x), dense, counts), jnp.float32)
    grad = jax.grad(lambda x: ops.matmul(corrupt, x, dictionary, counts).sum())(jnp.asarray(x))
    assert np.isfinite(np.asarray(grad)).all()
    with pytest.raises(Exception, match=r"row_offsets of batch index 1 .* decrease at row 5"):
        ops.matmul(corrupt, x, dictionary, np.array([2, 1, 0], np.int32))
    with pytest.raises(Exception, match=r"row 0 of batch index 2 .* decodes to 20 weights"):
        ops.matmul(corrupt, x, dictionary, np.array([2, 0, 1], np.int32))


def test_bad_counts_raise_clear_errors(dictionary):
    stack, dense = _experts(3, 13, 21)
    x = _tokens((3, 4, 21), jnp.float32)
    with pytest.raises(TypeError, match="counts must be an integer array"):
        ops.matmul(stack, x, dictionary, np.ones(3, np.float32))
    with pytest.raises(ValueError, match=r"counts must be int32\[3\], one count per expert"):
        ops.matmul(stack, x, dictionary, np.ones((3, 1), np.int32))
    w, _ = _matrix(13, 21)
    with pytest.raises(ValueError, match="counts must be an int32 scalar"):
        ops.matmul(w, x[0], dictionary, np.ones(3, np.int32))
    narrow = np.array([255, 0, 3], np.uint8)  # clamped before the cast to int32
    _assert_close(
        ops.matmul(stack, x, dictionary, narrow), _masked_product(x, dense, narrow), jnp.float32
    )
    masks, slots, words = bindings.dictionary_operands(dictionary)
    call = jax.ffi.ffi_call("qmoe_matmul", jax.ShapeDtypeStruct((3, 4, 13), jnp.float32))
    with pytest.raises(Exception, match=r"counts must have shape \[B...\] .* B... = \[3\]"):
        call(
            masks,
            slots,
            words,
            stack.codes,
            stack.row_offsets,
            stack.minmax,
            x,
            np.ones(2, np.int32),
        )


def test_auto_runs_the_first_instruction_set(dictionary, monkeypatch):
    """QMOE_CPU_ISA unset or "auto" takes ``cpu_isas()[0]``; the instruction sets add in different
    orders, so the bits tell which ran (where only one differs from the first, that one is the
    check)."""
    w, _ = _matrix(19, 300, seed=3)
    x = _tokens((2, 300), jnp.float32)
    results = {}
    for isa in ["", "auto", *ops.cpu_isas()]:
        monkeypatch.setenv("QMOE_CPU_ISA", isa)
        results[isa] = np.asarray(ops.matmul(w, x, dictionary))
    first = results[ops.cpu_isas()[0]]
    np.testing.assert_array_equal(results[""], first)
    np.testing.assert_array_equal(results["auto"], first)
    assert any(not np.array_equal(results[isa], first) for isa in ops.cpu_isas()[1:])
