"""The CUDA handlers (xla_ffi/cuda_kernels.h) against the jnp twins, the dense
product and the CPU handlers.

Needs a GPU backend and an extension built with QMOE_CUDA=ON; skipped
otherwise (benchmarks/gpu_check.sh builds and runs them on a GPU machine).
"""

import functools
import json
import subprocess
import textwrap

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import compressed_data
from helpers.child_process import run_python
from helpers.compressed_data import TOLERANCE
from helpers.compressed_data import cached_experts as _experts
from helpers.compressed_data import cached_matrix as _matrix
from helpers.compressed_data import tokens as _tokens
from hypothesis import given, settings

import qmoe_jax_ext
from qmoe_jax.codec import CompressedMatrix, build_dictionary
from qmoe_jax.kernels import bindings, ops

TARGETS = {"qmoe_matmul", "qmoe_matmul_t", "qmoe_dequantize"}


def _skip_reason() -> str | None:
    if jax.default_backend() != "gpu":
        return f"needs a GPU backend; jax.default_backend() is {jax.default_backend()!r}"
    if not ops.has_cuda_kernels():
        return (
            "the extension was built without CUDA; build it with -DQMOE_CUDA=ON "
            "(benchmarks/gpu_check.sh)"
        )
    return None


needs_gpu = pytest.mark.skipif(_skip_reason() is not None, reason=str(_skip_reason()))


def test_cuda_targets_registered_iff_built_with_cuda():
    registrations = qmoe_jax_ext.registrations()
    # GPTQ's block kernel, the Cholesky's base kernel, the dense products and the routed
    # products are CPU-only
    cpu_only = {
        "qmoe_gptq_block",
        "qmoe_cholesky_base",
        "qmoe_dense_matmul",
        "qmoe_dense_matmul_t",
        "qmoe_matmul_routed",
        "qmoe_matmul_routed_t",
    }
    assert set(registrations["cpu"]) == TARGETS | cpu_only
    assert ("CUDA" in registrations) == ops.has_cuda_kernels()
    if ops.has_cuda_kernels():
        assert set(registrations["CUDA"]) == TARGETS


def _assert_close(actual, expected, dtype):
    """Within TOLERANCE, atol relative to the largest |expected| (long f32 sums
    in different orders differ by more than 1e-5 near zero)."""
    assert actual.dtype == dtype
    expected = np.asarray(expected, np.float32)
    tolerance = dict(TOLERANCE[dtype])
    tolerance["atol"] *= max(1.0, float(np.abs(expected).max(initial=0.0)))
    np.testing.assert_allclose(np.asarray(actual, np.float32), expected, **tolerance)


def _on_cpu(fn, *args):
    cpu = jax.devices("cpu")[0]
    return fn(*jax.device_put(args, cpu))


# Shapes cover every team size (codewords per row from <1 to ~150), token
# tiles of 1..8 with a partial last tile, odd cols, f32 rows too wide to stage
# in shared memory (13001 * 4 bytes > 48 KiB), and more rows than one block.
SHAPES = [
    (1, 1, 1),
    (5, 2, 3),
    (13, 21, 1),
    (13, 21, 2),
    (37, 101, 17),
    (64, 64, 40),
    (3, 300, 33),
    (300, 3, 5),
    (700, 65, 4),
    (40, 3001, 9),
    (3, 13001, 2),
]


@needs_gpu
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("rows,cols,tokens", SHAPES)
def test_matmul_matches_twin_dense_and_cpu(dictionary, dtype, rows, cols, tokens):
    w, dense = _matrix(rows, cols)
    x = _tokens((tokens, cols), dtype)
    expected = np.asarray(x, np.float32) @ dense.T
    matmul = jax.jit(ops.matmul, static_argnums=2)
    y = matmul(w, x, dictionary)
    assert y.devices() == {jax.devices("gpu")[0]}
    _assert_close(y, expected, dtype)
    _assert_close(ops.matmul_reference(w, x, dictionary), expected, dtype)
    _assert_close(y, _on_cpu(lambda w, x: matmul(w, x, dictionary), w, x), dtype)


