"""A gin-driven evaluation of the tiny model: its model gin file and the flags of a run."""

from helpers.switch_fixtures import TINY

MACROS = {
    "num_encoder_layers": "NUM_ENCODER_LAYERS",
    "num_decoder_layers": "NUM_DECODER_LAYERS",
    "num_heads": "NUM_HEADS",
    "d_kv": "HEAD_DIM",
    "d_model": "EMBED_DIM",
    "d_ff": "MLP_DIM",
    "vocab_size": "NUM_EMBEDDINGS",
    "num_experts": "NUM_EXPERTS",
    "num_encoder_sparse_layers": "NUM_ENCODER_SPARSE_LAYERS",
    "num_decoder_sparse_layers": "NUM_DECODER_SPARSE_LAYERS",
    "group_size": "GROUP_SIZE",
    "eval_capacity_factor": "EVAL_EXPERT_CAPACITY_FACTOR",
}


def write_tiny_gin(path) -> None:
    """The tiny model (``switch_fixtures.TINY``) as a gin file of flaxformer's macros."""
    lines = [f"{macro} = {getattr(TINY, field)!r}" for field, macro in MACROS.items()]
    lines += [
        "ACTIVATION_DTYPE = 'float32'",
        "MODEL = @qmoe_jax.SwitchConfig()",
        "qmoe_jax.SwitchConfig:",
        "  name = 'tiny'",
        "  min_expert_capacity = 4",
        "  dtype = %ACTIVATION_DTYPE",
    ]
    lines += [f"  {field} = %{macro}" for field, macro in MACROS.items()]
    path.write_text("\n".join(lines) + "\n")


def span_corruption_flags(
    checkpoint: str,
    gin_folder: str,
    text: str,
    tokenizer: str,
    output_dir: str,
    task: str = "text_span_corruption",
) -> list[str]:
    """``python -m qmoe_jax.evaluate``'s gin flags for ``task`` (default: 20 span-corruption
    examples of ``text``; ``gin_folder`` holds tiny.gin)."""
    return [
        "--gin_file=runs/eval.gin",
        "--gin_file=tiny.gin",
        f"--gin_search_paths={gin_folder}",
        f"--gin.CHECKPOINT_PATH='{checkpoint}'",
        f"--gin.EVAL_OUTPUT_DIR='{output_dir}'",
        f"--gin.MIXTURE_OR_TASK_NAME='{task}'",
        f"--gin.TOKENIZER='{tokenizer}'",
        f"--gin.TEXT_FILES='{text}'",
        "--gin.BATCH_SIZE=8",
        "--gin.TASK_FEATURE_LENGTHS={'inputs': 32}",
        "--gin_bindings=text_span_corruption/qmoe_jax.SpanCorruptionTask.num_examples = 20",
    ]
