"""The main job as a function: checkpoint + calibration text → compressed checkpoint + report.

``python -m qmoe_jax.compress`` parses its flags into ``CompressionOptions`` and
calls ``compress_checkpoint``; everything here is importable and tested.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import time
from collections.abc import Callable

import jax
import numpy as np

from qmoe_jax import bundled
from qmoe_jax.calibration.data import calibration_data
from qmoe_jax.calibration.experts import ExpertCompressionConfig
from qmoe_jax.calibration.pipeline import CalibrationConfig, CalibrationPass
from qmoe_jax.checkpoints import T5XCheckpoint, open_t5x_checkpoint, path_shapes
from qmoe_jax.checkpoints.compressed import CompressedCheckpointWriter
from qmoe_jax.inference.compressed import load_compressed_model
from qmoe_jax.data import SpanCorruptionConfig, Tokenizer, c4_documents, check_premask, corpus, text_file_documents
from qmoe_jax.inference import load_t5x_params, mean_cross_entropies, validation_set
from qmoe_jax.inference.loading import infer_config
from qmoe_jax.models import SwitchConfig, SwitchTransformer, get_config, param_shapes
from qmoe_jax.quant import GPTQConfig, GridConfig
from qmoe_jax.report import build_report, summary_table, write_report

BUNDLED_EVAL_EXAMPLES = 256
GRIDS = {"ternary": GridConfig()} | {f"{b}bit": GridConfig(kind="minmax", bits=b) for b in (2, 3, 4, 8)}


def _not_in_header(default=None):
    """A field that does not change the compressed output, so a resumed run may change it."""
    return dataclasses.field(default=default, metadata={"header": False})


@dataclasses.dataclass(frozen=True)
class CompressionOptions:
    """Everything the main job needs; defaults compress the bundled model.

    The manifest header records every field (resolved: the tokenizer's file
    name, the GPTQ memory actually used) except those marked ``header: False``,
    so a resumed run can never mix settings, a new field included.

    Attributes:
      checkpoint: T5X checkpoint directory or URL (None: the bundled model).
      config: model config name, or a JSON file of ``SwitchConfig`` fields for a
        custom model (None: inferred from the checkpoint's shapes).
      tokenizer: SentencePiece model (None: the bundled model's).
      calibration: "bundled", "c4:<dir or glob>", or "text:<glob>".
      num_samples: calibration samples; inputs_length: their encoder length.
      grid: "ternary", "2bit", "3bit", "4bit" or "8bit"; method: "gptq" or "rtn".
      group_size: experts per vmapped GPTQ call; dictionary: "static" or "adaptive".
      output_dir: where the compressed checkpoint goes (None: runs/compressed/<config>).
      premask: positions kept out of the Hessians: "encoder" (encoder
        sentinels), "encoder_decoder" (also decoder positions that predict a
        sentinel: QMoE's mask) or "none" (docs/calibration.md).
      gptq_memory_mb: memory one vmapped GPTQ call may use for its Hessians,
        weights and working copies (None: a quarter of the accelerator's memory,
        or 256 MiB on CPU).
      eval_examples: validation examples on which the original and the
        compressed model are scored at the end (None: 256 for the bundled
        model, 0 = off otherwise).
      eval_data: where they come from: "bundled" (the bundled corpus's held-out
        plays) or "c4:<dir or glob>" (None: follows ``calibration``).
    """

    checkpoint: str | None = _not_in_header()
    config: str | None = _not_in_header()
    tokenizer: str | None = None
    calibration: str = "bundled"
    num_samples: int = 1024
    inputs_length: int = bundled.INPUTS_LENGTH
    grid: str = "ternary"
    method: str = "gptq"
    group_size: int = 16
    dictionary: str = "static"
    batch_size: int = 32
    true_sequential: bool = False
    act_order: bool = False
    damping: float = 0.1
    premask: str = "encoder"
    seed: int = 1
    output_dir: str | None = _not_in_header()
    gptq_memory_mb: int | None = None
    eval_examples: int | None = _not_in_header()
    eval_data: str | None = _not_in_header()

    def __post_init__(self):
        if self.grid not in GRIDS:
            raise ValueError(f"unknown grid {self.grid!r}; choose one of {', '.join(GRIDS)}")
        if self.num_samples < 1:
            raise ValueError(f"num_samples must be at least 1, got {self.num_samples}")
        if not (self.calibration == "bundled" or self.calibration.startswith(("c4:", "text:"))):
            raise ValueError(f"calibration must be 'bundled', 'c4:<dir>' or 'text:<glob>', got {self.calibration!r}")
        if self.gptq_memory_mb is not None and self.gptq_memory_mb < 1:
            raise ValueError(f"gptq_memory_mb must be at least 1 (MiB), got {self.gptq_memory_mb}")
        if self.eval_examples is not None and self.eval_examples < 0:
            raise ValueError(f"eval_examples must be 0 (off) or more, got {self.eval_examples}")
        if self.evaluation_examples() and self.evaluation_data() is None:
            raise ValueError("--eval_examples needs validation text: pass --eval_data bundled or --eval_data c4:<dir>")
        # The sub-configs validate their own fields (damping, group size, premask, ...), here, before any work.
        self.span_corruption()
        self.calibration_config(self.gptq_memory_mb or 1)
        check_premask(self.premask)

    def span_corruption(self) -> SpanCorruptionConfig:
        packing = "document" if self.calibration.startswith("c4:") else "concat"
        return SpanCorruptionConfig(inputs_length=self.inputs_length, packing=packing, seed=self.seed)

    def calibration_config(self, gptq_memory_mb: int) -> CalibrationConfig:
        return CalibrationConfig(
            experts=ExpertCompressionConfig(grid=GRIDS[self.grid], method=self.method, group_size=self.group_size,
                                            gptq=GPTQConfig(act_order=self.act_order, damping=self.damping),
                                            true_sequential=self.true_sequential, gptq_memory=gptq_memory_mb << 20),
            dictionary=self.dictionary, batch_size=self.batch_size,
        )

    def evaluation_examples(self) -> int:
        if self.eval_examples is not None:
            return self.eval_examples
        return BUNDLED_EVAL_EXAMPLES if self.checkpoint is None else 0

    def evaluation_data(self) -> str | None:
        if self.eval_data is not None:
            return self.eval_data
        return self.calibration if self.calibration == "bundled" or self.calibration.startswith("c4:") else None

    def header_settings(self, **resolved) -> dict:
        """The recorded fields, with ``resolved`` values replacing the given ones."""
        return {field.name: resolved.get(field.name, getattr(self, field.name))
                for field in dataclasses.fields(self) if field.metadata.get("header", True)}


def resolve_config(spec: str) -> SwitchConfig:
    """A registered config by name, or one read from a JSON file of ``SwitchConfig`` fields."""
    if spec.endswith(".json"):
        if not os.path.isfile(spec):
            raise FileNotFoundError(f"config file {spec!r} does not exist")
        with open(spec) as f:
            fields = json.load(f)
        try:
            return SwitchConfig(**fields)
        except TypeError as error:
            raise ValueError(f"{spec} is not a SwitchConfig: {error}") from None
    return get_config(spec)


def default_gptq_memory_mb() -> int:
    stats = jax.devices()[0].memory_stats() or {}
    limit = stats.get("bytes_limit")
    return int(limit // 4 >> 20) if limit else 256


def _documents(spec: str):
    if spec == "bundled":
        return corpus.documents("train")
    kind, _, location = spec.partition(":")
    if kind == "c4":
        return c4_documents(location, split="train")
    paths = sorted(glob.glob(location))
    if not paths:
        raise FileNotFoundError(f"no text files match {location!r}")
    return text_file_documents(paths)


def _parameter_counts(checkpoint: T5XCheckpoint) -> tuple[int, int]:
    spec = checkpoint.spec()
    total = sum(int(np.prod(info.shape)) for info in spec.values())
    experts = sum(int(np.prod(info.shape)) for info in spec.values() if info.is_expert_stack)
    return total, experts


def compress_checkpoint(options: CompressionOptions, log: Callable[[str], None] = print,
                        progress: bool = True, config: SwitchConfig | None = None) -> dict:
    """Compresses (or resumes compressing) a checkpoint; returns the report (also written to disk).

    ``config`` overrides ``options.config`` with a config object (e.g. one not in the registry).
    """
    started = time.perf_counter()
    path = options.checkpoint or bundled.checkpoint_path()
    checkpoint = open_t5x_checkpoint(path)
    if config is None:
        config = resolve_config(options.config) if options.config else infer_config(checkpoint)
    checkpoint.check_shapes(path_shapes(param_shapes(config)), config_name=config.name)
    output_dir = options.output_dir or os.path.join("runs", "compressed", config.name)
    tokenizer = Tokenizer(options.tokenizer or bundled.tokenizer_path())
    log(f"model {config.name} from {path}; {jax.device_count()} device(s); output {output_dir}")

    data_started = time.perf_counter()
    data = calibration_data(_documents(options.calibration), tokenizer, options.span_corruption(),
                            options.num_samples, spread=options.calibration == "bundled", premask=options.premask)
    log(f"{data.num_samples} calibration samples, {int((data.encoder_input_tokens > 0).sum())} encoder and "
        f"{int((data.decoder_target_tokens > 0).sum())} decoder tokens")
    data_seconds = time.perf_counter() - data_started

    gptq_memory_mb = options.gptq_memory_mb or default_gptq_memory_mb()
    header = {
        "model": dataclasses.asdict(config),
        "source": path,
        "grid": dataclasses.asdict(GRIDS[options.grid]),
        "settings": options.header_settings(tokenizer=os.path.basename(tokenizer.model_path),
                                            gptq_memory_mb=gptq_memory_mb),
    }
    writer = CompressedCheckpointWriter(output_dir, header)
    if writer.finished_layers():
        log(f"resuming: {len(writer.finished_layers())} layer(s) already finished")
    result = CalibrationPass(config, checkpoint, data, options.calibration_config(gptq_memory_mb), writer,
                             log=log, progress=progress).run()
    total, experts = _parameter_counts(checkpoint)
    seconds = {"data": data_seconds} | result["seconds"]
    report = build_report(writer.manifest, total, experts, seconds)
    writer.finalize({"moe": report["moe"], "model": report["model"]})
    if options.evaluation_examples():
        evaluation_started = time.perf_counter()
        report["evaluation"] = _evaluate(options, path, config, tokenizer, output_dir, progress)
        report["seconds"]["evaluation"] = time.perf_counter() - evaluation_started
    report["seconds"]["total"] = time.perf_counter() - started
    write_report(report, output_dir)
    log(summary_table(report))
    log(next_steps(report, output_dir))
    return report


def _evaluate(options: CompressionOptions, path: str, config: SwitchConfig, tokenizer: Tokenizer,
              output_dir: str, progress: bool) -> dict:
    """Validation loss of the original and the compressed model (dequantized experts) on the same examples,
    as ``python -m qmoe_jax.evaluate`` computes it."""
    validation = validation_set(options.evaluation_data(), tokenizer, options.evaluation_examples(),
                                options.inputs_length)
    params = {"original": load_t5x_params(path, config), "compressed": load_compressed_model(output_dir).params}
    losses = mean_cross_entropies(SwitchTransformer(config), params, validation.examples, options.batch_size,
                                  validation.encoder_length, validation.decoder_length, progress=progress)
    return {"data": validation.source, "examples": len(validation.examples), "original_loss": losses["original"],
            "compressed_loss": losses["compressed"]}


def next_steps(report: dict, output_dir: str) -> str:
    """What the user got, and the commands that use it."""
    lines = []
    evaluation = report.get("evaluation")
    if evaluation:
        increase = evaluation["compressed_loss"] - evaluation["original_loss"]
        lines.append(f"validation loss (nats/token, {evaluation['examples']} held-out examples of "
                     f"{evaluation['data']}): original {evaluation['original_loss']:.4f}, "
                     f"compressed {evaluation['compressed_loss']:.4f} ({increase:+.4f})")
    lines += ["compressed checkpoint: " + output_dir,
              "use it:",
              f"  python -m qmoe_jax.evaluate --checkpoint {output_dir}"]
    return "\n".join(lines)
