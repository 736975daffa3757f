"""Dense weights stored in fewer bytes: bfloat16, or int8 with one scale per output channel.

Lingo: W[rows, cols] in y = W·x orientation, a row per output channel (a
T5X kernel [in, out] is its transpose; the token embedding [V, d] is already
in this orientation for the tied logits). A ``PackedMatrix`` holds W as
bfloat16, or as int8 codes with float32 row scales (``quant.int8``).

``matmul`` multiplies tokens by a packed matrix in float32 without ever
holding a float32 copy of W: on the CPU the FFI kernel
``qmoe_dense_matmul`` (xla_ffi/cpu_dense.h) converts the weights in
registers, so a product reads 2 or 1 bytes per weight instead of 4; XLA's
own CPU formulations of the same product (a convert feeding a dot, or a
multiply-and-reduce) convert the whole matrix into a float32 buffer first
and come out slower than the float32 dot (docs/dense_forms.md). On other
platforms the jnp twin ``matmul_reference`` runs, which XLA fuses there.

Float32 weights left unpacked (``--dense_dtype float32``, as T5X stores them) take the same road
for a few tokens, as a decoding step has, in matrices of switch-base's size and up:
``kernel_matmul`` (a T5X kernel [in, out], through ``qmoe_dense_matmul_t``) and ``rows_matmul``
(a matrix [rows, cols] such as the embedding for tied logits, through ``qmoe_dense_matmul``) read
the weights as a few long streams, faster than XLA's dot does one token at a time
(docs/dense_forms.md). With more tokens, smaller matrices, and on other platforms, they are
XLA's dot. Both are differentiable: their gradients are XLA's products.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from qmoe_jax.quant.int8 import dequantize_int8, quantize_int8

FORMS = ("bfloat16", "int8")
# Tokens up to which a float32 product runs through the CPU kernels (``kernel_matmul``,
# ``rows_matmul``) instead of XLA's dot: a decoding step's batch, or a short prompt
# (``float32_kernel_tokens``). The kernels read the weights once per 8 tokens
# (``qmoe_dense_matmul_t``) or per 3 (``qmoe_dense_matmul``), with AVX2's fused multiply-adds; XLA's
# dot with many tokens is a matrix product that reads them once, with the widest the CPU has. On a
# switch-base decoding step's matrices it overtakes the kernels between 32 and 64 tokens on a CPU
# without AVX-512 (Zen 2), and between 8 and 16 on one with it (an Intel Xeon, family 6 model 207),
# where it computes with 512-bit vectors (docs/dense_forms.md).
FLOAT32_KERNEL_TOKENS = 32
FLOAT32_KERNEL_TOKENS_AVX512 = 8
# Weights a float32 matrix needs at least for the kernels: those of switch-base's smallest
# matrices (2.25 MiB). A call costs about 10 µs more than XLA's dot, so a small model's
# matrices, which stay in the caches, keep XLA's dot (the bundled model's are 128 wide); from
# memory even a 512x512 matrix takes the kernel about half the dot's time (docs/dense_forms.md).
FLOAT32_KERNEL_MIN_WEIGHTS = 768 * 768


@functools.cache
def float32_kernel_tokens() -> int:
    """Tokens up to which the float32 kernels run: FLOAT32_KERNEL_TOKENS_AVX512 on a CPU with
    AVX-512, FLOAT32_KERNEL_TOKENS otherwise. Of the AVX-512 CPUs only an Intel was measured; on
    the others the lower limit is the safe side (the kernels won up to 8 tokens on every CPU
    measured)."""
    from qmoe_jax.kernels import bindings  # the extension: it reads the CPU's features

    return (
        FLOAT32_KERNEL_TOKENS_AVX512 if "avx512" in bindings.cpu_isas() else FLOAT32_KERNEL_TOKENS
    )


@jax.tree_util.register_pytree_node_class
class PackedMatrix:
    """W[rows, cols] stored as bfloat16 (``scales`` None) or as int8 codes with float32 row scales
    (W ≈ scales[:, None] · codes)."""

    def __init__(self, values, scales=None):
        self.values = values
        self.scales = scales

    def tree_flatten(self):
        return (self.values, self.scales), None

    @classmethod
    def tree_unflatten(cls, _, children):
        return cls(*children)

    @property
    def form(self) -> str:
        return "int8" if self.scales is not None else "bfloat16"

    @property
    def rows(self) -> int:
        return self.values.shape[0]

    @property
    def cols(self) -> int:
        return self.values.shape[1]

    @property
    def nbytes(self) -> int:
        """Bytes stored: the values and the scales."""
        return int(self.values.nbytes) + (0 if self.scales is None else int(self.scales.nbytes))

    def __repr__(self) -> str:
        return f"PackedMatrix({self.form}[{self.rows}, {self.cols}])"


# One fused pass per matrix: eagerly, each step of the quantization held a float32 temporary.
_quantize_int8 = jax.jit(quantize_int8)


def pack(matrix, form: str) -> PackedMatrix:
    """``matrix [rows, cols]`` (y = W·x orientation, any float dtype) stored as ``form``."""
    if form not in FORMS:
        raise ValueError(f"unknown packed form {form!r}; choose one of {', '.join(FORMS)}")
    if np.ndim(matrix) != 2:
        raise ValueError(f"pack expects a matrix [rows, cols], got shape {np.shape(matrix)}")
    if form == "bfloat16":
        return PackedMatrix(jnp.asarray(matrix, jnp.bfloat16))
    return PackedMatrix(*_quantize_int8(matrix))


def unpack(packed: PackedMatrix) -> jax.Array:
    """W as float32[rows, cols]."""
    if packed.scales is None:
        return jnp.asarray(packed.values).astype(jnp.float32)
    return dequantize_int8(packed.values, packed.scales)


def take_rows(packed: PackedMatrix, index: jax.Array) -> jax.Array:
    """float32[..., cols]: rows ``index int[...]`` of W (an embedding lookup), converting only
    those."""
    values = jnp.take(packed.values, index, axis=0).astype(jnp.float32)
    if packed.scales is None:
        return values
    return values * jnp.take(packed.scales, index, axis=0)[..., None]


def row_block(packed: PackedMatrix, rows: slice) -> PackedMatrix:
    """The rows ``rows`` of W, still packed."""
    return PackedMatrix(packed.values[rows], None if packed.scales is None else packed.scales[rows])


def stack_rows(matrices: list[PackedMatrix]) -> PackedMatrix:
    """One packed matrix of the rows of ``matrices`` (one form, one width) in order."""
    if len({(m.form, m.cols) for m in matrices}) != 1:
        raise ValueError(f"stack_rows needs matrices of one form and width, got {matrices}")
    scales = None
    if matrices[0].scales is not None:
        scales = jnp.concatenate([m.scales for m in matrices])
    return PackedMatrix(jnp.concatenate([m.values for m in matrices]), scales)


def _scales_operand(packed: PackedMatrix) -> jax.Array:
    if packed.scales is None:
        return jnp.zeros((0,), jnp.float32)
    return jnp.asarray(packed.scales, jnp.float32)


def matmul_reference(x: jax.Array, packed: PackedMatrix) -> jax.Array:
    """``matmul`` in pure jnp: float32[..., rows] = x · Wᵀ."""
    y = jnp.einsum(
        "...c,rc->...r",
        jnp.asarray(x, jnp.float32),
        packed.values.astype(jnp.float32),
        precision=jax.lax.Precision.HIGHEST,
    )
    return y if packed.scales is None else y * packed.scales


def _native(x, values, scales):
    from qmoe_jax.kernels import bindings  # the extension, only where the CPU kernel runs

    return bindings.dense_matmul_call(x, values, scales)


def _twin(x, values, scales):
    return matmul_reference(x, PackedMatrix(values, scales if scales.shape[0] else None))


def matmul(x: jax.Array, packed: PackedMatrix) -> jax.Array:
    """float32[..., rows] = x · Wᵀ for x [..., cols] (converted to float32), never materializing W
    in float32 (see the module docstring). No autodiff rule: the packed forms are for inference."""
    if not isinstance(packed, PackedMatrix):
        raise TypeError(f"expected a PackedMatrix, got {type(packed).__name__}")
    x = jnp.asarray(x, jnp.float32)
    if x.ndim == 0 or x.shape[-1] != packed.cols:
        raise ValueError(
            f"x has shape {x.shape}, but W[{packed.rows}, {packed.cols}] needs {packed.cols} "
            "columns last"
        )
    lead = x.shape[:-1]
    tokens = x.reshape(math.prod(lead), packed.cols)
    y = jax.lax.platform_dependent(
        tokens, packed.values, _scales_operand(packed), cpu=_native, default=_twin
    )
    return y.reshape(*lead, packed.rows)


def _native_t(x, kernel):
    from qmoe_jax.kernels import bindings  # the extension, only where the CPU kernel runs

    return bindings.dense_matmul_t_call(x, kernel)


def _native_rows(x, matrix):
    from qmoe_jax.kernels import bindings

    return bindings.dense_matmul_call(x, matrix, jnp.zeros((0,), jnp.float32))


@jax.custom_vjp
def _kernel_product(x, kernel):
    return jax.lax.platform_dependent(x, kernel, cpu=_native_t, default=jnp.dot)


def _kernel_product_fwd(x, kernel):
    return _kernel_product(x, kernel), (x, kernel)


def _kernel_product_bwd(saved, g):
    x, kernel = saved
    return jnp.dot(g, kernel.T), jnp.dot(x.T, g)


_kernel_product.defvjp(_kernel_product_fwd, _kernel_product_bwd)


@jax.custom_vjp
def _rows_product(x, matrix):
    return jax.lax.platform_dependent(
        x, matrix, cpu=_native_rows, default=lambda x, matrix: jnp.dot(x, matrix.T)
    )


def _rows_product_fwd(x, matrix):
    return _rows_product(x, matrix), (x, matrix)


def _rows_product_bwd(saved, g):
    x, matrix = saved
    return jnp.dot(g, matrix), jnp.dot(g.T, x)


_rows_product.defvjp(_rows_product_fwd, _rows_product_bwd)


def _takes_kernel(x: jax.Array, weights: jax.Array, width: int) -> bool:
    """The float32 kernels take ``x @ weights``: float32, at most ``float32_kernel_tokens()``
    tokens (and at least one), at least FLOAT32_KERNEL_MIN_WEIGHTS weights, the widths matching
    (jnp.dot reports a mismatch)."""
    return (
        x.ndim >= 1
        and weights.ndim == 2
        and x.dtype == jnp.float32
        and weights.dtype == jnp.float32
        and x.shape[-1] == width
        and weights.size >= FLOAT32_KERNEL_MIN_WEIGHTS
        and 1 <= math.prod(x.shape[:-1]) <= float32_kernel_tokens()
    )


def kernel_matmul(x: jax.Array, kernel: jax.Array) -> jax.Array:
    """``jnp.dot(x, kernel)`` for a T5X kernel [in, out] and x [..., in]. With float32 operands,
    at most ``float32_kernel_tokens()`` tokens and at least ``FLOAT32_KERNEL_MIN_WEIGHTS`` weights,
    the CPU runs ``qmoe_dense_matmul_t`` (XLA's dot elsewhere; the gradients are XLA's
    products); otherwise it is ``jnp.dot``."""
    if not _takes_kernel(x, kernel, kernel.shape[0] if kernel.ndim == 2 else -1):
        return jnp.dot(x, kernel)
    lead = x.shape[:-1]
    y = _kernel_product(x.reshape(math.prod(lead), x.shape[-1]), kernel)
    return y.reshape(*lead, kernel.shape[1])


def rows_matmul(x: jax.Array, matrix: jax.Array) -> jax.Array:
    """``jnp.dot(x, matrix.T)`` for a matrix [rows, cols] (y = W·x orientation, such as the token
    embedding for tied logits) and x [..., cols]. With float32 operands, at most
    ``float32_kernel_tokens()`` tokens and at least ``FLOAT32_KERNEL_MIN_WEIGHTS`` weights, the
    CPU runs ``qmoe_dense_matmul`` (XLA's dot elsewhere; the gradients are XLA's products);
    otherwise it is ``jnp.dot``."""
    if not _takes_kernel(x, matrix, matrix.shape[-1] if matrix.ndim == 2 else -1):
        return jnp.dot(x, matrix.T)
    lead = x.shape[:-1]
    y = _rows_product(x.reshape(math.prod(lead), x.shape[-1]), matrix)
    return y.reshape(*lead, matrix.shape[0])
