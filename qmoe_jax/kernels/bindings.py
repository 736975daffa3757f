"""Bindings of the fused decode-and-multiply FFI targets (xla_ffi/cpu_kernels.h;
CUDA handlers in xla_ffi/cuda_kernels.h when built with QMOE_CUDA=ON), of the routed products
on the CPU (xla_ffi/cpu_routed.h: each token through the expert it names), of
GPTQ's CPU block kernel (xla_ffi/cpu_gptq.h, ``gptq_block_call``), of the CPU kernel for the
Cholesky's diagonal blocks (xla_ffi/cpu_cholesky.h, ``cholesky_base_call``) and of the CPU
product with float32, bfloat16 or int8 dense weights, and with a float32 T5X kernel [in, out]
(xla_ffi/cpu_dense.h, ``dense_matmul_call`` and ``dense_matmul_t_call``).

Lingo: W[rows, cols] in y = W·x orientation; B... are leading batch dims
(experts, vmapped axes) shared by the compressed arrays and the dense operand;
N tokens per matrix, of which ``counts[B...]`` (int32, clamped to [0, N]) are
in use: the first ones along N. The dictionary enters every call as three
constants: its ``masks``, its sparse ``slots`` form and its compact ``words``
form (xla_ffi/qmoe_format.h).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from qmoe_jax.codec.dictionary import Dictionary

try:
    import qmoe_jax_ext
except ImportError as error:  # pragma: no cover - depends on the installation
    raise ImportError(
        "qmoe_jax's native extension qmoe_jax_ext is missing: install qmoe_jax (`pip install .`), "
        "or for development build it into the checkout's root with `cmake -S . -B build/dev -G "
        "Ninja "
        "&& cmake --build build/dev`"
    ) from error

MATMUL = "qmoe_matmul"
MATMUL_TRANSPOSED = "qmoe_matmul_t"
MATMUL_ROUTED = "qmoe_matmul_routed"
MATMUL_ROUTED_TRANSPOSED = "qmoe_matmul_routed_t"
DEQUANTIZE = "qmoe_dequantize"
GPTQ_BLOCK = "qmoe_gptq_block"
CHOLESKY_BASE = "qmoe_cholesky_base"
DENSE_MATMUL = "qmoe_dense_matmul"
DENSE_MATMUL_TRANSPOSED = "qmoe_dense_matmul_t"
PLUS_SLOTS = 8
MINUS_SLOTS = 7
UNUSED_SLOT = 31
SLOTS_OVERFLOW = 0x80
SLOTS_TABLE_OVERFLOWS = 0x40
WORD_FIELDS = 4
WORD_FIELD_BITS = 5
WORD_CLASS_SHIFT = 20
WORD_LENGTH_SHIFT = 25
WORD_OVERFLOW_CLASS = 31
WORDS_TABLE_OVERFLOWS = 1 << 30
WORDS_TABLE_HAS_FOURTH = 1 << 31
FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


def _register_targets() -> None:
    for platform, targets in qmoe_jax_ext.registrations().items():
        for name, capsule in targets.items():
            jax.ffi.register_ffi_target(name, capsule, platform=platform)


_register_targets()


def has_cuda_kernels() -> bool:
    """Whether the extension holds the CUDA handlers (built with QMOE_CUDA=ON).

    With them, the ops run on the GPU whenever jax places them there; the
    targets are registered for platform "CUDA" under the same names.
    """
    return bool(qmoe_jax_ext.with_cuda)


def cpu_isas() -> list[str]:
    """Instruction sets the CPU kernels can run on this machine, fastest first; the kernels use the
    first unless QMOE_CPU_ISA names another. AVX2 comes before AVX-512 (faster on AMD Zen 4 and on
    Intel: docs/cpu_kernels.md §1, figures in docs/measurements.md)."""
    return list(qmoe_jax_ext.cpu_isas())


def _weight_bits(masks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(plus bool[65536, 28], minus bool[65536, 28], length in weights uint32[65536]) of
    ``Dictionary.masks``."""
    masks = np.asarray(masks, np.uint32)
    weight_bits = np.arange(28, dtype=np.uint32)
    plus = ((masks[:, 0, None] >> weight_bits) & 1).astype(bool)
    minus = ((masks[:, 1, None] >> weight_bits) & 1).astype(bool)
    return plus, minus, 2 * (masks[:, 0] >> np.uint32(28))


def _first_set_bits(bits: np.ndarray, slots: int) -> tuple[np.ndarray, np.ndarray]:
    """Positions of the first `slots` set bits of each row (then UNUSED_SLOT), and counts."""
    count = bits.sum(axis=1)
    order = np.argsort(~bits, axis=1, kind="stable")[:, :slots]
    return np.where(np.arange(slots) < count[:, None], order, UNUSED_SLOT), count


