"""Fused decode-and-multiply ops on compressed matrices (the QMoE kernels).

Lingo: W[rows, cols] in y = W·x orientation, stored in format v1 (docs/format.md)
as a ``CompressedMatrix``; a ``CompressedExperts`` stack holds E matrices
of one layer. The ops decode W on the fly inside an XLA FFI call and never
materialize it: ``matvec`` for tokens one by one, ``matmul`` for N tokens
sharing a matrix (each row is decoded once for all of them), ``dequantize``
for the dense bf16 matrix. Sums accumulate in float32; results have the
dtype of x (float32 or bfloat16).

Routed execution: ``matmul_routed`` takes a sparse layer's tokens as they are, ``[N, cols]``,
with the index of each token's expert in a stack, and multiplies each by its own expert; no
``[E, slots, cols]`` buffer is filled (the CPU kernel of xla_ffi/cpu_routed.h; elsewhere a
gathered form).

Routing-aware execution: ``matvec`` and ``matmul`` take ``counts``, the
tokens in use of each matrix (int32[E] for a stack, a scalar for a matrix):
only the first counts[e] tokens of x[e] are computed, the others give zero
rows (and zero input gradients) and are not read, and an expert whose count
is 0 is skipped: its codes are not decoded and its row offsets not checked.
Counts are clamped to [0, N] (N: tokens per matrix), so a router's token
count per expert, which exceeds N when tokens are dropped at capacity, can be
passed as is. The work of a call follows the tokens in use: a decoding step
of one token in a stack of 128 experts decodes one expert.

Autodiff: the compressed weights are frozen (their cotangents are zero, as
in QMoE fine-tuning of the dense layers); the input gradient Wᵀ·g is another
fused call on the compressed form. vmap folds mapped axes into the kernels'
leading batch dims; a stack sharded over devices along E runs expert-locally
under ``jax.shard_map`` (``expert_parallel``).

Every op has a pure-jnp twin with the same signature (``*_reference``) that
decodes W densely with ``codec.decode_codes_jnp``; tests hold the kernels to
them. The CPU kernels pick AVX-512, AVX2 or portable code at run time, the
first of ``cpu_isas()`` (AVX2 before AVX-512, the faster of the two on every
AVX-512 CPU measured: docs/cpu_kernels.md §1); the environment variable
QMOE_CPU_ISA forces one.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

from qmoe_jax.codec.containers import CompressedExperts, CompressedMatrix
from qmoe_jax.codec.dictionary import Dictionary
from qmoe_jax.codec.reference import decode_codes_jnp
from qmoe_jax.kernels import bindings

Compressed = CompressedMatrix | CompressedExperts
# core(static, codes, row_offsets, minmax, x[B..., N, cols], counts int32[B...])
#   -> y[B..., N, rows]
_Core = Callable[..., jax.Array]

cpu_isas = bindings.cpu_isas
has_cuda_kernels = bindings.has_cuda_kernels
has_routed_kernels = bindings.has_routed_kernels


_FORMAT_DTYPES = (jnp.dtype(jnp.uint16), jnp.dtype(jnp.int32), jnp.dtype(jnp.bfloat16))


def _frozen_arrays(w: Compressed) -> tuple[jax.Array, jax.Array, jax.Array]:
    if not isinstance(w, (CompressedMatrix, CompressedExperts)):
        raise TypeError(f"expected a CompressedMatrix or CompressedExperts, got {type(w).__name__}")
    arrays = (jnp.asarray(w.codes), jnp.asarray(w.row_offsets), jnp.asarray(w.minmax))
    for name, array, dtype in zip(
        ("codes", "row_offsets", "minmax"), arrays, _FORMAT_DTYPES, strict=True
    ):
        if array.dtype != dtype:
            raise TypeError(
                f"w.{name} must be {dtype} (format v1), got {array.dtype}; "
                "build compressed matrices with qmoe_jax.codec"
            )
    return jax.lax.stop_gradient(arrays)


def _dense_input(w: Compressed, x, what: str) -> jax.Array:
    x = jnp.asarray(x)
    if x.dtype not in bindings.FLOAT_DTYPES:
        raise TypeError(f"{what} must be float32 or bfloat16, got {x.dtype}; cast it first")
    if x.ndim == 0 or x.shape[-1] != w.cols:
        raise ValueError(
            f"{what} has shape {x.shape}, but W[{w.rows}, {w.cols}] needs {w.cols} columns last"
        )
    if isinstance(w, CompressedExperts) and (x.ndim < 2 or x.shape[0] != w.num_experts):
        raise ValueError(
            f"{what} has shape {x.shape}, but a stack of {w.num_experts} experts needs "
            f"[{w.num_experts}, ..., {w.cols}]"
        )
    return x


def _token_input(w: Compressed, x_tokens) -> jax.Array:
    x_tokens = _dense_input(w, x_tokens, "x_tokens")
    expected = 3 if isinstance(w, CompressedExperts) else 2
    if x_tokens.ndim != expected:
        layout = "[E, C, cols]" if expected == 3 else "[N, cols]"
        raise ValueError(
            f"x_tokens must be {layout}, got shape {x_tokens.shape}; matvec takes other layouts"
        )
    return x_tokens


def _token_counts(counts, tokens: jax.Array) -> jax.Array:
    """The kernels' counts for tokens [B..., N, cols] (B = (E,) for a stack, () for a
    matrix): ``counts`` as int32[B...], or int32[1...] = N when it is None."""
    if counts is None:
        return bindings.all_tokens(tokens)
    counts = jnp.asarray(counts)
    batch = tokens.shape[:-2]
    if not jnp.issubdtype(counts.dtype, jnp.integer):
        raise TypeError(f"counts must be an integer array (int32), got {counts.dtype}")
    if counts.shape != batch:
        what = f"int32[{batch[0]}], one count per expert" if batch else "an int32 scalar"
        raise ValueError(f"counts must be {what}; got shape {counts.shape}")
    if counts.dtype != jnp.int32:  # clamp before narrowing, so that no count wraps around
        counts = jnp.clip(counts, 0, tokens.shape[-2]).astype(jnp.int32)
    return counts


def _apply(core: _Core, w: Compressed, x: jax.Array, dictionary: Dictionary, counts) -> jax.Array:
    """y[B..., tokens..., rows] for x[B..., tokens..., cols]; B = (E,) for a stack.

    counts (int32[B...] or None) counts the tokens in use over the tokens...
    dims flattened in row-major order.
    """
    batch = x.shape[:1] if isinstance(w, CompressedExperts) else ()
    token_shape = x.shape[len(batch) : -1]
    tokens = x.reshape(*batch, math.prod(token_shape), w.cols)
    static = bindings.Static(dictionary, w.cols)
    y = core(static, *_frozen_arrays(w), tokens, _token_counts(counts, tokens))
    return y.reshape(*batch, *token_shape, w.rows)


@functools.partial(jax.jit, static_argnums=(0, 4))
def _dense_weights(dictionary: Dictionary, codes, row_offsets, minmax, cols: int) -> jax.Array:
    """W as float32[B..., rows, cols], decoded in jnp (B... = leading dims of the arrays)."""
    batch = minmax.shape[:-2]
    size = math.prod(batch)
    stack = CompressedExperts(
        codes.reshape(size, codes.shape[-1]),
        row_offsets.reshape(size, row_offsets.shape[-1]),
        minmax.reshape(size, *minmax.shape[-2:]),
        cols,
    )
    ternary = decode_codes_jnp(stack, dictionary)
    values = stack.minmax.astype(jnp.float32)
    dense = jnp.where(ternary == 2, values[..., 1:], jnp.where(ternary == 1, values[..., :1], 0.0))
    return dense.reshape(*batch, *dense.shape[1:])


@functools.partial(jax.jit, static_argnums=0)
def _reference_core(static, codes, row_offsets, minmax, x, counts):
    dtype = x.dtype
    dense = _dense_weights(static.dictionary, codes, row_offsets, minmax, static.cols)
    x = x.astype(jnp.float32)
    y = jnp.einsum("...nc,...rc->...nr", x, dense, precision=jax.lax.Precision.HIGHEST)
    in_use = jnp.arange(x.shape[-2]) < counts[..., None]  # [B..., N]
    return jnp.where(in_use[..., None], y, 0.0).astype(dtype)


def matvec(w: Compressed, x, dictionary: Dictionary, counts=None) -> jax.Array:
    """y = W·x without materializing W.

    Args:
      w: CompressedMatrix W[rows, cols], or CompressedExperts of E matrices.
      x: float32 or bfloat16 [..., cols] for a matrix; [E, ..., cols] for a
        stack (expert e multiplies x[e]).
      dictionary: the dictionary ``w`` was encoded with.
      counts: optional tokens in use, int32[E] for a stack (an int32 scalar
        for a matrix), counted over the ``...`` dims flattened in row-major
        order (for x [E, cols], 1 if expert e is used, 0 if not). Entries
        past the count give zeros and are not read; clamped to [0, tokens].
        None: every entry.

    Returns:
      [..., rows] (or [E, ..., rows]) in the dtype of x. All leading entries
      go through one kernel call, each row decoded once for all of them.
    """
    return _apply(bindings.matmul, w, _dense_input(w, x, "x"), dictionary, counts)


def matmul(w: Compressed, x_tokens, dictionary: Dictionary, counts=None) -> jax.Array:
    """Y = X·Wᵀ for N tokens routed to the same matrix, decoding W once.

    Args:
      w: CompressedMatrix W[rows, cols], or CompressedExperts of E matrices.
      x_tokens: float32 or bfloat16 [N, cols] for a matrix; [E, C, cols]
        (C tokens dispatched to each expert) for a stack.
      dictionary: the dictionary ``w`` was encoded with.
      counts: optional tokens in use: int32[E] for a stack (an int32 scalar
        for a matrix). Only x_tokens[e, :counts[e]] are computed; the other
        rows of the result (and of the input gradient) are zeros and those
        of x_tokens are not read; an expert with count 0 is not decoded.
        Clamped to [0, C]; None: all C.

    Returns:
      [N, rows] (or [E, C, rows]) in the dtype of x_tokens.
    """
    return _apply(bindings.matmul, w, _token_input(w, x_tokens), dictionary, counts)


def _routed_operands(w, x_tokens, expert_index) -> tuple[jax.Array, jax.Array]:
    if not isinstance(w, CompressedExperts):
        raise TypeError(
            f"matmul_routed needs a CompressedExperts stack, got {type(w).__name__}; for one "
            "matrix use matmul"
        )
    x_tokens = jnp.asarray(x_tokens)
    if x_tokens.dtype not in bindings.FLOAT_DTYPES:
        raise TypeError(
            f"x_tokens must be float32 or bfloat16, got {x_tokens.dtype}; cast it first"
        )
    if x_tokens.ndim != 2 or x_tokens.shape[-1] != w.cols:
        raise ValueError(
            f"x_tokens has shape {x_tokens.shape}, but matmul_routed takes [N, {w.cols}] (the "
            f"stack's W[{w.rows}, {w.cols}] needs {w.cols} columns last)"
        )
    expert_index = jnp.asarray(expert_index)
    if not jnp.issubdtype(expert_index.dtype, jnp.integer):
        raise TypeError(f"expert_index must be an integer array (int32), got {expert_index.dtype}")
    if expert_index.shape != x_tokens.shape[:1]:
        raise ValueError(
            f"expert_index must be int[{x_tokens.shape[0]}], one expert per token; got shape "
            f"{expert_index.shape}"
        )
    if expert_index.dtype != jnp.int32:  # out of range stays out of range when narrowed
        expert_index = jnp.where(
            (expert_index >= 0) & (expert_index < w.num_experts), expert_index, -1
        ).astype(jnp.int32)
    return x_tokens, expert_index


def _routed_gathered(w: CompressedExperts, x, expert_index, dictionary: Dictionary) -> jax.Array:
    """``matmul_routed`` without its own kernel: each token's expert gathered out of the stack
    (one matrix per token) and one ``matmul`` call over the N matrices, with the tokens of
    indexes out of range not in use."""
    in_range = (expert_index >= 0) & (expert_index < w.num_experts)
    stacks = w.take(jnp.clip(expert_index, 0, w.num_experts - 1))
    return matmul(stacks, x[:, None, :], dictionary, in_range.astype(jnp.int32))[:, 0]


def matmul_routed(w: CompressedExperts, x_tokens, expert_index, dictionary: Dictionary):
    """Y[n] = W_e · x[n] with e = expert_index[n]: each token through the expert it names.

    A sparse layer's expert products with no dispatch buffer: the tokens stay in their order,
    the kernel groups them by expert, decodes each named expert once for all its tokens and
    skips the others. Its memory is the N tokens' own, however many experts the stack has and
    however the tokens spread over them.

    Args:
      w: CompressedExperts, E matrices W[rows, cols].
      x_tokens: float32 or bfloat16 [N, cols].
      expert_index: int[N]; a token whose index is outside [0, E) (one dropped at capacity)
        gets a zero row, and its input gradient is zero.
      dictionary: the dictionary ``w`` was encoded with.

    Returns:
      [N, rows] in the dtype of x_tokens.

    On the CPU this is one call of the routed kernel (xla_ffi/cpu_routed.h). Other platforms
    have no routed kernel: there each token's expert is gathered out of the stack (its codes,
    row offsets and min/max, one matrix per token) and ``matmul`` multiplies the N of them,
    which holds N matrices' codes and decodes an expert once per token.
    """
    x_tokens, expert_index = _routed_operands(w, x_tokens, expert_index)
    static = bindings.Static(dictionary, w.cols)
    arrays = _frozen_arrays(w)

    def kernel(x, index):
        return bindings.matmul_routed(static, *arrays, x, index)

    def gathered(x, index):
        return _routed_gathered(w, x, index, dictionary)

    return jax.lax.platform_dependent(x_tokens, expert_index, cpu=kernel, default=gathered)


def matmul_routed_reference(w: CompressedExperts, x_tokens, expert_index, dictionary: Dictionary):
    """``matmul_routed`` in pure jnp: the stack decoded densely, each token multiplied in float32
    by its expert's matrix, zeros for indexes out of range."""
    x_tokens, expert_index = _routed_operands(w, x_tokens, expert_index)
    dense = _dense_weights(dictionary, *_frozen_arrays(w), w.cols)  # [E, rows, cols]
    in_range = (expert_index >= 0) & (expert_index < w.num_experts)
    routed = dense[jnp.clip(expert_index, 0, w.num_experts - 1)]  # [N, rows, cols]
    y = jnp.einsum(
        "nc,nrc->nr",
        x_tokens.astype(jnp.float32),
        routed,
        precision=jax.lax.Precision.HIGHEST,
    )
    return jnp.where(in_range[:, None], y, 0.0).astype(x_tokens.dtype)


