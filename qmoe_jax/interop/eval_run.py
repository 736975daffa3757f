"""One evaluation run in T5X's output layout: a checkpoint, a task or mixture, a model config.

Writes, as ``t5x.eval`` with seqio's ``JSONLogger`` does (docs/gin.md):

- ``<output_dir>/config.gin``: the operative gin config (given by the caller);
- ``<output_dir>/inference_eval/<task>-metrics.jsonl``: one JSON line appended
  per run, ``{"step": <checkpoint step>, <metric>: <value>, ...}``;
- ``<output_dir>/inference_eval/<task>-<step:06d>.jsonl``: one line per
  example, ``{"input": {...features...}, "target": ..., "score": ...}`` plus
  ``"output"`` and ``"prediction"`` for predicted tasks.

The directory follows the output rules of ``checkpoints/output_dir.py``: a
``manifest.json`` marks it as a qmoe_jax evaluation directory, and a lock keeps
a second run out while one writes.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import time

import numpy as np

from qmoe_jax.checkpoints import ShapeMismatchError, strict_json
from qmoe_jax.checkpoints.format_v1 import CompressedCheckpoint
from qmoe_jax.checkpoints.output_dir import MANIFEST, OutputKind
from qmoe_jax.data import Tokenizer, bundled
from qmoe_jax.distributed import exchange, runtime
from qmoe_jax.distributed.claimed_dir import claimed
from qmoe_jax.inference.generation import generate_tokens
from qmoe_jax.inference.loading import OpenedModel, is_compressed_checkpoint, open_model
from qmoe_jax.inference.scoring import score_examples
from qmoe_jax.inference.strategies import DecodingConfig
from qmoe_jax.interop.eval_tasks import (
    Mixture,
    Seq2SeqTask,
    Task,
    TaskData,
    as_list,
    load_task,
    resolve,
)
from qmoe_jax.interop.steps import checkpoint_step
from qmoe_jax.interop.t5x_layout import has_sidecar, read_layout
from qmoe_jax.models import SwitchConfig

EVAL_OUTPUT = OutputKind("qmoe_jax.evaluation", "a qmoe_jax evaluation output directory")
INFERENCE_DIR = "inference_eval"
EXPERTS = ("compressed", "dense")
# The fields that fix parameter shapes and the computation's structure; the checkpoint decides them.
SHAPE_FIELDS = {
    "vocab_size": "NUM_EMBEDDINGS",
    "d_model": "EMBED_DIM",
    "num_heads": "NUM_HEADS",
    "d_kv": "HEAD_DIM",
    "d_ff": "MLP_DIM",
    "num_encoder_layers": "NUM_ENCODER_LAYERS",
    "num_decoder_layers": "NUM_DECODER_LAYERS",
    "num_experts": "NUM_EXPERTS",
    "num_encoder_sparse_layers": "NUM_ENCODER_SPARSE_LAYERS",
    "num_decoder_sparse_layers": "NUM_DECODER_SPARSE_LAYERS",
    "mlp_activations": "SwitchConfig.mlp_activations",
    "logits_dense": "SwitchConfig.logits_dense",
}


class ModelConfigMismatch(ValueError):
    """The model gin's shapes disagree with the checkpoint's."""


@dataclasses.dataclass(frozen=True)
class EvalSettings:
    """The run macros of ``configs/runs/eval.gin``.

    Attributes:
      checkpoint_path: a compressed directory or a T5X ``checkpoint_<step>`` (CHECKPOINT_PATH).
      output_dir: EVAL_OUTPUT_DIR.
      mixture_or_task_name: MIXTURE_OR_TASK_NAME.
      task_feature_lengths: TASK_FEATURE_LENGTHS, ``{"inputs": n, "targets": m}`` or None.
      batch_size: BATCH_SIZE, examples per scoring and decoding batch.
      experts: EXPERTS, "compressed" (fused kernels) or "dense" (dequantized).
      tokenizer: TOKENIZER, a SentencePiece model (None: the bundled model's).
      expert_parallel: as ``open_model``.
    """

    checkpoint_path: str
    output_dir: str
    mixture_or_task_name: str
    task_feature_lengths: dict | None = None
    batch_size: int = 32
    experts: str = "compressed"
    tokenizer: str | None = None
    expert_parallel: str = "auto"

    def __post_init__(self):
        if self.experts not in EXPERTS:
            raise ValueError(f"EXPERTS must be 'compressed' or 'dense', got {self.experts!r}")
        if not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise ValueError(f"BATCH_SIZE must be a positive integer, got {self.batch_size!r}")
        for name, value in (
            ("CHECKPOINT_PATH", self.checkpoint_path),
            ("EVAL_OUTPUT_DIR", self.output_dir),
            ("MIXTURE_OR_TASK_NAME", self.mixture_or_task_name),
        ):
            if not isinstance(value, str) or not value:
                raise ValueError(
                    f"{name} must be a non-empty string (quote it: --gin.{name}=\"'...'\"), "
                    f"got {value!r}"
                )


def check_model_config(
    model: SwitchConfig, found: SwitchConfig, checkpoint: str, model_files: list[str]
) -> None:
    """Raises ``ModelConfigMismatch`` naming each shape field where the gin model and the checkpoint
    differ."""
    differ = [
        f"{macro} ({field}) is {getattr(model, field)!r} in the gin config but "
        f"{getattr(found, field)!r} in "
        "the checkpoint"
        for field, macro in SHAPE_FIELDS.items()
        if getattr(model, field) != getattr(found, field)
    ]
    if differ:
        raise ModelConfigMismatch(
            f"the model gin ({', '.join(model_files) or 'the bindings'}) disagrees with "
            f"{checkpoint}: "
            f"{'; '.join(differ)}; use the model gin of that checkpoint "
            f"(models/{found.name.replace('-', '_')}.gin "
            "for the named configs)"
        )


def open_evaluated_model(
    settings: EvalSettings, model: SwitchConfig | None, model_files: list[str]
) -> OpenedModel:
    """Opens the checkpoint with the gin model config's run-time settings (capacity, group size,
    dtype), after checking that its shapes are the checkpoint's."""
    path = settings.checkpoint_path
    dtype = model.dtype if model is not None else "float32"
    # A T5X checkpoint that t5x.train wrote of a compressed model opens as a compressed one.
    t5x_compressed = has_sidecar(path)
    if is_compressed_checkpoint(path) or t5x_compressed:
        if model is not None:
            stored = (
                read_layout(path).model
                if t5x_compressed
                else CompressedCheckpoint(path).header["model"]
            )
            check_model_config(model, SwitchConfig.from_dict(stored), path, model_files)
        opened = open_model(
            path, experts=settings.experts, dtype=dtype, expert_parallel=settings.expert_parallel
        )
        if model is not None:
            keep = {
                field: getattr(opened.config, field)
                for field in ("name", "checkpoint_path", "checkpoint_step")
            }
            config = dataclasses.replace(model, **keep)
            opened = dataclasses.replace(
                opened, config=config, module=opened.module.clone(config=config)
            )
        return opened
    if settings.experts != "dense":
        raise ValueError(
            f"{path} is a T5X checkpoint, whose experts are dense; set --gin.EXPERTS=\"'dense'\" "
            "(EXPERTS='compressed' needs a directory written by python -m qmoe_jax.compress)"
        )
    try:
        return open_model(path, model, experts="dense", dtype=dtype)
    except ShapeMismatchError as error:
        if model is None:
            raise
        lines = "; ".join(line.strip() for line in str(error).splitlines() if line.strip())
        raise ModelConfigMismatch(
            f"the model gin ({', '.join(model_files) or 'the bindings'}) disagrees with "
            f"{path}: {lines}"
        ) from None