def slots_from_masks(masks: np.ndarray) -> np.ndarray:
    """The sparse kernel form of a dictionary (layout in xla_ffi/qmoe_format.h).

    Args:
      masks: uint32[65536, 2], ``Dictionary.masks``.

    Returns:
      uint8[65536, 16]: plus positions, minus positions, then the entry length
      and flags (entry 0 also flags whether any entry overflows).
    """
    plus, minus, length = _weight_bits(masks)
    plus_slots, plus_count = _first_set_bits(plus, PLUS_SLOTS)
    minus_slots, minus_count = _first_set_bits(minus, MINUS_SLOTS)
    overflow = (plus_count > PLUS_SLOTS) | (minus_count > MINUS_SLOTS)
    meta = length | np.where(overflow, SLOTS_OVERFLOW, 0)
    meta[0] |= SLOTS_TABLE_OVERFLOWS if overflow.any() else 0
    return np.concatenate([plus_slots, minus_slots, meta[:, None]], axis=1).astype(np.uint8)


def words_from_masks(masks: np.ndarray) -> np.ndarray:
    """The compact kernel form of a dictionary (layout in xla_ffi/qmoe_format.h).

    Args:
      masks: uint32[65536, 2], ``Dictionary.masks``.

    Returns:
      uint32[65536]: per entry the positions of its (at most 4) nonzero
      weights, plus weights first, its class (5 * plus count + minus count, or
      the overflow class) and its length; entry 0 also flags whether any entry
      overflows and whether any has 4 nonzero weights.
    """
    plus, minus, length = _weight_bits(masks)
    plus_positions, plus_count = _first_set_bits(plus, WORD_FIELDS)
    minus_positions, minus_count = _first_set_bits(minus, WORD_FIELDS)
    # Field f holds the entry's f-th nonzero weight: plus weights first, then minus ones; unused
    # fields 0.
    fields = np.zeros(len(length), np.uint32)
    for field in range(WORD_FIELDS):
        from_minus = np.clip(field - plus_count, 0, WORD_FIELDS - 1)
        position = np.where(
            field < plus_count,
            plus_positions[:, field],
            np.take_along_axis(minus_positions, from_minus[:, None], axis=1)[:, 0],
        )
        position = np.where(field < plus_count + minus_count, position, 0).astype(np.uint32)
        fields |= position << np.uint32(WORD_FIELD_BITS * field)
    overflow = plus_count + minus_count > WORD_FIELDS
    kind = np.where(
        overflow, WORD_OVERFLOW_CLASS, (WORD_FIELDS + 1) * plus_count + minus_count
    ).astype(np.uint32)
    words = (
        fields | (kind << np.uint32(WORD_CLASS_SHIFT)) | (length << np.uint32(WORD_LENGTH_SHIFT))
    )
    words[0] |= np.uint32(WORDS_TABLE_OVERFLOWS if overflow.any() else 0)
    words[0] |= np.uint32(
        WORDS_TABLE_HAS_FOURTH if (plus_count + minus_count == WORD_FIELDS).any() else 0
    )
    return words


@functools.lru_cache(maxsize=8)
def dictionary_operands(dictionary: Dictionary) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(masks, slots, words) of a dictionary as device arrays, computed once per dictionary."""
    masks = np.asarray(dictionary.masks, np.uint32)
    with jax.ensure_compile_time_eval():  # concrete even when first asked inside a trace
        return (
            jnp.asarray(masks),
            jnp.asarray(slots_from_masks(masks)),
            jnp.asarray(words_from_masks(masks)),
        )


@dataclasses.dataclass(frozen=True)
class Static:
    """What the kernels need besides arrays: the dictionary and W's column count."""

    dictionary: Dictionary
    cols: int


def _call(
    target: str,
    static: Static,
    codes,
    row_offsets,
    minmax,
    *dense,
    result,
    vmap_method: str = "expand_dims",
):
    return jax.ffi.ffi_call(target, result, vmap_method=vmap_method)(
        *dictionary_operands(static.dictionary), codes, row_offsets, minmax, *dense
    )


def all_tokens(dense) -> np.ndarray:
    """Counts for a dense operand [B..., N, width] with every token in use: int32[1...] = N."""
    return np.full((1,) * (dense.ndim - 2), dense.shape[-2], np.int32)


def matmul_call(static: Static, codes, row_offsets, minmax, x, counts):
    """y[B..., N, rows] = W·x for x[B..., N, cols]; zero rows for tokens n >= counts[B...].

    No autodiff rule. ``counts`` is int32 with the leading dims of x (each
    equal or 1); ``all_tokens(x)`` computes every token.
    """
    rows = minmax.shape[-2]
    result = jax.ShapeDtypeStruct((*x.shape[:-1], rows), x.dtype)
    return _call(MATMUL, static, codes, row_offsets, minmax, x, counts, result=result)


