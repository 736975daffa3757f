"""The CPU product with bfloat16 and int8 dense weights (xla_ffi/cpu_dense.h) against its jnp
twin, and the compiled program it makes (float32 weights: test_dense_float32.py)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qmoe_jax.kernels import bindings, dense

ISAS = [isa for isa in ("avx2", "portable") if isa in bindings.cpu_isas()]


def _problem(rows, cols, tokens, seed=0):
    rng = np.random.default_rng(seed)
    weights = rng.standard_normal((rows, cols)).astype(np.float32) / np.sqrt(cols)
    x = rng.standard_normal((tokens, cols)).astype(np.float32)
    return weights, x


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("form", dense.FORMS)
@pytest.mark.parametrize(
    "rows,cols,tokens",
    # Row tiles of 8 and 4 with rows left over, token groups of 3 with 2 or 1 left over,
    # columns past the last 8, several row and token blocks; bfloat16 pair tiles (16 columns);
    # tiles whose rows are runs apart in row blocks of unequal length (517 and 1000 rows).
    [
        (1, 1, 1),
        (9, 13, 1),
        (13, 8, 2),
        (37, 29, 7),
        (300, 64, 50),
        (8, 16, 100),
        (13, 48, 3),
        (517, 32, 1),
        (1000, 24, 4),
    ],
)
def test_dense_matmul_matches_twin(isa, form, rows, cols, tokens, monkeypatch):
    monkeypatch.setenv("QMOE_CPU_ISA", isa)
    weights, x = _problem(rows, cols, tokens)
    packed = dense.pack(weights, form)
    expected = x @ np.asarray(dense.unpack(packed)).T
    y = jax.jit(dense.matmul)(x, packed)
    assert y.dtype == jnp.float32 and y.shape == (tokens, rows)
    np.testing.assert_allclose(np.asarray(y), expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(
        np.asarray(dense.matmul_reference(x, packed)), expected, rtol=1e-5, atol=1e-5
    )


def test_dense_matmul_keeps_leading_dims_and_casts_x():
    weights, x = _problem(24, 16, 6)
    packed = dense.pack(weights, "int8")
    y = dense.matmul(jnp.asarray(x.reshape(2, 3, 16), jnp.bfloat16), packed)
    assert y.shape == (2, 3, 24) and y.dtype == jnp.float32
    expected = (
        np.asarray(jnp.asarray(x, jnp.bfloat16), np.float32) @ np.asarray(dense.unpack(packed)).T
    )
    np.testing.assert_allclose(np.asarray(y).reshape(6, 24), expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="needs 16 columns last"):
        dense.matmul(x[:, :8], packed)
    with pytest.raises(TypeError, match="PackedMatrix"):
        dense.matmul(x, weights)


def test_take_rows_converts_the_rows_it_takes():
    weights, _ = _problem(40, 8, 1)
    for form in dense.FORMS:
        packed = dense.pack(weights, form)
        index = np.array([[3, 0], [39, 3]])
        np.testing.assert_array_equal(
            np.asarray(dense.take_rows(packed, index)), np.asarray(dense.unpack(packed))[index]
        )


@pytest.mark.parametrize("form", dense.FORMS)
def test_stacked_rows_and_row_blocks_keep_each_rows_weights(form):
    rng = np.random.default_rng(3)
    parts = [dense.pack(rng.standard_normal((n, 24)).astype(np.float32), form) for n in (8, 5)]
    stacked = dense.stack_rows(parts)
    assert (stacked.rows, stacked.cols, stacked.form) == (13, 24, form)
    np.testing.assert_array_equal(
        dense.unpack(stacked), np.concatenate([dense.unpack(p) for p in parts])
    )
    np.testing.assert_array_equal(
        dense.unpack(dense.row_block(stacked, slice(8, None))), dense.unpack(parts[1])
    )
    other = "int8" if form == "bfloat16" else "bfloat16"
    with pytest.raises(ValueError, match="one form and width"):
        dense.stack_rows([parts[0], dense.pack(np.ones((2, 24), np.float32), other)])


@pytest.mark.parametrize("form", dense.FORMS)
def test_compiled_product_never_holds_float32_weights(form):
    """The CPU program is the kernel call on the stored bytes: no float32 [rows, cols] buffer (a
    convert feeding a dot would make one) and no dot."""
    weights, x = _problem(3072, 768, 1)
    packed = dense.pack(weights, form)
    hlo = jax.jit(dense.matmul).lower(x, packed).compile().as_text()
    assert bindings.DENSE_MATMUL in hlo
    assert not re.search(r"f32\[(3072,768|768,3072)\]", hlo), hlo
    assert " dot(" not in hlo


def test_kernel_names_bad_operands():
    x = jnp.ones((2, 8), jnp.float32)
    call = jax.jit(bindings.dense_matmul_call)
    with pytest.raises(Exception, match=r"scales must be \[4\]"):
        call(x, jnp.ones((4, 8), jnp.int8), jnp.ones((3,), jnp.float32)).block_until_ready()
    with pytest.raises(Exception, match=r"scales must be \[0\]"):
        call(x, jnp.ones((4, 8), jnp.bfloat16), jnp.ones((4,), jnp.float32)).block_until_ready()
    with pytest.raises(Exception, match="float32, bfloat16 or int8"):
        call(x, jnp.ones((4, 8), jnp.int16), jnp.ones((0,), jnp.float32)).block_until_ready()
    with pytest.raises(Exception, match=r"x must be \[N, 6\]"):
        call(x, jnp.ones((4, 6), jnp.int8), jnp.ones((4,), jnp.float32)).block_until_ready()


def test_pack_names_bad_forms():
    with pytest.raises(ValueError, match="unknown packed form"):
        dense.pack(np.ones((2, 2), np.float32), "int4")
    with pytest.raises(ValueError, match=r"matrix \[rows, cols\]"):
        dense.pack(np.ones(3, np.float32), "int8")
    assert dense.pack(np.ones((2, 3)), "int8").nbytes == 6 + 2 * 4
    assert dense.pack(np.ones((2, 3)), "bfloat16").nbytes == 12
