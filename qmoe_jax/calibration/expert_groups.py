"""Compressing one sparse layer's experts, group by group (QMoE §3.2–3.4).

Lingo: the layer's MLP inputs of every calibration token sit in ``inputs [n, d]``
(buffer order); routing says which expert each token went to (``expert``), its
gate, and whether it was ``kept`` (within capacity). A *group* is |E| experts
(``group_size``) processed together: their tokens are gathered, padded to one
length, turned into Hessians (premasked and capped at 4× the mean tokens per
expert), quantized by GPTQ in one call (``quant/group.py``: vmapped, or one
expert after another on CPU), and then every kept token of the group
runs through the *quantized* experts; its gated output is written back.
Kernels are fetched from the checkpoint one group at a time.

The Hessians and the experts' forward run one expert at a time, each on its
own tokens only (``token_width``: up to its last one, rounded up to one of 8
steps per power of two), not on the group's padded length: routing is uneven
(the busiest expert of a switch-base-shaped layer gets about twice the mean),
and the padding would multiply the work of both phases by the group's
max/mean (benchmarks/compress_time.py shows the phases; docs/measurements.md).
Each new width compiles its small programs once.

Orientation: T5X kernels are ``wi [E, d, f]``, ``wo [E, f, d]`` (y = x·K);
GPTQ and the compressed format use W = Kᵀ (rows = outputs).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from qmoe_jax.calibration.sublayers import expert_hidden, expert_outputs
from qmoe_jax.models import SwitchConfig
from qmoe_jax.models.mlp import input_kernel_names, kernel_names
from qmoe_jax.quant import (
    GPTQConfig,
    GridConfig,
    cap_tokens,
    dequantize_codes,
    hessian,
    quantize_expert_group,
    rtn,
    token_cap,
)
from qmoe_jax.quant.group import default_sequential, group_devices

# Peak memory of one vmapped GPTQ call, per expert, in float32 arrays: about this
# many [cols, cols] Hessian-sized ones (the Hessian, its damped copy, the Cholesky
# factor) and [rows, cols] weight-sized ones (the weights, their running update,
# the block errors, the dequantized result). Fitted on XLA:CPU to the peak RSS of
# calls of 1-16 switch-base experts (768×3072 and 3072×768), rounded up
# (benchmarks/gptq_memory.py; docs/measurements.md).
HESSIAN_COPIES = 3
WEIGHT_COPIES = 5
# A sequential call (``quantize_expert_group(..., sequential=True)``, CPUs) holds every expert's
# Hessian, weights and uint8 codes, and one expert's working copies per device at a time: these
# many Hessian-sized and weight-sized float32 arrays above the inputs, fitted on XLA:CPU to the
# peak RSS of calls of 1-8 switch-base experts (768×3072 and 3072×768) and rounded up
# (benchmarks/gptq_memory.py; docs/measurements.md).
SEQUENTIAL_HESSIAN_COPIES = 4
SEQUENTIAL_WEIGHT_COPIES = 3


def gptq_call_bytes(
    rows: int, cols: int, experts: int, sequential: bool = False, devices: int = 1
) -> int:
    """Estimated peak bytes of one GPTQ call over ``experts`` W[rows, cols], its inputs included: a
    vmapped call holds every expert's working copies; a ``sequential`` one every expert's Hessian,
    weights and uint8 codes, and one expert's working copies on each of its ``devices``
    (benchmarks/gptq_memory.py measures both)."""
    if sequential:
        working = (
            devices
            * 4
            * cols
            * (SEQUENTIAL_HESSIAN_COPIES * cols + SEQUENTIAL_WEIGHT_COPIES * rows)
        )
        return working + experts * (4 * cols * (cols + rows) + rows * cols)
    return experts * 4 * cols * (HESSIAN_COPIES * cols + WEIGHT_COPIES * rows)


@dataclasses.dataclass(frozen=True)
class ExpertCompressionConfig:
    """How experts are quantized.

    Attributes:
      grid: per-row grid (ternary, or k-bit min-max).
      method: "gptq", or "rtn" (identity Hessian).
      group_size: experts per vmapped GPTQ call (|E|).
      gptq: solver options (damping, block size, act-order).
      true_sequential: the output kernel's Hessian uses the *quantized* input
        kernels' activations (off: original activations, as QMoE).
      token_cap_factor: Hessian tokens per expert are capped at this × the mean.
      gptq_memory: bytes one vmapped GPTQ call may use for its Hessians, weights
        and their working copies; a group that needs more is split evenly into
        several calls (wide kernels, d_ff = 6144 for c-2048, need the most).
    """

    grid: GridConfig = GridConfig()
    method: str = "gptq"
    group_size: int = 16
    gptq: GPTQConfig = GPTQConfig()
    true_sequential: bool = False
    token_cap_factor: float = 4.0
    gptq_memory: int = 256 << 20

    def experts_per_call(
        self, rows: int, cols: int, experts: int, sequential: bool = False, devices: int = 1
    ) -> int:
        """Experts per GPTQ call for ``experts`` W[rows, cols]: within ``gptq_memory`` by
        ``gptq_call_bytes``, and the calls as even as possible (fewer distinct shapes to compile).
        """
        fixed = gptq_call_bytes(
            rows, cols, 0, sequential, devices
        )  # the estimate is fixed + experts × each
        each = gptq_call_bytes(rows, cols, 1, sequential, devices) - fixed
        most = max(1, min(self.group_size, (self.gptq_memory - fixed) // each))
        calls = max(1, -(-experts // most))
        return max(1, -(-experts // calls))

    def __post_init__(self):
        if self.method not in ("gptq", "rtn"):
            raise ValueError(f"method must be 'gptq' or 'rtn', got {self.method!r}")
        if self.group_size < 1:
            raise ValueError(f"group_size must be at least 1, got {self.group_size}")


@dataclasses.dataclass
class QuantizedKernel:
    """One kernel of a group of experts: codes uint8[g, rows, cols] and grid params [g, rows, 2]."""

    codes: np.ndarray
    grid_params: np.ndarray

    def part(self, experts: slice) -> QuantizedKernel:
        return QuantizedKernel(self.codes[experts], self.grid_params[experts])


def _bucket(n: int) -> int:
    """Padded token count: the next power of two (at least 8), to bound the number of jit shapes."""
    return max(8, 1 << max(0, n - 1).bit_length())


# Fewest token rows one expert's forward runs on (where the buffer has them): XLA:CPU's matmul gave
# every row the same bits whatever the number of rows from 64 on, and not below (measured on 8-4096
# rows on a Zen 3 VM), so an expert's outputs stay those of the padded buffer;
# tests/calibration/test_calibration_experts.py checks them to float rounding, which is all that
# correctness needs (every run computes them the same way).
FORWARD_MIN_TOKENS = 64


def token_width(mask: np.ndarray, floor: int = 8) -> int:
    """Token columns of ``mask[..., n]`` (one expert's row, or several) that the work needs: up to
    the last True, rounded up to one of 8 steps per power of two (at most 12.5% over, and few
    distinct jit shapes), at least ``floor``, at most n. Columns past it are all False."""
    kept = np.asarray(mask).reshape(-1, np.shape(mask)[-1]).any(axis=0)
    last = int(np.flatnonzero(kept)[-1]) + 1 if kept.any() else 1
    step = 1 << max(0, last.bit_length() - 4)
    return min(max(floor, -(-last // step) * step), kept.size)


@jax.jit
def _input_hessian(tokens: jax.Array, mask: jax.Array) -> jax.Array:
    return hessian(tokens, mask)


@functools.partial(jax.jit, static_argnums=0)
def _hidden_hessian(
    config: SwitchConfig, input_kernels, tokens: jax.Array, mask: jax.Array
) -> jax.Array:
    """The output kernel's Hessian from one expert's MLP inputs: its hidden activations through
    ``input_kernels``."""
    return hessian(expert_hidden(config, input_kernels, tokens), mask)


@functools.partial(jax.jit, static_argnames="grid")
def _dequantized_t5x(codes: jax.Array, grid_params: jax.Array, *, grid: GridConfig) -> jax.Array:
    return jnp.swapaxes(
        jax.vmap(lambda c, p: dequantize_codes(c, p, grid))(codes, grid_params), 1, 2
    )


def dequantized_t5x_kernel(kernel: QuantizedKernel, grid: GridConfig) -> jax.Array:
    """The quantized kernel as T5X stores it: float32[g, in, out] (W transposed back). Jitted,
    because an eager vmap dispatches each op apart; the values are the same either way (selects, or
    a subtraction then a product)."""
    return _dequantized_t5x(jnp.asarray(kernel.codes), jnp.asarray(kernel.grid_params), grid=grid)


@dataclasses.dataclass
class GroupTokens:
    """The tokens of a group of experts, gathered and padded.

    Attributes:
      rows: int64[g, n] buffer rows of each expert's kept tokens (0 where padding).
      valid: bool[g, n], real tokens.
      hessian_mask: bool[g, n], tokens that feed the Hessians (premasked and capped).
    """

    rows: np.ndarray
    valid: np.ndarray
    hessian_mask: np.ndarray

    def part(self, experts: slice) -> GroupTokens:
        """Some of the group's experts, at the group's width (which sets the rows of their
        forward, ``FORWARD_MIN_TOKENS``)."""
        return GroupTokens(self.rows[experts], self.valid[experts], self.hessian_mask[experts])


def gather_group(
    order: np.ndarray, starts: np.ndarray, experts: range, premask: np.ndarray, cap: int
) -> GroupTokens:
    """Buffer rows of the kept tokens of ``experts``, from the expert-sorted token ``order``."""
    counts = np.asarray([starts[e + 1] - starts[e] for e in experts])
    width = _bucket(int(counts.max(initial=0)))
    rows = np.zeros((len(experts), width), np.int64)
    valid = np.zeros((len(experts), width), bool)
    for slot, e in enumerate(experts):
        members = order[starts[e] : starts[e + 1]]
        rows[slot, : members.size] = members
        valid[slot, : members.size] = True
    hessian_mask = np.asarray(cap_tokens(jnp.asarray(valid & premask[rows]), cap))
    return GroupTokens(rows, valid, hessian_mask)


_rtn_experts = jax.jit(jax.vmap(rtn, in_axes=(0, None)), static_argnums=1)


def quantize_kernels(
    config: SwitchConfig,
    settings: ExpertCompressionConfig,
    kernels: dict[str, np.ndarray],
    inputs: np.ndarray,
    tokens: GroupTokens,
    mesh=None,
) -> tuple[dict[str, QuantizedKernel], np.ndarray, dict]:
    """GPTQ (or RTN) of one group's kernels.

    Args:
      kernels: T5X-oriented float kernels of the group, e.g. ``{"wi": [g, d, f], "wo": [g, f, d]}``.
      inputs: float32[g, n, d], the group's gathered MLP inputs.
      tokens: which of them are real and which feed the Hessians.

    Returns:
      (quantized kernels by name, fallback bool[g], seconds by stage).
    """
    seconds = {"hessian": 0.0, "gptq": 0.0}
    quantized: dict[str, QuantizedKernel] = {}
    fallback = np.zeros(len(tokens.rows), bool)
    names = input_kernel_names(config)

    def weights_of(name: str, part: slice = slice(None)) -> jax.Array:
        return jnp.swapaxes(jnp.asarray(kernels[name][part], jnp.float32), 1, 2)

    if settings.method == "rtn":
        started = time.perf_counter()
        for name in kernel_names(config):
            codes, params = _rtn_experts(weights_of(name), settings.grid)
            quantized[name] = QuantizedKernel(np.asarray(codes), np.asarray(params))
        seconds["gptq"] += time.perf_counter() - started
        return quantized, fallback, seconds

    counts = tokens.hessian_mask.sum(axis=1, dtype=np.int32)
    widths = [token_width(tokens.hessian_mask[e]) for e in range(len(tokens.rows))]

    def expert_tokens(e: int) -> tuple[jax.Array, jax.Array]:
        """Expert e's MLP inputs and Hessian mask, on its own width (not the group's)."""
        return jnp.asarray(inputs[e, : widths[e]]), jnp.asarray(tokens.hessian_mask[e, : widths[e]])

    def input_hessian(e: int) -> jax.Array:
        return _input_hessian(*expert_tokens(e))

    def output_hessian(e: int) -> jax.Array:
        """wo's Hessian of expert e: its activations through the original input kernels (QMoE), or
        through the quantized ones (true-sequential)."""
        if settings.true_sequential:
            in_kernels = {
                n: dequantized_t5x_kernel(quantized[n].part(slice(e, e + 1)), settings.grid)[0]
                for n in names
            }
        else:
            in_kernels = {n: jnp.asarray(kernels[n][e], jnp.float32) for n in names}
        return _hidden_hessian(config, in_kernels, *expert_tokens(e))

    def quantize(name: str, hessian_of: Callable[[int], jax.Array], cols: int) -> None:
        """Hessians + GPTQ of one kernel, in calls of at most ``experts_per_call`` experts;
        ``hessian_of(e)`` gives expert e's Hessian for the kernel."""
        experts = len(tokens.rows)
        rows = kernels[name].shape[2]  # T5X kernels are [g, in, out]: W has out rows
        devices = group_devices(mesh)
        step = settings.experts_per_call(
            rows, cols, experts, default_sequential(devices), len(devices)
        )
        codes, params = [], []
        for start in range(0, experts, step):
            part = slice(start, start + step)
            started = time.perf_counter()
            hessians = jnp.stack([hessian_of(e) for e in range(experts)[part]])
            hessians.block_until_ready()
            seconds["hessian"] += time.perf_counter() - started
            started = time.perf_counter()
            result = quantize_expert_group(
                weights_of(name, part),
                hessians,
                jnp.asarray(counts[part]),
                settings.grid,
                settings.gptq,
                mesh=mesh,
            )
            del hessians
            codes.append(np.asarray(result.codes))
            params.append(np.asarray(result.grid_params))
            fallback[part] |= np.asarray(result.fallback)
            seconds["gptq"] += time.perf_counter() - started
        quantized[name] = QuantizedKernel(np.concatenate(codes), np.concatenate(params))

    for name in names:
        quantize(name, input_hessian, config.d_model)
    quantize("wo", output_hessian, config.d_ff)
    return quantized, fallback, seconds


