"""Gin mode of ``python -m qmoe_jax.evaluate``: the gin bindings of the run, the model and the tasks.

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
import sys

import gin

from qmoe_jax.cli import add_debug_flag
from qmoe_jax.interop import eval_run
from qmoe_jax.interop.eval_tasks import Mixture, Seq2SeqTask, SpanCorruptionTask, UnknownTaskError
from qmoe_jax.interop.gin_flags import ParsedGin, add_gin_arguments, parse_gin, rewrite_gin_args
from qmoe_jax.models import SwitchConfig

for _cls in (SwitchConfig, SpanCorruptionTask, Seq2SeqTask, Mixture):
    gin.external_configurable(_cls, module="qmoe_jax")

_PARSED: list[ParsedGin] = []  # the parse of the running command, for naming files in errors


@gin.configurable("evaluate", module="qmoe_jax")
def gin_evaluate(checkpoint_path: str = gin.REQUIRED, output_dir: str = gin.REQUIRED,
                 mixture_or_task_name: str = gin.REQUIRED, task_feature_lengths: dict | None = None,
                 batch_size: int = 32, experts: str = "compressed", model: SwitchConfig | None = None,
                 tasks=(), extra_tasks=(), tokenizer: str | None = None, expert_parallel: str = "auto") -> dict:
    """The gin-bound run: ``eval_run.run_evaluation`` with the operative config written as ``config.gin``."""
    parsed = _PARSED[-1] if _PARSED else ParsedGin((), ())
    settings = eval_run.EvalSettings(checkpoint_path, output_dir, mixture_or_task_name,
                                     dict(task_feature_lengths) if task_feature_lengths else None, batch_size,
                                     experts, tokenizer, expert_parallel)
    model_files = parsed.files_mentioning(r"SwitchConfig|^MODEL\s*=|^(EMBED_DIM|NUM_EXPERTS)\s*=")
    try:
        return eval_run.run_evaluation(settings, list(tasks) + list(extra_tasks), model, gin.operative_config_str(),
                                       model_files, log=print, progress=sys.stderr.isatty())
    except UnknownTaskError as error:
        where = parsed.where_set("MIXTURE_OR_TASK_NAME") or "evaluate.mixture_or_task_name"
        defined = ", ".join(parsed.files_mentioning(r"Task\(|Mixture\(|TASKS")) or "no gin file"
        raise UnknownTaskError(f"{error} (MIXTURE_OR_TASK_NAME is set at {where}; tasks are defined in "
                               f"{defined})") from None


def evaluate_with_gin(argv: list[str]) -> dict:
    """``python -m qmoe_jax.evaluate --gin_file=... [--gin.NAME=VALUE ...]``."""
    parser = argparse.ArgumentParser(prog="python -m qmoe_jax.evaluate (gin mode)",
                                     description="Evaluate as t5x.eval does, configured by gin files.")
    add_gin_arguments(parser)
    add_debug_flag(parser)
    args = parser.parse_args(rewrite_gin_args(argv))
    parsed = parse_gin(args.gin_file, args.gin_bindings, args.gin_search_paths)
    _PARSED.append(parsed)
    try:
        return _call_run(parsed)
    finally:
        _PARSED.pop()


def _call_run(parsed: ParsedGin) -> dict:
    try:
        return gin_evaluate()
    except TypeError as error:
        if "In call to configurable" not in str(error):
            raise
        # A configurable called without a value gin should have supplied (e.g. SwitchConfig missing a field).
        lines = [line.strip() for line in str(error).splitlines() if line.strip()]
        raise ValueError(f"gin config of {', '.join(parsed.files)} is incomplete: {'; '.join(lines)}") from None
