import os
import random

import pytest

WORDS = (
    "the a compressed expert router token layer matrix weight ternary code dictionary "
    "model sparse dense switch calibration hessian column row kernel decode encode "
    "quickly slowly runs holds reads writes small large every each one two three"
).split()


def synthetic_sentences(count: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 14))) + "." for _ in range(count)]


@pytest.fixture(scope="session")
def tiny_tokenizer(tmp_path_factory):
    """A 64-piece SentencePiece model in T5's id layout, trained on synthetic text."""
    from qmoe_jax.data.tokenizer import Tokenizer, train_sentencepiece

    prefix = os.path.join(tmp_path_factory.mktemp("spm"), "tiny")
    return Tokenizer(train_sentencepiece(synthetic_sentences(2000), prefix, vocab_size=64, seed_sentencepiece_size=1000))


@pytest.fixture(scope="session")
def dictionary():
    """QMoE's static dictionary (p0 = 0.885)."""
    from qmoe_jax.codec import build_dictionary

    return build_dictionary(0.885)


@pytest.fixture(scope="module")
def tiny_setup(tmp_path_factory, tiny_tokenizer):
    """(checkpoint, calibration text, tokenizer) of the tiny Switch model of ``switch_fixtures.TINY``."""
    from switch_fixtures import write_calibration_text, write_tiny_checkpoint

    root = tmp_path_factory.mktemp("tiny")
    checkpoint = write_tiny_checkpoint(root / "t5x")
    text = write_calibration_text(root / "calibration.txt")
    return checkpoint, text, tiny_tokenizer.model_path