def _expert_outputs(
    config: SwitchConfig,
    in_kernels,
    out_kernel,
    inputs: np.ndarray,
    gates: np.ndarray,
    valid: np.ndarray,
) -> np.ndarray:
    """Gated outputs ``[n, d]`` of one expert for its tokens ``inputs [n, d]``: computed on its own
    width (``token_width`` of ``valid``, at least FORWARD_MIN_TOKENS), zero past it."""
    width = token_width(valid, floor=FORWARD_MIN_TOKENS)
    outputs = np.zeros(inputs.shape, np.float32)
    outputs[:width] = np.asarray(
        expert_outputs(
            config, in_kernels, out_kernel, jnp.asarray(inputs[:width]), jnp.asarray(gates[:width])
        )
    )
    return outputs


def group_outputs(
    config: SwitchConfig,
    grid: GridConfig,
    quantized: dict[str, QuantizedKernel],
    inputs: np.ndarray,
    gates: np.ndarray,
    valid: np.ndarray,
) -> np.ndarray:
    """Gated outputs ``[g, n, d]`` of the group's tokens (``valid [g, n]``) through the quantized
    experts."""
    names = input_kernel_names(config)
    outputs = np.empty(inputs.shape, np.float32)
    for e in range(inputs.shape[0]):  # one expert's dequantized kernels at a time
        one = slice(e, e + 1)
        in_kernels = {n: dequantized_t5x_kernel(quantized[n].part(one), grid)[0] for n in names}
        out_kernel = dequantized_t5x_kernel(quantized["wo"].part(one), grid)[0]
        outputs[e] = _expert_outputs(config, in_kernels, out_kernel, inputs[e], gates[e], valid[e])
    return outputs


