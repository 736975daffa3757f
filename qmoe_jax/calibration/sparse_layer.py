"""One sparse layer of the calibration pass: compress it, or replay it from disk.

Lingo as in ``expert_groups``. Compressing a layer yields its stored arrays (see
``qmoe_jax.checkpoints.format_v1``), its statistics, and the gated outputs of
every calibration token through the quantized experts. Replaying a finished
layer decodes its stored codes and computes the same outputs through the same
functions, which is what makes a resumed run bit-identical to an uninterrupted
one.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import numpy as np

from qmoe_jax.calibration.expert_groups import (
    ExpertCompressionConfig,
    QuantizedKernel,
    gather_group,
    group_outputs,
    hessian_token_cap,
    original_expert_outputs,
    quantize_kernels,
    sort_by_expert,
)
from qmoe_jax.checkpoints.layer_arrays import (
    compressed_stack,
    kbit_arrays,
    kernel_cols,
    ternary_arrays,
)
from qmoe_jax.codec import Dictionary, decode_codes, encode_experts
from qmoe_jax.models import SwitchConfig
from qmoe_jax.models.mlp import kernel_names

ReadKernels = Callable[[range], dict[str, np.ndarray]]
DictionaryFor = Callable[[dict[str, QuantizedKernel]], Dictionary]


@dataclasses.dataclass
class LayerTokens:
    """A sparse layer's calibration tokens, in buffer order.

    Attributes:
      inputs: float32[n, d], the MLP inputs (``pre_mlp_layer_norm`` outputs).
      expert: int32[n], routed expert; gate: float32[n]; kept: bool[n] (within capacity).
      premask: bool[n], whether the token may feed a Hessian.
    """

    inputs: np.ndarray
    expert: np.ndarray
    gate: np.ndarray
    kept: np.ndarray
    premask: np.ndarray


@dataclasses.dataclass
class LayerResult:
    outputs: np.ndarray
    arrays: dict
    stats: dict


class OutputError:
    """Relative squared error ``Σ‖y_q − y‖² / Σ‖y‖²`` of a layer's gated expert outputs
    (quantized vs original experts) on its calibration tokens, kept apart for the
    positions that may feed the Hessians and the premasked ones."""

    def __init__(self):
        self.sums = {True: [0.0, 0.0], False: [0.0, 0.0]}

    def add(
        self, quantized: np.ndarray, original: np.ndarray, valid: np.ndarray, premask: np.ndarray
    ) -> None:
        error = np.square(quantized - original, dtype=np.float64).sum(-1)
        norm = np.square(original, dtype=np.float64).sum(-1)
        for side in (True, False):
            chosen = valid & (premask == side)
            self.sums[side][0] += float(error[chosen].sum())
            self.sums[side][1] += float(norm[chosen].sum())

    def relative(self) -> dict:
        """``{"hessian_positions": …, "premasked_positions": …}``; None where there were no such
        tokens."""

        def ratio(e, n):
            return e / n if n > 0 else None

        return {
            "hessian_positions": ratio(*self.sums[True]),
            "premasked_positions": ratio(*self.sums[False]),
        }


def _groups(num_experts: int, group_size: int) -> list[range]:
    return [
        range(start, min(start + group_size, num_experts))
        for start in range(0, num_experts, group_size)
    ]


def _kernel_stats(zeros: int, shape: tuple[int, int, int], arrays: dict, ternary: bool) -> dict:
    experts, rows, cols = shape
    stats = {"zero_fraction": zeros / (experts * rows * cols), "rows": rows, "cols": cols}
    if ternary:
        n_codes = int(arrays["row_offsets"][:, -1].astype(np.int64).sum())
        stats["codewords"] = n_codes
        stats["bits_per_weight"] = (16.0 * n_codes + 64.0 * rows * experts) / (
            rows * cols * experts
        )
    return stats


def compress_layer(
    config: SwitchConfig,
    settings: ExpertCompressionConfig,
    tokens: LayerTokens,
    read_kernels: ReadKernels,
    dictionary_for: DictionaryFor,
    mesh=None,
    on_group: Callable[[int], None] = lambda n: None,
) -> LayerResult:
    """Quantizes and encodes every expert of one sparse layer and computes its outputs.

    Args:
      read_kernels: ``range of experts -> {"wi": [g, d, f], "wo": [g, f, d]}`` from the checkpoint.
      dictionary_for: picks the dictionary from the first group's codes (static or adaptive).
      on_group: progress callback, called with the number of experts finished.
    """
    ternary = settings.grid.kind == "ternary"
    order, starts = sort_by_expert(tokens.expert, tokens.kept, config.num_experts)
    cap = hessian_token_cap(tokens.premask, order, starts, settings.token_cap_factor)
    outputs = np.zeros_like(tokens.inputs)
    names = kernel_names(config)
    zeros = {n: 0 for n in names}
    shapes: dict[str, tuple[int, int, int]] = {}
    stored: dict[str, list] = {n: [] for n in names}
    fallback = np.zeros(config.num_experts, bool)
    seconds = {"read": 0.0, "hessian": 0.0, "gptq": 0.0, "encode": 0.0, "forward": 0.0}
    error = OutputError()
    dictionary = None
    for experts in _groups(config.num_experts, settings.group_size):
        started = time.perf_counter()
        kernels = read_kernels(experts)
        seconds["read"] += time.perf_counter() - started
        group = gather_group(order, starts, experts, tokens.premask, cap)
        inputs = np.where(group.valid[..., None], tokens.inputs[group.rows], 0.0).astype(np.float32)
        quantized, group_fallback, stage_seconds = quantize_kernels(
            config, settings, kernels, inputs, group, mesh
        )
        fallback[experts.start : experts.stop] = group_fallback
        for stage, value in stage_seconds.items():
            seconds[stage] += value
        started = time.perf_counter()
        if ternary and dictionary is None:
            dictionary = dictionary_for(quantized)
        for name, kernel in quantized.items():
            zeros[name] += int(np.count_nonzero(kernel.codes == 0))
            shapes[name] = (config.num_experts,) + kernel.codes.shape[1:]
            stored[name].append(
                encode_experts(kernel.codes, kernel.grid_params, dictionary) if ternary else kernel
            )
        seconds["encode"] += time.perf_counter() - started
        started = time.perf_counter()
        values, gates = _write_outputs(config, settings, quantized, tokens, group, inputs, outputs)
        for e in range(len(experts)):  # one expert's reference outputs at a time
            reference = original_expert_outputs(
                config, kernels, e, inputs[e], gates[e], group.valid[e]
            )
            error.add(values[e], reference, group.valid[e], tokens.premask[group.rows[e]])
        seconds["forward"] += time.perf_counter() - started
        on_group(len(experts))
    arrays = {}
    kernel_stats = {}
    for name in names:
        if ternary:
            arrays[name] = ternary_arrays(stored[name])
        else:
            arrays[name] = kbit_arrays(
                [s.codes for s in stored[name]], [s.grid_params for s in stored[name]]
            )
        kernel_stats[name] = _kernel_stats(zeros[name], shapes[name], arrays[name], ternary)
    counts = np.diff(starts)
    stats = {
        "kernels": kernel_stats,
        "dictionary": dictionary.fingerprint if dictionary is not None else None,
        "fallback_experts": int(fallback.sum()),
        "fallback": np.flatnonzero(fallback).tolist(),
        "output_error": error.relative(),
        "tokens_per_expert": {
            "min": int(counts.min()),
            "mean": float(counts.mean()),
            "max": int(counts.max()),
        },
        "hessian_token_cap": cap,
        "tokens": int(tokens.expert.size),
        "dropped_tokens": int((~tokens.kept).sum()),
        "seconds": seconds,
    }
    return LayerResult(outputs, arrays, stats)


def replay_layer(
    config: SwitchConfig,
    settings: ExpertCompressionConfig,
    tokens: LayerTokens,
    arrays: dict,
    dictionary: Dictionary | None,
) -> np.ndarray:
    """Outputs of a finished layer's stored experts for ``tokens`` (same computation as
    ``compress_layer``)."""
    ternary = settings.grid.kind == "ternary"
    order, starts = sort_by_expert(tokens.expert, tokens.kept, config.num_experts)
    cap = hessian_token_cap(tokens.premask, order, starts, settings.token_cap_factor)
    outputs = np.zeros_like(tokens.inputs)
    for experts in _groups(config.num_experts, settings.group_size):
        group = gather_group(order, starts, experts, tokens.premask, cap)
        inputs = np.where(group.valid[..., None], tokens.inputs[group.rows], 0.0).astype(np.float32)
        quantized = {}
        part = slice(experts.start, experts.stop)
        for name, stored in arrays.items():
            if ternary:
                stack = compressed_stack(
                    stored, kernel_cols(name, config.d_model, config.d_ff), part
                )
                quantized[name] = QuantizedKernel(decode_codes(stack, dictionary), stack.minmax)
            else:
                quantized[name] = QuantizedKernel(
                    np.asarray(stored["codes"])[part], np.asarray(stored["grid_params"])[part]
                )
        _write_outputs(config, settings, quantized, tokens, group, inputs, outputs)
    return outputs


def _write_outputs(config, settings, quantized, tokens: LayerTokens, group, inputs, outputs):
    """Writes the group's gated outputs into ``outputs``; returns them ``[g, n, d]`` and the gates
    ``[g, n]``."""
    gates = np.where(group.valid, tokens.gate[group.rows], 0.0).astype(np.float32)
    values = group_outputs(config, settings.grid, quantized, inputs, gates, group.valid)
    outputs[group.rows[group.valid]] = values[group.valid]
    return values, gates
