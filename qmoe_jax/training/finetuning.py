"""Fine-tuning a compressed (or T5X) Switch model: options, the jitted step, the loop, resume and
save_finetuned.

Lingo: the *trainable* tree goes to the optimizer (float32 master copies); the *frozen*
tree holds everything else, the ``CompressedExperts`` stacks (integer codes,
run on the fused kernels, gradients flowing to their inputs through
``ops``' custom VJP) included. One optimizer step averages the gradients of
``accumulate`` micro-batches of ``batch_size`` examples. loss = token
cross-entropy + the model's ``aux_loss_factor`` · load balancing +
``router_z_loss_factor`` · router z-loss (``training/pretrain.py``). Schedule: linear
warm-up to ``learning_rate``, cosine decay to ``final_learning_rate_fraction``
of it; AdamW (b1 0.9, b2 0.98) or Adafactor (``--optimizer``) after clipping the
global gradient norm (``training/optimizer.py``: optax's math and state, one fused
update per parameter).
Data-parallel: micro-batches are split over all devices along the batch, the
compressed experts sharded over them as in expert-parallel inference. With
several processes (docs/multihost.md) the devices are every process's: each
process builds the same batches and feeds its devices' slice; the lead alone
logs and writes the manifest, metrics and model; all take part in each Orbax
checkpoint.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
import resource
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec
from tqdm import tqdm

from qmoe_jax.checkpoints import open_t5x_checkpoint
from qmoe_jax.checkpoints.fingerprint import source_fingerprint
from qmoe_jax.checkpoints.format_v1 import MANIFEST
from qmoe_jax.checkpoints.strict_json import nonfinite_paths
from qmoe_jax.codec import CompressedExperts
from qmoe_jax.data import Tokenizer, bundled
from qmoe_jax.distributed import exchange, runtime
from qmoe_jax.distributed.claimed_dir import claimed
from qmoe_jax.inference.evaluation import padded_batches
from qmoe_jax.inference.loading import is_compressed_checkpoint, open_model
from qmoe_jax.models.configs import resolve_config
from qmoe_jax.models.lora import LORA, init_adapter
from qmoe_jax.training import save_finetuned
from qmoe_jax.training.metrics import plot_metrics
from qmoe_jax.training.optimizer import ClippedAdafactor, ClippedAdamW, Optimizer
from qmoe_jax.training.run_directory import FINETUNE_OUTPUT, MODEL, RunDirectory
from qmoe_jax.training.steps import evaluate, make_eval_step, make_train_step
from qmoe_jax.training.tasks import Task, load_task
from qmoe_jax.training.trainable import (
    EXPERT_KERNEL,
    flatten,
    merge,
    select_trainable,
    split,
    unflatten,
)

ACTIVATIONS = ("float32", "bfloat16")
OPTIMIZERS = ("adamw", "adafactor")


def _not_in_settings(default=None):
    """An option that does not change the fine-tuned parameters, so a resumed run may change it."""
    return dataclasses.field(default=default, metadata={"settings": False})


@dataclasses.dataclass(frozen=True)
class FinetuneOptions:
    """Everything a fine-tuning run needs; the run manifest records every field not marked
    otherwise.

    Attributes:
      checkpoint: a compressed directory or a T5X checkpoint (None: the bundled T5X model).
      config: model config name, or JSON file of ``SwitchConfig`` fields, of a T5X checkpoint (None:
        inferred).
      task: see ``training.tasks``.
      experts: a compressed source's frozen experts: "compressed" (fused kernels) or "dense"
        (dequantized to float32: the uncompressed control of the cost benchmark).
      output_dir: the run directory (``training.run_directory``).
      trainable: regular expressions selecting trainable parameter paths (None: attention, layer
        norms, routers, embeddings, relative position biases and dense MLPs); expert adapters always
        train.
      expert_lora_rank: r of the expert LoRA adapters (0: none; compressed checkpoints only).
      steps, batch_size, accumulate: optimizer steps; examples per micro-batch; micro-batches per
        step.
      warmup_steps: of the learning-rate schedule (None: a tenth of ``steps``).
      dropout_rate: None keeps the model config's.
      activations: "float32" or "bfloat16" (parameters and optimizer state stay float32).
      optimizer: "adamw" (two moments the parameters' size) or "adafactor" (T5X's fine-tuning
        optimizer: factored second moments, no first moment, steps relative to each array's RMS;
        its state is a small fraction of the parameters'); both after ``clip_norm``.
      eval_examples: held-out examples scored every ``eval_every`` steps.
    """

    checkpoint: str | None = None
    config: str | None = None
    task: str = "name_the_work"
    output_dir: str = _not_in_settings("runs/finetune")
    tokenizer: str | None = None
    experts: str = "compressed"
    trainable: tuple[str, ...] | None = None
    expert_lora_rank: int = 0
    steps: int = 300
    batch_size: int = 16
    accumulate: int = 1
    learning_rate: float = 1e-3
    warmup_steps: int | None = None
    final_learning_rate_fraction: float = 0.1
    weight_decay: float = 0.01
    clip_norm: float = 1.0
    dropout_rate: float | None = None
    activations: str = "float32"
    optimizer: str = "adamw"
    inputs_length: int = bundled.INPUTS_LENGTH
    eval_examples: int = 256
    seed: int = 0
    eval_every: int = _not_in_settings(100)
    checkpoint_every: int = _not_in_settings(100)

    def __post_init__(self):
        for name in (
            "steps",
            "batch_size",
            "accumulate",
            "eval_examples",
            "eval_every",
            "checkpoint_every",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name} must be at least 1, got {getattr(self, name)}")
        if self.expert_lora_rank < 0:
            raise ValueError(
                f"--expert_lora_rank must be 0 (off) or positive, got {self.expert_lora_rank}"
            )
        if self.experts not in ("compressed", "dense"):
            raise ValueError(f"--experts must be compressed or dense, got {self.experts!r}")
        if self.activations not in ACTIVATIONS:
            raise ValueError(
                f"--activations must be one of {', '.join(ACTIVATIONS)}, got {self.activations!r}"
            )
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(
                f"--optimizer must be one of {', '.join(OPTIMIZERS)}, got {self.optimizer!r}"
            )
        if self.dropout_rate is not None and not 0.0 <= self.dropout_rate < 1.0:
            raise ValueError(f"--dropout_rate must be in [0, 1), got {self.dropout_rate}")
        if self.warmup_steps is not None and not 0 <= self.warmup_steps <= self.steps:
            raise ValueError(
                f"--warmup_steps must be between 0 and --steps ({self.steps}), got "
                f"{self.warmup_steps}"
            )
        for name in ("learning_rate", "final_learning_rate_fraction", "weight_decay", "clip_norm"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"--{name} must be a finite number, got {getattr(self, name)}")
        if self.learning_rate <= 0 or self.clip_norm <= 0:
            raise ValueError("--learning_rate and --clip_norm must be positive")

    @property
    def warmup(self) -> int:
        return self.steps // 10 if self.warmup_steps is None else self.warmup_steps

    def settings(self) -> dict:
        return {
            field.name: getattr(self, field.name)
            for field in dataclasses.fields(self)
            if field.metadata.get("settings", True)
        }


def learning_rate_schedule(options: FinetuneOptions) -> optax.Schedule:
    return optax.warmup_cosine_decay_schedule(
        0.0,
        options.learning_rate,
        options.warmup,
        options.steps,
        options.learning_rate * options.final_learning_rate_fraction,
    )


def make_optimizer(options: FinetuneOptions) -> Optimizer:
    schedule = learning_rate_schedule(options)
    if options.optimizer == "adafactor":
        return ClippedAdafactor(
            schedule, clip_norm=options.clip_norm, weight_decay=options.weight_decay
        )
    return ClippedAdamW(
        schedule, clip_norm=options.clip_norm, weight_decay=options.weight_decay, b1=0.9, b2=0.98
    )


def add_expert_adapters(params: dict, rank: int, rng: jax.Array) -> dict:
    """``params`` with a fresh adapter (``models/lora.py``) beside every compressed expert
    kernel."""
    flat = flatten(params)
    stacks = {path: leaf for path, leaf in flat.items() if isinstance(leaf, CompressedExperts)}
    if not stacks:
        raise ValueError(
            "--expert_lora_rank needs compressed experts on the fused kernels: pass a directory "
            "written by `python -m qmoe_jax.compress`, with --experts compressed"
        )
    for index, (path, stack) in enumerate(sorted(stacks.items())):
        expert, _, kernel = path.rpartition("/")
        adapter = init_adapter(
            jax.random.fold_in(rng, index), stack.num_experts, stack.rows, stack.cols, rank
        )
        for name, value in adapter.items():
            flat[f"{expert}/{LORA}/{kernel}/{name}"] = value
    return unflatten(flat)


def _source_record(path: str) -> dict:
    if is_compressed_checkpoint(path):
        with open(os.path.join(path, MANIFEST), "rb") as f:
            return {"kind": "compressed", "manifest_sha256": hashlib.sha256(f.read()).hexdigest()}
    return {"kind": "t5x", "fingerprint": source_fingerprint(open_t5x_checkpoint(path))}


def _on_host(params: dict) -> dict:
    """``params`` as NumPy arrays in every process, for the lead to write: arrays sharded over
    several processes' devices are gathered (collective). The compressed expert stacks stay as they
    are: the written model copies them from the source."""
    if runtime.process_count() == 1:
        return params
    return jax.tree.map(
        lambda leaf: leaf if isinstance(leaf, CompressedExperts) else exchange.host_array(leaf),
        params,
        is_leaf=lambda leaf: isinstance(leaf, CompressedExperts),
    )


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def finetune(
    options: FinetuneOptions, log: Callable[[str], None] = print, progress: bool = True
) -> dict:
    """Fine-tunes (or resumes fine-tuning) and writes the model; returns the run's summary (in
    every process of a multi-process run; only the lead logs)."""
    log = runtime.lead_only(log)
    progress = progress and runtime.is_lead()
    path = options.checkpoint or bundled.checkpoint_path()
    devices = jax.device_count()
    if options.batch_size % devices:
        raise ValueError(
            f"--batch_size {options.batch_size} must be divisible by the {devices} devices"
        )
    compressed = is_compressed_checkpoint(path)

    def load():  # in every process
        tokenizer = Tokenizer(options.tokenizer or bundled.tokenizer_path())
        task = load_task(options.task, tokenizer, options.inputs_length, options.eval_examples)
        opened = open_model(
            path,
            resolve_config(options.config) if options.config else None,
            options.experts if compressed else None,
            dtype=jnp.float32,
        )
        return tokenizer, task, opened

    tokenizer, task, opened = exchange.checked(load)
    if tokenizer.vocab_size > opened.config.vocab_size:
        raise ValueError(
            f"the tokenizer {tokenizer.model_path} has {tokenizer.vocab_size} ids but the model "
            "only "
            f"{opened.config.vocab_size}; pass the model's own tokenizer with --tokenizer"
        )
    config = dataclasses.replace(
        opened.config,
        dtype=options.activations,
        **({} if options.dropout_rate is None else {"dropout_rate": options.dropout_rate}),
    )
    module = opened.module.clone(config=config)
    params = opened.params
    if options.expert_lora_rank:
        params = add_expert_adapters(
            params, options.expert_lora_rank, jax.random.PRNGKey(options.seed + 1)
        )
    trainable_paths = select_trainable(params, options.trainable)
    if compressed and any(EXPERT_KERNEL.search(p) for p in trainable_paths):
        raise ValueError(
            "the expert kernels of a compressed checkpoint stay frozen (its output keeps their "
            "codes); "
            "train them through --expert_lora_rank, or leave them out of --trainable"
        )
    trainable, frozen = split(params, trainable_paths)
    del params
    # the loaded tree is now the two parts; keep no second reference to its arrays
    opened.params = None

    mesh = opened.mesh or jax.sharding.Mesh(np.asarray(jax.devices()), ("expert",))
    replicated = NamedSharding(mesh, PartitionSpec())
    by_batch = NamedSharding(mesh, PartitionSpec(None, "expert"))
    if (
        opened.mesh is None
    ):  # else the loader placed them: expert stacks sharded, the rest replicated
        frozen = jax.device_put(frozen, replicated)
    trainable = jax.device_put(trainable, replicated)
    optimizer = make_optimizer(options)
    # Every leaf on the mesh, the step count too (else a scalar on one device): Orbax restores
    # each leaf where it was, and the train step takes no mix of one device and the mesh.
    opt_state = jax.jit(optimizer.init, out_shardings=replicated)(trainable)
    record = {"settings": options.settings(), "source": {"path": path, **_source_record(path)}}
    counted = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(trainable))
    log(
        f"{config.name} from {path} ({opened.kind}, {opened.experts} experts); task {task.name}: "
        f"{len(task.chunks or task.examples)} training {'chunks' if task.chunks else 'examples'}, "
        f"{len(task.validation)} validation examples; {len(trainable_paths)} trainable arrays "
        f"({counted:,} parameters); {devices} device(s)"
    )

    with claimed(options.output_dir, FINETUNE_OUTPUT) as directory:
        run = RunDirectory(directory, record)
        try:
            if run.complete:
                log(
                    f"{directory} is already complete: its model is "
                    f"{run.path(run.manifest['model'])}"
                )
                return run.manifest["summary"]
            start = run.latest_step() or 0
            if start:
                abstract = jax.tree.map(
                    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                    {"trainable": trainable, "opt_state": opt_state},
                )
                restored = run.restore(start, abstract)
                trainable, opt_state = restored["trainable"], restored["opt_state"]
                log(f"resuming at step {start} of {options.steps}")
            records = run.metrics_records(start)
            summary = _train(
                options,
                module,
                task,
                run,
                trainable,
                opt_state,
                frozen,
                optimizer,
                start,
                records,
                lambda batch: jax.device_put(batch, by_batch),
                lambda batch: jax.device_put(batch, NamedSharding(mesh, PartitionSpec("expert"))),
                progress,
                log,
            )
            summary["trainable_parameters"] = counted
            params = _on_host(summary.pop("params"))
            summary["model"] = exchange.decided(
                lambda: _export(options, opened.kind, path, run, params, record["settings"])
            )
            run.finish(os.path.relpath(summary["model"], directory), summary)
        finally:
            run.close()
    log(f"fine-tuned model: {summary['model']}")
    return summary


def _require_finite_metrics(record: dict, run: RunDirectory) -> None:
    """Raises ``ValueError`` when a metric of ``record`` is NaN or infinite: the run stops there,
    before the record or a checkpoint of its parameters is written."""
    bad = [key for key, value in record.items() if nonfinite_paths(value)]
    if bad:
        kept = run.latest_step()
        raise ValueError(
            f"at step {record['step']} the {', '.join(bad)} is {record[bad[0]]}: the training "
            "diverged (or the model's parameters hold NaN or infinite values), so the run stops "
            f"without recording it{f' (its checkpoint of step {kept} stays)' if kept else ''}; "
            "re-run into a new --output_dir with a lower --learning_rate or --clip_norm"
        )


def _train(
    options: FinetuneOptions,
    module,
    task: Task,
    run: RunDirectory,
    trainable,
    opt_state,
    frozen,
    optimizer,
    start: int,
    records: list[dict],
    placed_steps: Callable,
    placed: Callable,
    progress: bool,
    log: Callable[[str], None],
) -> dict:
    train_step = make_train_step(module, optimizer, options.accumulate)
    eval_step = make_eval_step(module)
    schedule = learning_rate_schedule(options)
    eval_batches = padded_batches(
        task.validation, options.batch_size, task.encoder_length, task.decoder_length
    )
    batches = task.batches(options.batch_size, options.seed, start * options.accumulate)
    rng = jax.random.PRNGKey(options.seed)

    def scored(step: int, running: dict, seconds: float) -> None:
        record = {
            "step": step,
            **{k: v / max(running.get("steps", 1), 1) for k, v in running.items() if k != "steps"},
            "learning_rate": float(schedule(step)),
            "seconds": round(seconds, 3),
        }
        record.update(
            evaluate(module, eval_step, trainable, frozen, eval_batches, task.generative, placed)
        )
        _require_finite_metrics(record, run)
        run.append_metrics(record)
        records.append(record)
        if runtime.is_lead():
            plot_metrics(
                records,
                run.path("metrics.png"),
                f"{options.task}: {options.checkpoint or 'bundled model'}",
            )
        log(
            " ".join(
                f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in record.items()
            )
        )

    if start == 0 and not records:
        scored(0, {}, 0.0)
    running: dict[str, float] = {}
    step_seconds = []
    bar = tqdm(
        total=options.steps, initial=start, desc="fine-tune", unit="step", disable=not progress
    )
    for step in range(start, options.steps):
        micro = [next(batches) for _ in range(options.accumulate)]
        stacked = {key: np.stack([m[key] for m in micro]) for key in micro[0]}
        started = time.perf_counter()
        trainable, opt_state, metrics = train_step(
            trainable, opt_state, frozen, placed_steps(stacked), jax.random.fold_in(rng, step)
        )
        metrics = {k: float(v) for k, v in metrics.items()}
        _require_finite_metrics({"step": step + 1, **metrics}, run)
        step_seconds.append(time.perf_counter() - started)
        for key, value in metrics.items():
            running[key] = running.get(key, 0.0) + value
        running["steps"] = running.get("steps", 0) + 1
        bar.update(1)
        bar.set_postfix(loss=f"{metrics['train_loss']:.3f}")
        done = step + 1
        if done % options.eval_every == 0 or done == options.steps:
            scored(done, running, sum(step_seconds))
            running = {}
        if done % options.checkpoint_every == 0 or done == options.steps:
            run.save(done, {"trainable": trainable, "opt_state": opt_state})
    bar.close()
    final = dict(records[-1]) if records else {}
    timed = step_seconds[1:] or step_seconds  # the first step compiles
    return {
        "final": final,
        "steps": options.steps,
        "params": merge(trainable, frozen),
        "step_seconds": float(np.median(timed)) if timed else None,
        "peak_rss_mib": round(_peak_rss_mib(), 1),
    }


def _export(
    options: FinetuneOptions,
    kind: str,
    source: str,
    run: RunDirectory,
    params: dict,
    settings: dict,
) -> str:
    target = run.path(MODEL)
    if kind == "compressed":
        save_finetuned.write_compressed(source, target, params, settings, options.expert_lora_rank)
        return target
    return save_finetuned.write_t5x(target, params, options.steps)
