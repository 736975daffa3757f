"""Gin mode of ``python -m qmoe_jax.evaluate``: the gin bindings of the run, the model and the
tasks.

This module is the only one that imports gin. It registers, under the gin
module ``qmoe_jax``:

- ``SwitchConfig`` (the model; ``configs/models/*.gin`` bind it through
  flaxformer's macro names),
- ``SpanCorruptionTask``, ``Seq2SeqTask``, ``Mixture`` (tasks by name),
- ``evaluate``, the run, whose parameters ``configs/runs/eval.gin`` binds to
  T5X's run macros (``CHECKPOINT_PATH``, ``EVAL_OUTPUT_DIR``,
  ``MIXTURE_OR_TASK_NAME``, ``TASK_FEATURE_LENGTHS``, ``BATCH_SIZE``) and ``EXPERTS``.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import gin

from qmoe_jax.cli import add_debug_flag
from qmoe_jax.distributed import runtime as distributed_runtime
from qmoe_jax.interop import eval_run
from qmoe_jax.interop.eval_tasks import Mixture, Seq2SeqTask, SpanCorruptionTask, UnknownTaskError
from qmoe_jax.interop.gin_flags import ParsedGin, add_gin_arguments, parse_gin, rewrite_gin_args
from qmoe_jax.models import SwitchConfig

for _cls in (SwitchConfig, SpanCorruptionTask, Seq2SeqTask, Mixture):
    gin.external_configurable(_cls, module="qmoe_jax")


@dataclasses.dataclass(frozen=True)
class GinRun:
    """What the gin config binds: the run settings, the model and the task definitions."""

    settings: eval_run.EvalSettings
    model: SwitchConfig | None
    definitions: list


@gin.configurable("evaluate", module="qmoe_jax")
def gin_evaluate(
    checkpoint_path: str = gin.REQUIRED,
    output_dir: str = gin.REQUIRED,
    mixture_or_task_name: str = gin.REQUIRED,
    task_feature_lengths: dict | None = None,
    batch_size: int = 32,
    experts: str = "compressed",
    model: SwitchConfig | None = None,
    tasks=(),
    extra_tasks=(),
    tokenizer: str | None = None,
    expert_parallel: str = "auto",
) -> GinRun:
    """Collects the gin-bound run; ``evaluate_with_gin`` runs it outside gin (so errors keep their
    own message)."""
    settings = eval_run.EvalSettings(
        checkpoint_path,
        output_dir,
        mixture_or_task_name,
        dict(task_feature_lengths) if task_feature_lengths else None,
        batch_size,
        experts,
        tokenizer,
        expert_parallel,
    )
    return GinRun(settings, model, list(tasks) + list(extra_tasks))


def evaluate_with_gin(argv: list[str]) -> dict:
    """``python -m qmoe_jax.evaluate --gin_file=... [--gin.NAME=VALUE ...]``; returns ``{task:
    metrics}``."""
    parser = argparse.ArgumentParser(
        prog="python -m qmoe_jax.evaluate (gin mode)",
        description="Evaluate as t5x.eval does, configured by gin files.",
    )
    add_gin_arguments(parser)
    add_debug_flag(parser)
    distributed_runtime.add_flags(parser)
    args = parser.parse_args(rewrite_gin_args(argv))
    parsed = parse_gin(args.gin_file, args.gin_bindings, args.gin_search_paths)
    run = _bound_run(parsed)
    model_files = parsed.files_mentioning(r"SwitchConfig|^MODEL\s*=|^(EMBED_DIM|NUM_EXPERTS)\s*=")
    try:
        return eval_run.run_evaluation(
            run.settings,
            run.definitions,
            run.model,
            gin.operative_config_str(),
            model_files,
            log=print,
            progress=sys.stderr.isatty(),
        )
    except UnknownTaskError as error:
        where = parsed.where_set("MIXTURE_OR_TASK_NAME") or "qmoe_jax.evaluate.mixture_or_task_name"
        defined = ", ".join(parsed.files_mentioning(r"Task\(|Mixture\(|TASKS")) or "no gin file"
        raise UnknownTaskError(
            f"{error} (MIXTURE_OR_TASK_NAME is set at {where}; tasks are defined in {defined})"
        ) from None


def _bound_run(parsed: ParsedGin) -> GinRun:
    try:
        return gin_evaluate()
    except (TypeError, ValueError) as error:
        # A configurable gin called without a value it needs (e.g. SwitchConfig missing a field), or
        # whose values it rejects (e.g. EXPERTS = 'sparse'); gin appends the configurable's name to
        # the message.
        lines = [line.strip() for line in str(error).splitlines() if line.strip()]
        raise ValueError(
            f"the gin config ({', '.join(parsed.files)}) does not build: {'; '.join(lines)}"
        ) from None
