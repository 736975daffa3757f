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
from typing import Any

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
from qmoe_jax.calibration.expert_share import ExpertShare
from qmoe_jax.checkpoints.layer_arrays import (
    compressed_stack,
    kbit_arrays,
    kernel_cols,
    ternary_arrays,
)
from qmoe_jax.codec import Dictionary, decode_codes, encode_experts
from qmoe_jax.malloc import release_free_memory
from qmoe_jax.models import SwitchConfig
from qmoe_jax.models.mlp import kernel_names

ReadKernels = Callable[[range], dict[str, np.ndarray]]
DictionaryFor = Callable[[float], Dictionary]  # from the first group's zero fraction
STAGES = ("read", "hessian", "gptq", "encode", "forward")
ALONE = ExpertShare()  # the share of a one-process run: every expert


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
    positions that may feed the Hessians and the premasked ones. Sums are added one expert at a
    time, in expert order (``expert_sums``, ``add_sums``), wherever each expert was computed."""

    def __init__(self):
        self.sums = {True: [0.0, 0.0], False: [0.0, 0.0]}

    @staticmethod
    def expert_sums(
        quantized: np.ndarray, original: np.ndarray, valid: np.ndarray, premask: np.ndarray
    ) -> tuple[tuple[float, float], tuple[float, float]]:
        """One expert's ((error, norm) at the Hessian positions, (error, norm) at the premasked
        ones)."""
        error = np.square(quantized - original, dtype=np.float64).sum(-1)
        norm = np.square(original, dtype=np.float64).sum(-1)
        sides = []
        for side in (True, False):
            chosen = valid & (premask == side)
            sides.append((float(error[chosen].sum()), float(norm[chosen].sum())))
        return sides[0], sides[1]

    def add_sums(self, sums: tuple[tuple[float, float], tuple[float, float]]) -> None:
        for side, (error, norm) in zip((True, False), sums, strict=True):
            self.sums[side][0] += error
            self.sums[side][1] += norm

    def add(
        self, quantized: np.ndarray, original: np.ndarray, valid: np.ndarray, premask: np.ndarray
    ) -> None:
        self.add_sums(self.expert_sums(quantized, original, valid, premask))

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


@dataclasses.dataclass
class PartResult:
    """What one process computed of a group (its ``ExpertShare.owned`` experts), as the processes
    exchange it.

    Attributes:
      experts: the part's experts (a range of the layer's; may be empty).
      fallback: bool[k], experts rounded to nearest.
      zeros: zero codes per kernel; shapes: (rows, cols) per kernel (empty for an empty part).
      encoded: per kernel, the part's ``CompressedExperts`` (ternary) or ``QuantizedKernel``.
      rows, values: buffer rows int64[t] of the part's kept tokens and their gated outputs
        float32[t, d] through the quantized experts.
      errors: per expert, ``OutputError.expert_sums``.
      seconds: the part's seconds per stage in this process.
    """

    experts: range
    fallback: np.ndarray
    zeros: dict[str, int]
    shapes: dict[str, tuple[int, int]]
    encoded: dict[str, Any]
    rows: np.ndarray
    values: np.ndarray
    errors: list
    seconds: dict[str, float]


class _Part:
    """One process's part of a group: its kernels read, quantized (``quantize``), then encoded and
    run on their tokens (``finish``)."""

    def __init__(self, config, settings, tokens: LayerTokens, group, experts: range, read, mesh):
        self.config, self.settings, self.tokens = config, settings, tokens
        self.group, self.experts, self.read, self.mesh = group, experts, read, mesh
        self.seconds = dict.fromkeys(STAGES, 0.0)
        self.quantized: dict[str, QuantizedKernel] | None = None

    def quantize(self) -> tuple[int, int]:
        """Quantizes the part once; returns (zero codes, codes) over its kernels."""
        if self.quantized is None:
            self.quantized, self.fallback = {}, np.zeros(0, bool)
            if len(self.experts):
                started = time.perf_counter()
                self.kernels = self.read(self.experts)
                self.seconds["read"] += time.perf_counter() - started
                group = self.group
                self.inputs = np.where(
                    group.valid[..., None], self.tokens.inputs[group.rows], 0.0
                ).astype(np.float32)
                self.quantized, self.fallback, stage_seconds = quantize_kernels(
                    self.config, self.settings, self.kernels, self.inputs, group, self.mesh
                )
                for stage, value in stage_seconds.items():
                    self.seconds[stage] += value
        return (
            sum(int(np.count_nonzero(k.codes == 0)) for k in self.quantized.values()),
            sum(k.codes.size for k in self.quantized.values()),
        )

    def finish(self, dictionary: Dictionary | None) -> PartResult:
        """Encodes the part (with ``dictionary`` for a ternary grid) and runs its tokens through
        its quantized and its original experts."""
        self.quantize()
        config, group, tokens = self.config, self.group, self.tokens
        started = time.perf_counter()
        zeros, shapes, encoded = {}, {}, {}
        for name, kernel in self.quantized.items():
            zeros[name] = int(np.count_nonzero(kernel.codes == 0))
            shapes[name] = kernel.codes.shape[1:]
            encoded[name] = (
                encode_experts(kernel.codes, kernel.grid_params, dictionary)
                if self.settings.grid.kind == "ternary"
                else kernel
            )
        self.seconds["encode"] += time.perf_counter() - started
        started = time.perf_counter()
        errors = []
        rows = group.rows[group.valid]
        values = np.zeros((0, config.d_model), np.float32)
        if len(self.experts):
            all_values, gates = _group_values(
                config, self.settings, self.quantized, tokens, group, self.inputs
            )
            values = all_values[group.valid]
            for e in range(len(self.experts)):  # one expert's reference outputs at a time
                reference = original_expert_outputs(
                    config, self.kernels, e, self.inputs[e], gates[e], group.valid[e]
                )
                errors.append(
                    OutputError.expert_sums(
                        all_values[e], reference, group.valid[e], tokens.premask[group.rows[e]]
                    )
                )
        self.seconds["forward"] += time.perf_counter() - started
        return PartResult(
            self.experts,
            self.fallback,
            zeros,
            shapes,
            encoded,
            rows,
            values,
            errors,
            self.seconds,
        )


def compress_layer(
    config: SwitchConfig,
    settings: ExpertCompressionConfig,
    tokens: LayerTokens,
    read_kernels: ReadKernels,
    dictionary_for: DictionaryFor,
    mesh=None,
    on_group: Callable[[int], None] = lambda n: None,
    share: ExpertShare = ALONE,
) -> LayerResult:
    """Quantizes and encodes every expert of one sparse layer and computes its outputs.

    Args:
      read_kernels: ``range of experts -> {"wi": [g, d, f], "wo": [g, f, d]}`` from the checkpoint.
      dictionary_for: picks the dictionary from the first group's zero fraction (static or
        adaptive).
      on_group: progress callback, called with the number of experts finished.
      share: the experts this process computes, when several share the run (``ExpertShare``);
        every process returns the whole layer's result.
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
    seconds = dict.fromkeys(STAGES, 0.0)
    error = OutputError()
    dictionary = None
    for experts in _groups(config.num_experts, settings.group_size):
        own = share.owned(experts)
        group = gather_group(order, starts, experts, tokens.premask, cap)
        part = _Part(
            config,
            settings,
            tokens,
            group.part(slice(own.start - experts.start, own.stop - experts.start)),
            own,
            read_kernels,
            mesh,
        )
        group_seconds = dict.fromkeys(STAGES, 0.0)
        if ternary and dictionary is None:
            counted = share.gather(part.quantize)
            started = time.perf_counter()
            dictionary = dictionary_for(
                sum(zero for zero, _ in counted) / sum(size for _, size in counted)
            )
            group_seconds["encode"] += time.perf_counter() - started
        parts = share.gather(lambda part=part, dictionary=dictionary: part.finish(dictionary))
        for result in parts:  # in process order, which is expert order
            fallback[result.experts.start : result.experts.stop] = result.fallback
            for name in result.encoded:
                zeros[name] += result.zeros[name]
                shapes[name] = (config.num_experts,) + tuple(result.shapes[name])
                stored[name].append(result.encoded[name])
            outputs[result.rows] = result.values
            for sums in result.errors:
                error.add_sums(sums)
            for stage, value in result.seconds.items():  # the slowest process's
                group_seconds[stage] = max(group_seconds[stage], value)
        for stage, value in group_seconds.items():
            seconds[stage] += value
        # The group's kernels, inputs and outputs, and XLA's buffers for its calls, were freed in
        # many blocks of a few MiB that glibc keeps in its heaps (in the resident set), and the
        # next group's differently sized blocks do not reuse all of them: returned to the system
        # here, a layer's peak is one group's work instead of the sum of its leftovers
        # (docs/measurements.md, streaming.py).
        del group, part, parts, result
        release_free_memory()
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
    share: ExpertShare = ALONE,
) -> np.ndarray:
    """Outputs of a finished layer's stored experts for ``tokens`` (same computation as
    ``compress_layer``); each process of a shared run computes its ``share``'s experts."""
    ternary = settings.grid.kind == "ternary"
    order, starts = sort_by_expert(tokens.expert, tokens.kept, config.num_experts)
    cap = hessian_token_cap(tokens.premask, order, starts, settings.token_cap_factor)
    outputs = np.zeros_like(tokens.inputs)
    for experts in _groups(config.num_experts, settings.group_size):
        own = share.owned(experts)
        group = gather_group(order, starts, experts, tokens.premask, cap).part(
            slice(own.start - experts.start, own.stop - experts.start)
        )

        def replay_part(group=group, own=own) -> tuple[np.ndarray, np.ndarray]:
            if not len(own):
                return group.rows[group.valid], np.zeros((0, config.d_model), np.float32)
            inputs = np.where(group.valid[..., None], tokens.inputs[group.rows], 0.0).astype(
                np.float32
            )
            quantized = {}
            part = slice(own.start, own.stop)
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
            values, _ = _group_values(config, settings, quantized, tokens, group, inputs)
            return group.rows[group.valid], values[group.valid]

        for rows, values in share.gather(replay_part):
            outputs[rows] = values
    return outputs


def _group_values(config, settings, quantized, tokens: LayerTokens, group, inputs):
    """The group's gated outputs ``[g, n, d]`` through its quantized experts, and the gates
    ``[g, n]``."""
    gates = np.where(group.valid, tokens.gate[group.rows], 0.0).astype(np.float32)
    values = group_outputs(config, settings.grid, quantized, inputs, gates, group.valid)
    return values, gates