def original_expert_outputs(
    config: SwitchConfig,
    kernels: dict[str, np.ndarray],
    expert: int,
    inputs: np.ndarray,
    gates: np.ndarray,
    valid: np.ndarray,
) -> np.ndarray:
    """Gated outputs ``[n, d]`` of one expert of the group (tokens ``valid [n]``) through its
    original (T5X float) kernels."""
    in_kernels = {
        n: jnp.asarray(kernels[n][expert], jnp.float32) for n in input_kernel_names(config)
    }
    out_kernel = jnp.asarray(kernels["wo"][expert], jnp.float32)
    return _expert_outputs(config, in_kernels, out_kernel, inputs, gates, valid)


def sort_by_expert(
    expert: np.ndarray, kept: np.ndarray, num_experts: int
) -> tuple[np.ndarray, np.ndarray]:
    """(order, starts): kept token rows grouped by expert in buffer order; expert e owns
    order[starts[e]:starts[e+1]]."""
    kept_rows = np.flatnonzero(kept)
    order = kept_rows[np.argsort(expert[kept_rows], kind="stable")]
    counts = np.bincount(expert[kept_rows], minlength=num_experts)
    return order, np.concatenate([[0], np.cumsum(counts)])


def hessian_token_cap(
    premask: np.ndarray, order: np.ndarray, starts: np.ndarray, factor: float
) -> int:
    """The cap on Hessian tokens per expert: ``factor`` × the mean count of premasked tokens."""
    # Counts from a running sum: experts without tokens (anywhere, the last ones too) count 0.
    running = np.concatenate([[0], np.cumsum(premask[order], dtype=np.int64)])
    counts = running[starts[1:]] - running[starts[:-1]]
    return int(token_cap(jnp.asarray(counts), factor))