@needs_gpu
@settings(max_examples=20, deadline=None)
@given(
    rows=st.integers(1, 40),
    cols=st.integers(1, 300),
    tokens=st.integers(1, 20),
    p0=st.sampled_from([0.5, 0.885, 0.97]),
    seed=st.integers(0, 2**31),
)
def test_random_matrices_match_the_dense_product(rows, cols, tokens, p0, seed):
    dictionary = build_dictionary(0.885)
    rng = np.random.default_rng(seed)
    w, dense = compressed_data.matrix(rng, dictionary, rows, cols, p0)
    x = rng.standard_normal((tokens, cols)).astype(np.float32)
    _assert_close(ops.matmul(w, x, dictionary), x @ dense.T, jnp.float32)
    g = rng.standard_normal((tokens, rows)).astype(np.float32)
    dx = bindings.matmul_transposed_call(
        bindings.Static(dictionary, cols),
        w.codes,
        w.row_offsets,
        w.minmax,
        g,
        bindings.all_tokens(g),
    )
    _assert_close(dx, g @ dense, jnp.float32)
    np.testing.assert_array_equal(np.asarray(ops.dequantize(w, dictionary), np.float32), dense)


@needs_gpu
@pytest.mark.parametrize("rows,cols", [(1, 1), (13, 21), (37, 101), (300, 3), (40, 3001)])
def test_dequantize_is_exact(dictionary, rows, cols):
    w, dense = _matrix(rows, cols)
    for result in (ops.dequantize(w, dictionary), ops.dequantize_reference(w, dictionary)):
        assert result.dtype == jnp.bfloat16 and result.shape == (rows, cols)
        np.testing.assert_array_equal(np.asarray(result, np.float32), dense)


@needs_gpu
@pytest.mark.parametrize("token_shape", [(), (1,), (2, 3), (0,)])
def test_matvec_keeps_leading_dims(dictionary, token_shape):
    w, dense = _matrix(13, 21)
    x = _tokens((*token_shape, 21), jnp.float32)
    y = ops.matvec(w, x, dictionary)
    assert y.shape == (*token_shape, 13)
    _assert_close(y, np.asarray(x) @ dense.T, jnp.float32)


@needs_gpu
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_expert_stack_in_one_call(dictionary, dtype):
    stack, dense = _experts(4, 13, 21)
    x = _tokens((4, 5, 21), dtype)
    expected = np.einsum("ecj,erj->ecr", np.asarray(x, np.float32), dense)
    _assert_close(ops.matmul(stack, x, dictionary), expected, dtype)
    _assert_close(ops.matvec(stack, x[:, 0], dictionary), expected[:, 0], dtype)
    np.testing.assert_array_equal(np.asarray(ops.dequantize(stack, dictionary), np.float32), dense)
    hlo = jax.jit(ops.matmul, static_argnums=2).lower(stack, x, dictionary).as_text()
    assert hlo.count("custom_call @qmoe_matmul") == 1


