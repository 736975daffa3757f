"""The bundled model: switch-mini-8, trained by checkpoints/train_bundled.py.

Locates its files (installed with the package, or in a source checkout) and
defines its data: SentencePiece vocabulary, span-corruption lengths, and the
calibration / validation splits of the bundled corpus.
"""

from __future__ import annotations

import glob
import os

from qmoe_jax.data.batches import SpanCorruptionConfig

CONFIG_NAME = "switch-mini-8"
SENTENCEPIECE_PIECES = 4000
INPUTS_LENGTH = 128
# Decoder length: random_spans_helper(128) gives 29 target tokens; pad to 32.
DECODER_LENGTH = 32
VALIDATION_SEED = 0


def model_dir() -> str:
    """Directory holding the bundled checkpoint, tokenizer and metadata.

    An installed package carries it as ``qmoe_jax/bundled/<name>`` (CMakeLists.txt installs it
    there); a source checkout has it in the repository's ``checkpoints/<name>``, beside
    ``qmoe_jax/``.
    """
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    candidates = [
        os.path.join(package, "bundled", CONFIG_NAME),
        os.path.join(os.path.dirname(package), "checkpoints", CONFIG_NAME),
    ]
    for candidate in candidates:
        if os.path.isdir(candidate):
            return candidate
    raise FileNotFoundError(
        f"the bundled model {CONFIG_NAME} is not installed (looked in {candidates}); "
        "reinstall qmoe_jax from a full source checkout"
    )


def checkpoint_path() -> str:
    """The bundled T5X checkpoint directory (``checkpoint_<step>``)."""
    found = sorted(glob.glob(os.path.join(model_dir(), "checkpoint_*")))
    if not found:
        raise FileNotFoundError(f"no checkpoint_<step> directory in {model_dir()}")
    return found[-1]


def tokenizer_path() -> str:
    return os.path.join(model_dir(), "spm.model")


def span_corruption_config(seed: int = VALIDATION_SEED) -> SpanCorruptionConfig:
    return SpanCorruptionConfig(inputs_length=INPUTS_LENGTH, seed=seed)