def dequantize(w: Compressed, dictionary: Dictionary) -> jax.Array:
    """W as bfloat16[rows, cols] (or [E, rows, cols] for a stack)."""
    static = bindings.Static(dictionary, w.cols)
    return bindings.dequantize_call(static, *_frozen_arrays(w))


def matvec_reference(w: Compressed, x, dictionary: Dictionary, counts=None) -> jax.Array:
    """``matvec`` in pure jnp: decode W densely, multiply in float32, zero the
    entries not in use."""
    return _apply(_reference_core, w, _dense_input(w, x, "x"), dictionary, counts)


def matmul_reference(w: Compressed, x_tokens, dictionary: Dictionary, counts=None) -> jax.Array:
    """``matmul`` in pure jnp."""
    return _apply(_reference_core, w, _token_input(w, x_tokens), dictionary, counts)


def dequantize_reference(w: Compressed, dictionary: Dictionary) -> jax.Array:
    """``dequantize`` in pure jnp."""
    return _dense_weights(dictionary, *_frozen_arrays(w), w.cols).astype(jnp.bfloat16)


def expert_parallel(op: Callable, mesh: jax.sharding.Mesh, axis: str = "expert") -> Callable:
    """Runs ``op`` expert-locally on a stack sharded over devices along E.

    Args:
      op: ``matvec``, ``matmul`` or a twin, called as op(w, x, dictionary)
        or op(w, x, dictionary, counts).
      mesh: a mesh with an axis named ``axis``; E must divide by its size.
      axis: the mesh axis the experts are sharded over.

    Returns:
      f(w: CompressedExperts, x [E, ...], dictionary, counts=None) -> [E, ...],
      sharded along E, with counts int32[E] sharded like the experts. Each
      device calls the kernel on its own experts (one call for all of them),
      so neither weights nor tokens are all-gathered. Inside your own
      ``jax.shard_map``, call the ops directly with ``check_vma=False``, as
      here.
    """
    spec = jax.sharding.PartitionSpec(axis)

    def sharded(w: CompressedExperts, x, dictionary: Dictionary, counts=None) -> jax.Array:
        arrays = (w, x) if counts is None else (w, x, counts)
        # check_vma=False: FFI results carry no varying-axes type, which the
        # input gradient of a custom_vjp would otherwise have to match.
        local = jax.shard_map(
            lambda w, x, *counts: op(w, x, dictionary, *counts),
            mesh=mesh,
            in_specs=(spec,) * len(arrays),
            out_specs=spec,
            check_vma=False,
        )
        return local(*arrays)

    return sharded