@needs_gpu
def test_vmap_over_tokens_and_matrices(dictionary):
    w, dense = _matrix(13, 21)
    x = _tokens((3, 4, 21), jnp.float32)
    # Matrix broadcast over both vmapped axes: folded into one token dim.
    batched = jax.jit(jax.vmap(jax.vmap(lambda x: ops.matvec(w, x, dictionary))))
    _assert_close(batched(x), np.asarray(x) @ dense.T, jnp.float32)
    stack, stack_dense = _experts(3, 13, 21)

    def one(codes, row_offsets, minmax, x):
        return ops.matmul(CompressedMatrix(codes, row_offsets, minmax, 21), x, dictionary)

    y = jax.vmap(one)(stack.codes, stack.row_offsets, stack.minmax, x[:, :2])
    _assert_close(y, np.einsum("ecj,erj->ecr", np.asarray(x[:, :2]), stack_dense), jnp.float32)
    # x broadcast over the matrices.
    shared_x = jax.vmap(one, in_axes=(0, 0, 0, None))(
        stack.codes, stack.row_offsets, stack.minmax, x[0]
    )
    _assert_close(shared_x, np.einsum("cj,erj->ecr", np.asarray(x[0]), stack_dense), jnp.float32)
    # Two leading dims, the stack broadcast along the outer one.
    outer = _tokens((2, 3, 5, 21), jnp.bfloat16)
    y = jax.vmap(lambda x: ops.matmul(stack, x, dictionary))(outer)
    expected = np.einsum("vecj,erj->vecr", np.asarray(outer, np.float32), stack_dense)
    _assert_close(y, expected, jnp.bfloat16)


@needs_gpu
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("rows,cols,tokens", [(37, 101, 5), (300, 3, 9), (40, 3001, 3)])
def test_input_gradient_is_transposed_product(dictionary, dtype, rows, cols, tokens):
    w, dense = _matrix(rows, cols)
    x = _tokens((tokens, cols), dtype)
    cotangent = _tokens((tokens, rows), jnp.float32, seed=2)

    def loss(op, x):
        return (op(w, x, dictionary).astype(jnp.float32) * cotangent).sum()

    grad = jax.jit(jax.grad(functools.partial(loss, ops.matmul)))(x)
    assert grad.dtype == dtype
    expected = np.asarray(cotangent.astype(dtype), np.float32) @ dense
    _assert_close(grad, expected, dtype)
    _assert_close(jax.grad(functools.partial(loss, ops.matmul_reference))(x), grad, dtype)


@needs_gpu
def test_gradient_under_vmap_and_for_stacks(dictionary):
    stack, dense = _experts(3, 13, 21)
    x = _tokens((3, 4, 21), jnp.float32)
    grad = jax.grad(lambda x: ops.matmul(stack, x, dictionary).sum())(x)
    _assert_close(grad, np.broadcast_to(dense.sum(axis=1)[:, None], x.shape), jnp.float32)
    w, dense = _matrix(13, 21)
    per_example = jax.vmap(jax.grad(lambda x: ops.matvec(w, x, dictionary).sum()))(x[0])
    _assert_close(per_example, np.broadcast_to(dense.sum(axis=0), (4, 21)), jnp.float32)


@needs_gpu
def test_empty_shapes(dictionary):
    w, _ = _matrix(13, 21)
    assert ops.matmul(w, jnp.zeros((0, 21)), dictionary).shape == (0, 13)
    no_rows, _ = _matrix(0, 21)
    assert ops.matmul(no_rows, _tokens((3, 21), jnp.float32), dictionary).shape == (3, 0)
    assert ops.dequantize(no_rows, dictionary).shape == (0, 21)
    for dtype in (jnp.float32, jnp.bfloat16):
        grad = jax.grad(lambda x: ops.matmul(no_rows, x, dictionary).astype(jnp.float32).sum())(
            _tokens((3, 21), dtype)
        )
        np.testing.assert_array_equal(np.asarray(grad, np.float32), np.zeros((3, 21)))


@needs_gpu
def test_bfloat16_results_round_to_nearest_even(dictionary):
    w, dense = _matrix(37, 101)
    x = _tokens((4, 101), jnp.bfloat16)
    exact = (np.asarray(x, np.float32) @ dense.T).astype(ml_dtypes.bfloat16)
    mismatch = np.asarray(ops.matmul(w, x, dictionary)) != exact
    assert mismatch.mean() < 0.05  # only f32 summation-order ties differ


def _in_use(counts, tokens: int) -> np.ndarray:
    """bool[..., tokens]: token n of each entry is in use."""
    return np.arange(tokens) < np.clip(np.asarray(counts, np.int64), 0, tokens)[..., None]


