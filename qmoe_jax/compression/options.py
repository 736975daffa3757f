"""The main job's options: ``CompressionOptions``, which ``python -m qmoe_jax.compress`` builds
from its flags, with their checks and the settings the manifest header records."""

from __future__ import annotations

import dataclasses

import jax

from qmoe_jax.calibration.expert_groups import ExpertCompressionConfig
from qmoe_jax.calibration.layer_pass import CalibrationConfig
from qmoe_jax.checkpoints.nonfinite import check_policy
from qmoe_jax.data import SpanCorruptionConfig, bundled, check_premask
from qmoe_jax.models.configs import resolve_config
from qmoe_jax.quant import GPTQConfig, GridConfig

BUNDLED_EVAL_EXAMPLES = 256
GRIDS = {"ternary": GridConfig()} | {
    f"{b}bit": GridConfig(kind="minmax", bits=b) for b in (2, 3, 4, 8)
}
VERIFY_LEVELS = ("quick", "full")
FLOAT_DTYPES = ("float32", "bfloat16", "float16")


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
      nonfinite: NaN or ±inf in a source array: "error" (stop, naming the
        array) or "zero" (set them to 0, counted in the manifest and report).
        Not recorded in the header: a run that zeroed nothing may continue
        under either policy (``resume.check_resume``).
      verify: what a resumed run checks before going on (docs/recovery.md): "quick"
        (every file of the finished parts there with its recorded size, dense/ and
        the dictionaries by checksum, the source's files by size, mtime, ctime and
        inode) or "full" (also every layer's checksums, and every source array read
        once before the first layer and compared by SHA-256 with what the finished
        parts were made from; a copied source resumes only so).
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
    nonfinite: str = _not_in_header("error")
    verify: str = _not_in_header("quick")

    def __post_init__(self):
        if self.grid not in GRIDS:
            raise ValueError(f"unknown grid {self.grid!r}; choose one of {', '.join(GRIDS)}")
        if self.num_samples < 1:
            raise ValueError(f"num_samples must be at least 1, got {self.num_samples}")
        if not (self.calibration == "bundled" or self.calibration.startswith(("c4:", "text:"))):
            raise ValueError(
                "calibration must be 'bundled', 'c4:<dir>' or 'text:<glob>', got "
                f"{self.calibration!r}"
            )
        if self.gptq_memory_mb is not None and self.gptq_memory_mb < 1:
            raise ValueError(f"gptq_memory_mb must be at least 1 (MiB), got {self.gptq_memory_mb}")
        if self.eval_examples is not None and self.eval_examples < 0:
            raise ValueError(f"eval_examples must be 0 (off) or more, got {self.eval_examples}")
        if not (
            self.eval_data is None
            or self.eval_data == "bundled"
            or self.eval_data.startswith("c4:")
        ):
            raise ValueError(
                f"eval_data must be 'bundled' or 'c4:<dir or glob>', got {self.eval_data!r}"
            )
        if self.evaluation_examples() and self.evaluation_data() is None:
            raise ValueError(
                "--eval_examples needs validation text: pass --eval_data bundled or --eval_data "
                "c4:<dir>"
            )
        if self.config:
            resolve_config(self.config)
        check_policy(self.nonfinite)
        if self.verify not in VERIFY_LEVELS:
            raise ValueError(
                f"unknown verify level {self.verify!r}; choose one of {', '.join(VERIFY_LEVELS)}"
            )
        # The sub-configs validate their own fields (damping, group size, premask, ...), here,
        # before any work.
        self.span_corruption()
        self.calibration_config(self.gptq_memory_mb or 1)
        check_premask(self.premask)

    def span_corruption(self) -> SpanCorruptionConfig:
        packing = "document" if self.calibration.startswith("c4:") else "concat"
        return SpanCorruptionConfig(
            inputs_length=self.inputs_length, packing=packing, seed=self.seed
        )

    def calibration_config(self, gptq_memory_mb: int) -> CalibrationConfig:
        return CalibrationConfig(
            experts=ExpertCompressionConfig(
                grid=GRIDS[self.grid],
                method=self.method,
                group_size=self.group_size,
                gptq=GPTQConfig(act_order=self.act_order, damping=self.damping),
                true_sequential=self.true_sequential,
                gptq_memory=gptq_memory_mb << 20,
            ),
            dictionary=self.dictionary,
            batch_size=self.batch_size,
        )

    def evaluation_examples(self) -> int:
        if self.eval_examples is not None:
            return self.eval_examples
        return BUNDLED_EVAL_EXAMPLES if self.checkpoint is None else 0

    def evaluation_data(self) -> str | None:
        if self.eval_data is not None:
            return self.eval_data
        return (
            self.calibration
            if self.calibration == "bundled" or self.calibration.startswith("c4:")
            else None
        )

    def header_settings(self, **resolved) -> dict:
        """The recorded fields, with ``resolved`` values replacing the given ones."""
        return {
            field.name: resolved.get(field.name, getattr(self, field.name))
            for field in dataclasses.fields(self)
            if field.metadata.get("header", True)
        }


def default_gptq_memory_mb() -> int:
    """A quarter of this process's first device's memory (256 MiB on CPU, which reports none)."""
    stats = jax.local_devices()[0].memory_stats() or {}
    limit = stats.get("bytes_limit")
    return int(limit // 4 >> 20) if limit else 256
