"""Float32 products of few tokens through the CPU kernels (``qmoe_dense_matmul_t`` on a T5X kernel
[in, out], ``qmoe_dense_matmul`` on a matrix [rows, cols]) against float64 sums; when
``kernels.dense.kernel_matmul`` and ``rows_matmul`` take them, and their gradients and vmap."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qmoe_jax.kernels import bindings, dense

ISAS = [isa for isa in ("avx2", "portable") if isa in bindings.cpu_isas()]


def _problem(n_in, n_out, tokens, seed=0):
    rng = np.random.default_rng(seed)
    kernel = (rng.standard_normal((n_in, n_out)) / np.sqrt(n_in)).astype(np.float32)
    x = rng.standard_normal((tokens, n_in)).astype(np.float32)
    return kernel, x


def _assert_close(y, x, kernel):
    expected = x.astype(np.float64) @ kernel.astype(np.float64)
    scale = max(1.0, float(np.abs(expected).max()))
    np.testing.assert_allclose(np.asarray(y, np.float64), expected, rtol=0, atol=2e-6 * scale)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize(
    "n_in,n_out,tokens",
    # One weight; columns past the last 8; rows left over after the 4 runs of a task; tasks over
    # rows (131 rows: 4 parts of 32-33, their sums added up) and over columns (40 rows, 2056
    # columns: 2 parts); every token group size up to 8; blocks of 8192 columns for 8 tokens
    # (8200 columns: 2 blocks); a decoding step's shape.
    [
        (1, 1, 1),
        (5, 7, 2),
        (37, 13, 3),
        (131, 24, 8),
        (40, 2056, 4),
        (40, 8200, 8),
        (768, 2304, 1),
        (300, 96, 5),
        (64, 40, 6),
        (70, 17, 7),
    ],
)
def test_float32_kernels_match_float64(isa, n_in, n_out, tokens, monkeypatch):
    monkeypatch.setenv("QMOE_CPU_ISA", isa)
    kernel, x = _problem(n_in, n_out, tokens)
    y = jax.jit(bindings.dense_matmul_t_call)(x, kernel)
    assert y.shape == (tokens, n_out) and y.dtype == jnp.float32
    _assert_close(y, x, kernel)
    # The tied-logits form reads the same weights as rows.
    rows = jax.jit(bindings.dense_matmul_call)(
        x, np.ascontiguousarray(kernel.T), np.zeros((0,), np.float32)
    )
    assert rows.shape == (tokens, n_out)
    _assert_close(rows, x, kernel)


@pytest.mark.parametrize("isa", ISAS)
def test_transposed_kernel_takes_any_token_count(isa, monkeypatch):
    """The FFI kernel itself takes any N (8 tokens per pass over k, 3 left over here), and N = 0
    or in = 0."""
    monkeypatch.setenv("QMOE_CPU_ISA", isa)
    kernel, x = _problem(96, 40, 19)
    call = jax.jit(bindings.dense_matmul_t_call)
    _assert_close(call(x, kernel), x, kernel)
    assert call(x[:0], kernel).shape == (0, 40)
    empty = call(np.ones((3, 0), np.float32), np.ones((0, 5), np.float32))
    np.testing.assert_array_equal(np.asarray(empty), np.zeros((3, 5), np.float32))


def _program(function, *args) -> str:
    return jax.jit(function).lower(*args).compile().as_text()


def test_the_token_limit_is_lower_where_xla_has_avx512(monkeypatch):
    for isas, limit in [
        (["avx2", "avx512", "portable"], dense.FLOAT32_KERNEL_TOKENS_AVX512),
        (["avx2", "portable"], dense.FLOAT32_KERNEL_TOKENS),
        (["portable"], dense.FLOAT32_KERNEL_TOKENS),
    ]:
        monkeypatch.setattr(bindings, "cpu_isas", lambda isas=isas: isas)
        dense.float32_kernel_tokens.cache_clear()
        assert dense.float32_kernel_tokens() == limit
    monkeypatch.undo()
    dense.float32_kernel_tokens.cache_clear()
    # Both limits keep the products of one decoded token and of a few sequences.
    assert 8 <= dense.FLOAT32_KERNEL_TOKENS_AVX512 <= dense.FLOAT32_KERNEL_TOKENS


def test_few_tokens_of_large_float32_matrices_take_the_kernels():
    # The smallest matrix the kernels take: switch-base's 768 x 768.
    n_in = 768
    n_out = dense.FLOAT32_KERNEL_MIN_WEIGHTS // n_in
    limit = dense.float32_kernel_tokens()
    kernel, x = _problem(n_in, n_out, limit + 1)
    few = x[:limit]
    hlo = _program(dense.kernel_matmul, few.reshape(2, -1, n_in), kernel)
    assert bindings.DENSE_MATMUL_TRANSPOSED in hlo and " dot(" not in hlo
    hlo = _program(dense.rows_matmul, few, np.ascontiguousarray(kernel.T))
    assert bindings.DENSE_MATMUL in hlo and " dot(" not in hlo
    for args in [
        (x, kernel),  # too many tokens: XLA's matrix product reads the weights once
        (few, kernel[:, :-8]),  # too small: it stays in the caches, and XLA's dot costs less
        (few.astype(jnp.bfloat16), kernel.astype(jnp.bfloat16)),  # a bfloat16 model's product
        (few, kernel.astype(jnp.bfloat16)),
    ]:
        hlo = _program(dense.kernel_matmul, *args)
        assert "qmoe_dense" not in hlo and " dot(" in hlo, (args[0].shape, args[1].shape)
    hlo = _program(dense.rows_matmul, few, np.ascontiguousarray(kernel[:, :-8].T))
    assert "qmoe_dense" not in hlo and " dot(" in hlo
    for tokens in (few[:1], few.reshape(2, -1, n_in), x.reshape(3, -1, n_in)):
        np.testing.assert_allclose(
            np.asarray(dense.kernel_matmul(tokens, kernel)),
            np.asarray(tokens) @ kernel,
            rtol=1e-4,
            atol=1e-4,
        )
    # A mismatch is jnp.dot's to report.
    with pytest.raises(TypeError, match="dot"):
        dense.kernel_matmul(few[:, :10], kernel)


def test_kernel_products_differentiate_and_vmap_as_the_dot(monkeypatch):
    monkeypatch.setattr(dense, "FLOAT32_KERNEL_MIN_WEIGHTS", 0)  # small matrices take the kernels
    kernel, x = _problem(40, 24, 3, seed=1)
    rows = np.ascontiguousarray(kernel.T)
    weights = np.random.default_rng(2).standard_normal((3, 24)).astype(np.float32)
    # The forward product is the kernel's (the gradients are XLA's products, below).
    hlo = _program(jax.value_and_grad(lambda x: jnp.sum(dense.kernel_matmul(x, kernel))), x)
    assert bindings.DENSE_MATMUL_TRANSPOSED in hlo

    def loss(product):
        return lambda x, w: jnp.sum(product(x, w) * weights)

    for product, w, reference in [
        (dense.kernel_matmul, kernel, jnp.dot),
        (dense.rows_matmul, rows, lambda x, w: jnp.dot(x, w.T)),
    ]:
        got = jax.jit(jax.grad(loss(product), argnums=(0, 1)))(x, w)
        want = jax.grad(loss(reference), argnums=(0, 1))(x, w)
        for g, e in zip(got, want, strict=True):
            np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=1e-5, atol=1e-6)
        batched = jax.jit(jax.vmap(product, in_axes=(0, None)))(x[:, None, :], w)
        np.testing.assert_allclose(
            np.asarray(batched)[:, 0], np.asarray(reference(x, w)), rtol=1e-5, atol=1e-5
        )


def test_transposed_kernel_names_bad_operands():
    call = jax.jit(bindings.dense_matmul_t_call)
    x = jnp.ones((2, 8), jnp.float32)
    with pytest.raises(Exception, match=r"qmoe_dense_matmul_t: x must be \[N, 6\]"):
        call(x, jnp.ones((6, 4), jnp.float32)).block_until_ready()
