import os

import pytest
from helpers.text import synthetic_sentences


@pytest.fixture(scope="session")
def tiny_tokenizer(tmp_path_factory):
    """A 64-piece SentencePiece model in T5's id layout, trained on synthetic text."""
    from qmoe_jax.data.tokenizer import Tokenizer, train_sentencepiece

    prefix = os.path.join(tmp_path_factory.mktemp("spm"), "tiny")
    return Tokenizer(
        train_sentencepiece(
            synthetic_sentences(2000), prefix, vocab_size=64, seed_sentencepiece_size=1000
        )
    )


@pytest.fixture(scope="session")
def dictionary():
    """QMoE's static dictionary (p0 = 0.885)."""
    from qmoe_jax.codec import build_dictionary

    return build_dictionary(0.885)


@pytest.fixture(scope="module")
def tiny_setup(tmp_path_factory, tiny_tokenizer):
    """(checkpoint, calibration text, tokenizer) of the tiny Switch model of
    ``switch_fixtures.TINY``."""
    from helpers.switch_fixtures import write_calibration_text, write_tiny_checkpoint

    root = tmp_path_factory.mktemp("tiny")
    checkpoint = write_tiny_checkpoint(root / "t5x")
    text = write_calibration_text(root / "calibration.txt")
    return checkpoint, text, tiny_tokenizer.model_path


@pytest.fixture(scope="module")
def compressed_tiny(tmp_path_factory, tiny_tokenizer):
    """(T5X checkpoint, compressed directory, tokenizer) of the tiny Switch model, compressed with
    GPTQ."""
    from helpers.switch_fixtures import TINY, write_calibration_text, write_tiny_checkpoint

    from qmoe_jax.compression.job import CompressionOptions, compress_checkpoint

    root = tmp_path_factory.mktemp("inference")
    checkpoint = write_tiny_checkpoint(root / "t5x")
    text = write_calibration_text(root / "calibration.txt")
    options = CompressionOptions(
        checkpoint=checkpoint,
        tokenizer=tiny_tokenizer.model_path,
        calibration=f"text:{text}",
        num_samples=24,
        inputs_length=32,
        batch_size=8,
        group_size=2,
        output_dir=str(root / "compressed"),
    )
    compress_checkpoint(options, log=lambda _: None, progress=False, config=TINY)
    return checkpoint, str(root / "compressed"), tiny_tokenizer
