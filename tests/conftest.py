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


@pytest.fixture(scope="session")
def tiny_setup(tmp_path_factory, tiny_tokenizer):
    """(checkpoint, calibration text, tokenizer) of the tiny Switch model of
    ``switch_fixtures.TINY``. One per session: tests read it and write copies."""
    from helpers.switch_fixtures import write_calibration_text, write_tiny_checkpoint

    root = tmp_path_factory.mktemp("tiny")
    checkpoint = write_tiny_checkpoint(root / "t5x")
    text = write_calibration_text(root / "calibration.txt")
    return checkpoint, text, tiny_tokenizer.model_path


@pytest.fixture(scope="session")
def compressed_tiny(tmp_path_factory, tiny_setup, tiny_tokenizer):
    """(T5X checkpoint, compressed directory, tokenizer) of the tiny Switch model, compressed with
    GPTQ by ``compression_runs.options(tiny_setup, ...)``, the settings the compression tests
    resume with. One per session: tests read it and write copies."""
    from helpers.compression_runs import options
    from helpers.switch_fixtures import TINY

    from qmoe_jax.compression.job import compress_checkpoint

    directory = tmp_path_factory.mktemp("compressed") / "tiny"
    compress_checkpoint(
        options(tiny_setup, directory), log=lambda _: None, progress=False, config=TINY
    )
    return tiny_setup[0], str(directory), tiny_tokenizer