def matmul_transposed_call(static: Static, codes, row_offsets, minmax, g, counts):
    """dx[B..., N, cols] = Wᵀ·g for g[B..., N, rows]; zero rows for tokens n >= counts[B...]."""
    result = jax.ShapeDtypeStruct((*g.shape[:-1], static.cols), g.dtype)
    return _call(MATMUL_TRANSPOSED, static, codes, row_offsets, minmax, g, counts, result=result)


def dequantize_call(static: Static, codes, row_offsets, minmax):
    """W as bf16[B..., rows, cols]."""
    result = jax.ShapeDtypeStruct((*minmax.shape[:-1], static.cols), jnp.bfloat16)
    return jax.ffi.ffi_call(DEQUANTIZE, result, vmap_method="expand_dims")(
        *dictionary_operands(static.dictionary),
        codes,
        row_offsets,
        minmax,
        cols=np.int64(static.cols),
    )


def _varying_like(results, reference):
    """FFI results marked as varying over the shard_map axes ``reference`` varies over: an
    ffi_call's results carry no varying axes, so inside ``shard_map`` (with its default check_vma) a
    ``lax.platform_dependent`` between a kernel and its jnp twin would otherwise have branches of
    different types."""
    aval = jax.typeof(reference)
    axes = getattr(aval, "vma", None)  # older jax; jax 0.10 keeps them in the manual axis type
    if axes is None:
        axes = getattr(getattr(aval, "manual_axis_type", None), "varying", None) or ()
    axes = tuple(sorted(axes))
    if not axes:
        return results
    cast = getattr(jax.lax, "pcast", None)
    if cast is not None:
        return jax.tree.map(lambda result: cast(result, axes, to="varying"), results)
    return jax.tree.map(lambda result: jax.lax.pvary(result, axes), results)  # jax before pcast


def gptq_block_call(weights, corrections, scaled, factor_diag, params, levels: int):
    """GPTQ's column recurrence inside one block of m columns, on the CPU (xla_ffi/cpu_gptq.h).

    Args (leading batch dims B... alike on all, as vmap gives them):
      weights, corrections: float32[B..., rows, m] (the block's columns of W, y = W·x orientation);
      scaled: float32[B..., m, m] (S, read above the diagonal); factor_diag: float32[B..., m];
      params: [B..., rows, 2] (converted to float32); levels: 3 for the ternary grid, else the
        minmax
      grid's code count.

    Returns:
      (residuals float32[B..., rows, m], codes uint8[B..., rows, m], squared errors float32[B...,
      rows]).
    """
    weights = jnp.asarray(weights, jnp.float32)
    shape = weights.shape
    if (
        weights.ndim < 2
        or jnp.shape(corrections) != shape
        or jnp.shape(scaled) != (*shape[:-2], shape[-1], shape[-1])
        or jnp.shape(factor_diag) != (*shape[:-2], shape[-1])
        or jnp.shape(params) != (*shape[:-1], 2)
    ):
        raise ValueError(
            "gptq_block_call expects weights and corrections [B..., rows, m], scaled [B..., m, "
            "m], "
            f"factor_diag [B..., m] and params [B..., rows, 2]; got {shape}, "
            f"{jnp.shape(corrections)}, "
            f"{jnp.shape(scaled)}, {jnp.shape(factor_diag)}, {jnp.shape(params)}"
        )
    result = (
        jax.ShapeDtypeStruct(shape, jnp.float32),
        jax.ShapeDtypeStruct(shape, jnp.uint8),
        jax.ShapeDtypeStruct(shape[:-1], jnp.float32),
    )
    results = jax.ffi.ffi_call(GPTQ_BLOCK, result, vmap_method="broadcast_all")(
        weights,
        jnp.asarray(corrections, jnp.float32),
        jnp.asarray(scaled, jnp.float32),
        jnp.asarray(factor_diag, jnp.float32),
        jnp.asarray(params, jnp.float32),
        levels=np.int64(levels),
    )
    return _varying_like(results, weights)


def cholesky_base_call(matrix):
    """(L, L⁻¹) of SPD matrices A[B..., n, n] (lower triangle read), on the CPU
    (xla_ffi/cpu_cholesky.h): the diagonal blocks of quant/linalg.py's Cholesky, whose
    ``_base_factor`` is its jnp twin."""
    matrix = jnp.asarray(matrix, jnp.float32)
    if matrix.ndim < 2 or matrix.shape[-1] != matrix.shape[-2]:
        raise ValueError(f"cholesky_base_call expects matrices [B..., n, n]; got {matrix.shape}")
    result = jax.ShapeDtypeStruct(matrix.shape, jnp.float32)
    results = jax.ffi.ffi_call(CHOLESKY_BASE, (result, result), vmap_method="broadcast_all")(matrix)
    return _varying_like(results, matrix)