def _masked_product(x, dense, counts) -> np.ndarray:
    """x [E, C, cols] times W [E, rows, cols], zero for tokens not in use."""
    y = np.einsum("ecj,erj->ecr", np.asarray(x, np.float32), dense)
    return np.where(_in_use(counts, x.shape[1])[..., None], y, 0.0)


# (experts, rows, cols, slots): tiles of 8 with a partial last one, a stack
# wider than one ballot window (32) and one count pass (256 entries), x too
# wide to stage.
COUNTS_SHAPES = [(5, 37, 101, 11), (70, 13, 21, 3), (300, 5, 7, 2), (3, 40, 13001, 2)]


@needs_gpu
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("experts,rows,cols,slots", COUNTS_SHAPES)
def test_counts_match_twin_dense_and_cpu(dictionary, dtype, experts, rows, cols, slots):
    stack, dense = _experts(experts, rows, cols)
    x = _tokens((experts, slots, cols), dtype)
    rng = np.random.default_rng(experts)
    cases = {
        "all_empty": np.zeros(experts, np.int32),
        "one_expert": (np.arange(experts) == experts // 2).astype(np.int32),
        "last_expert_full": np.where(np.arange(experts) == experts - 1, slots, 0).astype(np.int32),
        "all_full": np.full(experts, slots, np.int32),
        "random": rng.integers(-2, slots + 3, experts).astype(np.int32),
    }
    matmul = jax.jit(ops.matmul, static_argnums=2)
    for counts in cases.values():
        expected = _masked_product(x, dense, counts)
        y = matmul(stack, x, dictionary, counts)
        _assert_close(y, expected, dtype)
        assert not np.asarray(y, np.float32)[~_in_use(counts, slots)].any()
        _assert_close(
            y, _on_cpu(lambda w, x, c: matmul(w, x, dictionary, c), stack, x, counts), dtype
        )
        _assert_close(ops.matmul_reference(stack, x, dictionary, counts), expected, dtype)


@needs_gpu
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_input_gradient_with_counts(dictionary, dtype):
    stack, dense = _experts(70, 13, 21)
    x = _tokens((70, 9, 21), dtype)
    cotangent = _tokens((70, 9, 13), jnp.float32, seed=2)
    counts = np.random.default_rng(0).integers(-1, 11, 70).astype(np.int32)
    counts[:40] = 0

    def loss(op, x):
        return (op(stack, x, dictionary, counts).astype(jnp.float32) * cotangent).sum()

    grad = jax.jit(jax.grad(functools.partial(loss, ops.matmul)))(x)
    assert grad.dtype == dtype
    in_use = _in_use(counts, 9)
    expected = np.einsum("ecr,erj->ecj", np.asarray(cotangent.astype(dtype), np.float32), dense)
    _assert_close(grad, np.where(in_use[..., None], expected, 0.0), dtype)
    assert not np.asarray(grad, np.float32)[~in_use].any()
    _assert_close(jax.grad(functools.partial(loss, ops.matmul_reference))(x), grad, dtype)


@needs_gpu
def test_counts_under_vmap(dictionary):
    stack, dense = _experts(3, 13, 21)
    x = _tokens((4, 3, 6, 21), jnp.float32)
    counts = np.random.default_rng(0).integers(-1, 8, (4, 3)).astype(np.int32)
    # Counts mapped along with x: the outer dim is not folded.
    per_step = jax.vmap(lambda x, c: ops.matmul(stack, x, dictionary, c))(x, counts)
    expected = np.stack([_masked_product(x[v], dense, counts[v]) for v in range(4)])
    _assert_close(per_step, expected, jnp.float32)
    # One matrix, counts broadcast over the vmapped dim: folded into the tokens.
    w, w_dense = _matrix(13, 21)
    folded = jax.vmap(lambda x: ops.matmul(w, x, dictionary, 4))(x[:, 0])
    product = np.einsum("vcj,rj->vcr", np.asarray(x[:, 0]), w_dense)
    _assert_close(folded, np.where(_in_use(4, 6)[None, :, None], product, 0.0), jnp.float32)
    grads = jax.vmap(jax.grad(lambda x, c: ops.matmul(stack, x, dictionary, c).sum()))(x, counts)
    row_sums = np.broadcast_to(dense.sum(axis=1)[None, :, None], x.shape)
    _assert_close(grads, np.where(_in_use(counts, 6)[..., None], row_sums, 0.0), jnp.float32)


def _corrupt_cases():
    """(13×21 matrix, its rows that fail to decode, message of the CPU handlers)."""
    w, _ = _matrix(13, 21)
    offsets = np.asarray(w.row_offsets).copy()
    offsets[5], offsets[6] = offsets[6], offsets[5]  # rows 4 and 6 get too many codes, 5 none
    decreasing = compressed_data.with_arrays(w, row_offsets=offsets)
    offsets = np.asarray(w.row_offsets).copy()
    offsets[-1] += 1000
    past_the_end = compressed_data.with_arrays(w, row_offsets=offsets)
    narrow, _ = _matrix(13, 19)
    wide = CompressedMatrix(narrow.codes, narrow.row_offsets, narrow.minmax, 21)
    return [
        (decreasing, [4, 5, 6], r"row_offsets decrease at row 5"),
        (past_the_end, [12], r"row_offsets end at codeword .* past the .* codewords"),
        (wide, list(range(13)), r"row 0 decodes to 20 weights, expected 22"),
    ]


@needs_gpu
@pytest.mark.parametrize("case", range(3))
def test_corrupt_rows_become_nan(dictionary, monkeypatch, case):
    monkeypatch.delenv("QMOE_CUDA_VALIDATE", raising=False)
    w, bad_rows, _ = _corrupt_cases()[case]
    _, dense = _matrix(13, 21)
    x = _tokens((3, 21), jnp.float32)
    bad = np.isin(np.arange(13), bad_rows)
    y = np.asarray(ops.matmul(w, x, dictionary))
    assert np.isnan(y[:, bad]).all()
    np.testing.assert_allclose(y[:, ~bad], (np.asarray(x) @ dense.T)[:, ~bad], rtol=1e-5, atol=1e-5)
    weights = np.asarray(ops.dequantize(w, dictionary), np.float32)
    assert np.isnan(weights[bad]).all()
    np.testing.assert_array_equal(weights[~bad], dense[~bad])
    _, pullback = jax.vjp(lambda x: ops.matmul(w, x, dictionary), x)
    assert np.isnan(np.asarray(pullback(jnp.ones((3, 13)))[0])).all()


@needs_gpu
@pytest.mark.parametrize("case", range(3))
def test_validation_mode_names_the_row(dictionary, monkeypatch, case):
    monkeypatch.setenv("QMOE_CUDA_VALIDATE", "1")
    w, _, message = _corrupt_cases()[case]
    x = _tokens((3, 21), jnp.float32)
    with pytest.raises(Exception, match=message):
        np.asarray(ops.matmul(w, x, dictionary))
    with pytest.raises(Exception, match=message):
        np.asarray(ops.dequantize(w, dictionary))
    good, dense = _matrix(13, 21)
    _assert_close(ops.matmul(good, x, dictionary), np.asarray(x) @ dense.T, jnp.float32)


@needs_gpu
def test_bad_environment_and_shapes_raise(dictionary, monkeypatch):
    w, _ = _matrix(13, 21)
    monkeypatch.setenv("QMOE_CUDA_VALIDATE", "yes")
    with pytest.raises(Exception, match="QMOE_CUDA_VALIDATE must be 0 or 1"):
        np.asarray(ops.matvec(w, jnp.zeros(21), dictionary))
    monkeypatch.delenv("QMOE_CUDA_VALIDATE")
    masks, slots, words = bindings.dictionary_operands(dictionary)
    x, counts = jnp.zeros((2, 21)), np.int32(2)
    call = jax.ffi.ffi_call("qmoe_matmul", jax.ShapeDtypeStruct((2, 13), jnp.float32))
    with pytest.raises(Exception, match=r"masks must have shape \[65536, 2\]"):
        np.asarray(call(masks[:100], slots, w.codes, w.row_offsets, w.minmax, x, counts))
    narrow_y = jax.ffi.ffi_call("qmoe_matmul", jax.ShapeDtypeStruct((2, 12), jnp.float32))
    with pytest.raises(
        Exception, match=r"y must have 13 columns \(rows of minmax\); got \[2, 12\]"
    ):
        np.asarray(narrow_y(masks, slots, words, w.codes, w.row_offsets, w.minmax, x, counts))
    with pytest.raises(Exception, match=r"counts must have shape \[B...\]"):
        np.asarray(
            call(masks, slots, words, w.codes, w.row_offsets, w.minmax, x, np.ones(2, np.int32))
        )


FUZZ = textwrap.dedent(
    """
    import collections, json, os
    import jax, jax.numpy as jnp, numpy as np
    from helpers import compressed_data
    from qmoe_jax.kernels import bindings
    from qmoe_jax.codec import build_dictionary

    dictionary = build_dictionary(0.885)
    masks, slots, words = (np.asarray(a) for a in bindings.dictionary_operands(dictionary))
    rng = np.random.default_rng(0)
    rows, cols, n_codes = 7, 33, 40
    outcomes = collections.Counter()
    messages = set()
    good, dense = compressed_data.matrix(rng, dictionary, rows, cols)

    def call(target, result, forms, codes, offsets, minmax, *operands, **attributes):
        fn = jax.ffi.ffi_call(target, result, vmap_method="expand_dims")
        return np.asarray(fn(*forms, codes, offsets, minmax, *operands, **attributes), np.float32)

    def run_all(forms, codes, offsets, minmax):
        batch = codes.shape[:-1]
        x = rng.standard_normal((*batch, 5, cols)).astype(np.float32)
        g = rng.standard_normal((*batch, 3, rows)).astype(jnp.bfloat16)
        cases = [
            ("qmoe_matmul", jax.ShapeDtypeStruct((*batch, 5, rows), jnp.float32),
             (x, compressed_data.garbage_counts(rng, batch)), {}),
            ("qmoe_matmul_t", jax.ShapeDtypeStruct((*batch, 3, cols), jnp.bfloat16),
             (g, compressed_data.garbage_counts(rng, batch)), {}),
            ("qmoe_dequantize", jax.ShapeDtypeStruct((*batch, rows, cols), jnp.bfloat16), (),
             dict(cols=np.int64(cols))),
        ]
        for target, result, operands, attributes in cases:
            try:
                value = call(target, result, forms, codes, offsets, minmax, *operands, **attributes)
                outcomes["nan" if np.isnan(value).any() else "ok"] += 1
            except Exception as error:
                outcomes["error"] += 1
                messages.add(str(error).splitlines()[0][:120])

    good_codes = np.zeros(n_codes, np.uint16)
    good_codes[: len(good.codes)] = good.codes
    for validate in ("0", "1"):
        os.environ["QMOE_CUDA_VALIDATE"] = validate
        for case in range(42):
            kind = case % 6
            codes, offsets = compressed_data.corrupt_stream(rng, kind, good_codes, good.row_offsets,
                                                            len(good.codes))
            minmax = np.asarray(good.minmax)
            forms = (masks, slots, words)
            if kind == 4:
                forms = (rng.integers(0, 2**32, masks.shape, dtype=np.uint32), slots, words)
            run_all(forms, codes, offsets, minmax)
            stacked = (a[None].repeat(2, 0) for a in (codes, offsets, minmax))
            run_all(forms, *stacked)
    # The context survived: a good call still gives the right answer, with
    # garbage counts clamped.
    os.environ["QMOE_CUDA_VALIDATE"] = "0"
    x = rng.standard_normal((4, cols)).astype(np.float32)
    y = call("qmoe_matmul", jax.ShapeDtypeStruct((4, rows), jnp.float32), (masks, slots, words),
             good_codes, np.asarray(good.row_offsets), np.asarray(good.minmax), x, np.int32(4))
    np.testing.assert_allclose(y, x @ dense.T, rtol=1e-5, atol=1e-5)
    stack = [a[None].repeat(3, 0) for a in (good_codes, good.row_offsets, good.minmax)]
    for _ in range(20):
        counts = compressed_data.garbage_counts(rng, (3,))
        if counts.shape != (3,):
            continue
        x = rng.standard_normal((3, 5, cols)).astype(np.float32)
        shape = jax.ShapeDtypeStruct((3, 5, rows), jnp.float32)
        y = call("qmoe_matmul", shape, (masks, slots, words), *stack, x, counts)
        in_use = np.arange(5) < np.clip(counts.astype(np.int64), 0, 5)[:, None]
        np.testing.assert_allclose(y, np.where(in_use[..., None], x @ dense.T, 0), rtol=1e-5,
                                   atol=1e-5)
    print(json.dumps(dict(outcomes=outcomes, messages=sorted(messages))))
    """
)


def _run_script(script: str, **env) -> subprocess.CompletedProcess:
    # Each process takes GPU memory as it needs it, not 75% of it up front.
    return run_python(["-c", script], timeout=600, XLA_PYTHON_CLIENT_PREALLOCATE="false", **env)


@needs_gpu
def test_garbage_operands_never_crash():
    run = _run_script(FUZZ)
    assert run.returncode == 0, f"fuzz run died ({run.returncode}): {run.stderr[-3000:]}"
    result = json.loads(run.stdout.strip().splitlines()[-1])
    outcomes = result["outcomes"]
    assert (
        outcomes.get("ok", 0) > 0 and outcomes.get("nan", 0) > 0 and outcomes.get("error", 0) > 0
    ), result
    for message in result["messages"]:
        assert "qmoe_" in message, message


COMMAND_BUFFERS = textwrap.dedent(
    """
    import jax, jax.numpy as jnp, numpy as np
    from helpers import compressed_data
    from qmoe_jax.kernels import ops
    from qmoe_jax.codec import build_dictionary

    dictionary = build_dictionary(0.885)
    rng = np.random.default_rng(0)
    w, dense = compressed_data.matrix(rng, dictionary, 37, 101)
    x = rng.standard_normal((5, 101)).astype(np.float32)

    @jax.jit
    def step(x, count):
        y = ops.matmul(w, jnp.tanh(x), dictionary, count)
        weights = ops.dequantize(w, dictionary).astype(jnp.float32)
        return jnp.dot(jnp.tanh(y), weights, precision=jax.lax.Precision.HIGHEST) + 1.0

    for count in (5, 3, 0, 5):
        y = np.where(np.arange(5)[:, None] < count, np.tanh(x) @ dense.T, 0.0)
        expected = np.tanh(y) @ dense + 1.0
        np.testing.assert_allclose(np.asarray(step(x, count)), expected, rtol=1e-4, atol=1e-4)
    print("ok")
    """
)


@needs_gpu
def test_command_buffer_capture():
    flags = "--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1"
    run = _run_script(COMMAND_BUFFERS, XLA_FLAGS=flags)
    rejected = any(
        flag in run.stderr
        for flag in ("xla_gpu_enable_command_buffer", "xla_gpu_graph_min_graph_size")
    )
    if run.returncode != 0 and rejected:
        pytest.skip(f"this XLA does not take {flags!r}: {run.stderr[-300:]}")
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-3000:]