def _write_atomic(path: str, text: str) -> None:
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)


def _start_output(output_dir: str, config_text: str) -> None:
    """The output directory's manifest (once), the run's gin config and the inference folder."""
    manifest = os.path.join(output_dir, MANIFEST)
    if not os.path.exists(manifest):
        _write_atomic(
            manifest,
            strict_json.dumps({"format": EVAL_OUTPUT.marker, "format_version": 1}) + "\n",
        )
    _write_atomic(os.path.join(output_dir, "config.gin"), config_text)
    os.makedirs(os.path.join(output_dir, INFERENCE_DIR), exist_ok=True)


def _write_task(base: str, task: str, step: int, records: list[dict], line: dict) -> None:
    """Task ``task``'s inference records at ``step`` and its metrics line (appended)."""
    _write_atomic(
        f"{base}-{step:06d}.jsonl",
        "".join(strict_json.dumps(r, what=f"an inference of {task}") + "\n" for r in records),
    )
    _append_line(f"{base}-metrics.jsonl", line)


def _append_line(path: str, record: dict) -> None:
    previous = ""
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            previous = f.read()
    _write_atomic(path, previous + strict_json.dumps(record, what=path) + "\n")


def _finite(value: float, what: str, checkpoint: str) -> float:
    if not math.isfinite(value):
        raise ValueError(
            f"the {what} of {checkpoint} is {value}: the model's parameters hold NaN or infinite "
            "values, or its activations overflow; check the checkpoint"
        )
    return value