def dense_matmul_call(x, weights, scales):
    """y float32[N, rows] = (x · Wᵀ) · scales for x float32[N, cols] and weights
    float32|bfloat16|int8[rows, cols] on the CPU (xla_ffi/cpu_dense.h); ``scales`` is
    float32[rows] for int8 weights and float32[0] for the others. No autodiff rule:
    ``kernels.dense`` calls it. Under vmap the kernel runs once per mapped entry."""
    result = jax.ShapeDtypeStruct((x.shape[0], weights.shape[0]), jnp.float32)
    return jax.ffi.ffi_call(DENSE_MATMUL, result, vmap_method="sequential")(x, weights, scales)


def dense_matmul_t_call(x, kernel):
    """y float32[N, out] = x · kernel for x float32[N, in] and a float32 T5X kernel [in, out] on
    the CPU (xla_ffi/cpu_dense.h), for few tokens. No autodiff rule: ``kernels.dense`` calls it.
    Under vmap the kernel runs once per mapped entry."""
    result = jax.ShapeDtypeStruct((x.shape[0], kernel.shape[1]), jnp.float32)
    return jax.ffi.ffi_call(DENSE_MATMUL_TRANSPOSED, result, vmap_method="sequential")(x, kernel)


def _with_input_gradient(call, transposed_call, doc: str):
    """``call(static, codes, row_offsets, minmax, x, tokens)`` with a custom VJP: the input
    gradient is ``transposed_call(static, codes, row_offsets, minmax, g, tokens)``, and the
    compressed arrays and ``tokens`` (counts or expert indexes) get zero cotangents."""

    @functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
    def op(static: Static, codes, row_offsets, minmax, x, tokens):
        return call(static, codes, row_offsets, minmax, x, tokens)

    def forward(static, codes, row_offsets, minmax, x, tokens):
        y = call(static, codes, row_offsets, minmax, x, tokens)
        return y, (codes, row_offsets, minmax, tokens)

    def backward(static, residuals, g):
        codes, row_offsets, minmax, tokens = residuals
        dx = transposed_call(static, codes, row_offsets, minmax, g, tokens)
        # None: a zero cotangent of the right type (float0 for the integer arrays).
        return None, None, None, dx, None

    op.defvjp(forward, backward)
    op.__doc__ = doc
    return op


matmul = _with_input_gradient(
    matmul_call,
    matmul_transposed_call,
    """``matmul_call`` with the input gradient Wᵀ·g (zero for tokens not in use); W itself gets
    zero cotangents.""",
)


@functools.cache
def has_routed_kernels(platform: str) -> bool:
    """Whether the routed products (``matmul_routed``) have a handler on ``platform`` (a jax
    platform or backend name: "cpu", "gpu", "cuda"): the CPU only (xla_ffi/cpu_routed.h)."""
    registered = {"gpu": "CUDA", "cuda": "CUDA"}.get(platform.lower(), platform.lower())
    return MATMUL_ROUTED in qmoe_jax_ext.registrations().get(registered, {})


def matmul_routed_call(static: Static, codes, row_offsets, minmax, x, expert_index):
    """y[N, rows] = W_e·x[n] for x[N, cols] and the stack's expert e = expert_index[n] (int32[N]);
    zero rows for indexes outside [0, E). CPU only; no autodiff rule (``matmul_routed`` has
    one). Under vmap the kernel runs once per mapped entry."""
    result = jax.ShapeDtypeStruct((x.shape[0], minmax.shape[-2]), x.dtype)
    return _call(
        MATMUL_ROUTED,
        static,
        codes,
        row_offsets,
        minmax,
        x,
        expert_index,
        result=result,
        vmap_method="sequential",
    )


def matmul_routed_transposed_call(static: Static, codes, row_offsets, minmax, g, expert_index):
    """dx[N, cols] = W_eᵀ·g[n] for g[N, rows]; zero rows for indexes outside [0, E)."""
    result = jax.ShapeDtypeStruct((g.shape[0], static.cols), g.dtype)
    return _call(
        MATMUL_ROUTED_TRANSPOSED,
        static,
        codes,
        row_offsets,
        minmax,
        g,
        expert_index,
        result=result,
        vmap_method="sequential",
    )


matmul_routed = _with_input_gradient(
    matmul_routed_call,
    matmul_routed_transposed_call,
    """``matmul_routed_call`` with the input gradient W_eᵀ·g (zero for dropped tokens); W and the
    indexes get zero cotangents.""",
)
