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
from qmoe_jax.checkpoints import T5XCheckpoint, open_t5x_checkpoint
from qmoe_jax.checkpoints.compressed import CompressedCheckpointWriter
from qmoe_jax.data import PREMASKS, SpanCorruptionConfig, Tokenizer, c4_documents, corpus, text_file_documents
from qmoe_jax.evaluate import expected_param_shapes
from qmoe_jax.models import SwitchConfig, config_names, get_config
from qmoe_jax.quant import GPTQConfig, GridConfig
from qmoe_jax.report import build_report, summary_table, write_report

GRIDS = {"ternary": GridConfig()} | {f"{b}bit": GridConfig(kind="minmax", bits=b) for b in (2, 3, 4, 8)}


@dataclasses.dataclass(frozen=True)
class CompressionOptions:
    """Everything the main job needs; defaults compress the bundled model.

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
        sentinel: QMoE's mask) or "none".
      gptq_memory_mb: memory one vmapped GPTQ call may use for its Hessians,
        weights and working copies (None: a quarter of the accelerator's memory,
        or 256 MiB on CPU).
    """

    checkpoint: str | None = None
    config: str | None = None
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
    output_dir: str | None = None
    gptq_memory_mb: int | None = None

    def __post_init__(self):
        if self.grid not in GRIDS:
            raise ValueError(f"unknown grid {self.grid!r}; choose one of {', '.join(GRIDS)}")
        if self.num_samples < 1:
            raise ValueError(f"num_samples must be at least 1, got {self.num_samples}")
        if not (self.calibration == "bundled" or self.calibration.startswith(("c4:", "text:"))):
            raise ValueError(f"calibration must be 'bundled', 'c4:<dir>' or 'text:<glob>', got {self.calibration!r}")
        if self.gptq_memory_mb is not None and self.gptq_memory_mb < 1:
            raise ValueError(f"gptq_memory_mb must be at least 1 (MiB), got {self.gptq_memory_mb}")
        if self.premask not in PREMASKS:
            raise ValueError(f"unknown premask {self.premask!r}; choose one of {', '.join(PREMASKS)}")
        if not self.damping > 0:
            raise ValueError(f"damping must be positive (a fraction of mean diag(H), e.g. 0.1), got {self.damping}")


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


def infer_config(checkpoint: T5XCheckpoint) -> SwitchConfig:
    """The one known config whose parameter shapes the checkpoint has."""
    found = {path: info.shape for path, info in checkpoint.spec().items()}
    matches = [name for name in config_names() if expected_param_shapes(get_config(name)) == found]
    if len(matches) != 1:
        raise ValueError(
            f"cannot infer the model config of {checkpoint.url}: {len(matches)} known configs match its shapes "
            f"({', '.join(matches) or 'none'}); pass --config (known: {', '.join(config_names())})"
        )
    return get_config(matches[0])


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
    checkpoint.check_shapes(expected_param_shapes(config), config_name=config.name)
    output_dir = options.output_dir or os.path.join("runs", "compressed", config.name)
    tokenizer = Tokenizer(options.tokenizer or bundled.tokenizer_path())
    log(f"model {config.name} from {path}; {jax.device_count()} device(s); output {output_dir}")

    data_started = time.perf_counter()
    packing = "document" if options.calibration.startswith("c4:") else "concat"
    data_config = SpanCorruptionConfig(inputs_length=options.inputs_length, packing=packing, seed=options.seed)
    data = calibration_data(_documents(options.calibration), tokenizer, data_config, options.num_samples,
                            spread=options.calibration == "bundled", premask=options.premask)
    log(f"{data.num_samples} calibration samples, {int((data.encoder_input_tokens > 0).sum())} encoder and "
        f"{int((data.decoder_target_tokens > 0).sum())} decoder tokens")
    data_seconds = time.perf_counter() - data_started

    grid = GRIDS[options.grid]
    gptq_memory_mb = options.gptq_memory_mb or default_gptq_memory_mb()
    settings = CalibrationConfig(
        experts=ExpertCompressionConfig(grid=grid, method=options.method, group_size=options.group_size,
                                        gptq=GPTQConfig(act_order=options.act_order, damping=options.damping),
                                        true_sequential=options.true_sequential,
                                        gptq_memory=gptq_memory_mb << 20),
        dictionary=options.dictionary, batch_size=options.batch_size,
    )
    header = {
        "model": dataclasses.asdict(config),
        "source": path,
        "settings": {
            "grid": dataclasses.asdict(grid), "method": options.method, "group_size": options.group_size,
            "dictionary": options.dictionary, "true_sequential": options.true_sequential,
            "act_order": options.act_order, "damping": options.damping, "premask": options.premask,
            "calibration": options.calibration,
            "num_samples": options.num_samples, "inputs_length": options.inputs_length,
            "batch_size": options.batch_size, "seed": options.seed, "gptq_memory_mb": gptq_memory_mb,
            "tokenizer": os.path.basename(tokenizer.model_path),
        },
    }
    writer = CompressedCheckpointWriter(output_dir, header)
    if writer.finished_layers():
        log(f"resuming: {len(writer.finished_layers())} layer(s) already finished")
    result = CalibrationPass(config, checkpoint, data, settings, writer, log=log, progress=progress).run()
    total, experts = _parameter_counts(checkpoint)
    seconds = {"data": data_seconds} | result["seconds"]
    seconds["total"] = time.perf_counter() - started
    report = build_report(writer.manifest, total, experts, seconds)
    writer.finalize({"moe": report["moe"], "model": report["model"]})
    write_report(report, output_dir)
    log(summary_table(report))
    return report