def evaluate_task(
    opened: OpenedModel,
    tokenizer: Tokenizer,
    task: Task,
    data: TaskData,
    batch_size: int,
    checkpoint: str,
    progress: bool,
) -> tuple[dict, list[dict]]:
    """(metrics, per-example records) of one task."""
    scores = score_examples(
        opened.module,
        opened.params,
        data.examples,
        batch_size,
        data.encoder_length,
        data.decoder_length,
        progress=progress,
        desc=f"score {task.name}",
    )
    loss = _finite(scores.loss, f"loss on {task.name}", checkpoint)
    records = []
    for index, (inputs, targets) in enumerate(data.examples):
        if data.texts is None:
            features = {"inputs": as_list(inputs), "targets": as_list(targets)}
            target = tokenizer.decode(targets)
        else:
            text = data.texts[index]
            features = {
                "inputs_pretokenized": text.inputs,
                "inputs": as_list(inputs),
                "targets_pretokenized": text.targets,
                "targets": as_list(targets),
            }
            target = text.targets
        records.append(
            {"input": features, "target": target, "score": float(scores.log_likelihoods[index])}
        )
    metrics = {
        "loss": round(loss, 6),
        "examples": len(data.examples),
        "target_tokens": int(scores.target_tokens.sum()),
    }
    if isinstance(task, Seq2SeqTask):
        metrics["mean_log_likelihood"] = round(float(np.mean(scores.log_likelihoods)), 6)
    if isinstance(task, Seq2SeqTask) and task.predict:
        encoder = np.zeros((len(data.examples), data.encoder_length), np.int32)
        for row, (inputs, _) in enumerate(data.examples):
            encoder[row, : inputs.size] = inputs
        config = DecodingConfig(method="greedy", max_decode_length=data.decoder_length)
        decoded = generate_tokens(
            opened.module, opened.params, encoder, config, batch_size, progress=progress
        )
        matches = 0
        for record, (ids, _) in zip(records, decoded):
            text = tokenizer.decode(ids)
            record["output"] = record["prediction"] = text
            matches += text == record["target"]
        metrics = {"exact_match": round(100.0 * matches / len(records), 4), **metrics}
    return metrics, records


def run_evaluation(
    settings: EvalSettings,
    definitions: list[Task | Mixture],
    model: SwitchConfig | None = None,
    config_text: str = "",
    model_files: list[str] = (),
    log=print,
    progress: bool = False,
) -> dict:
    """Evaluates ``settings.mixture_or_task_name`` and writes T5X's layout under
    ``settings.output_dir``.

    Returns ``{task name: metrics}`` (each as written to its metrics file, with ``step``). With
    several processes every process evaluates (the experts sharded over all their devices) and the
    lead alone logs and writes the output directory.
    """
    log = runtime.lead_only(log)
    progress = progress and runtime.is_lead()
    tasks = resolve(settings.mixture_or_task_name, definitions)
    tokenizer = Tokenizer(settings.tokenizer or bundled.tokenizer_path())
    step = checkpoint_step(settings.checkpoint_path)
    opened = open_evaluated_model(settings, model, list(model_files))
    if tokenizer.vocab_size > opened.config.vocab_size:
        raise ValueError(
            f"the tokenizer {tokenizer.model_path} has {tokenizer.vocab_size} ids but the model "
            f"{settings.checkpoint_path} embeds only {opened.config.vocab_size}; set TOKENIZER to "
            "the "
            "model's SentencePiece model"
        )
    data = {task.name: load_task(task, tokenizer, settings.task_feature_lengths) for task in tasks}
    results = {}
    with claimed(settings.output_dir, EVAL_OUTPUT) as output_dir:
        exchange.decided(lambda: _start_output(output_dir, config_text))
        for task in tasks:
            started = time.perf_counter()
            metrics, records = evaluate_task(
                opened,
                tokenizer,
                task,
                data[task.name],
                settings.batch_size,
                settings.checkpoint_path,
                progress,
            )
            base = os.path.join(output_dir, INFERENCE_DIR, task.name)
            line = {"step": step, **metrics}
            exchange.decided(functools.partial(_write_task, base, task.name, step, records, line))
            results[task.name] = line
            log(
                strict_json.dumps(
                    {
                        "task": task.name,
                        **line,
                        "experts": opened.experts,
                        "seconds": round(time.perf_counter() - started, 2),
                    }
                )
            )
    return results
