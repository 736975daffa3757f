"""Synthetic English-like sentences for tokenizers and calibration text in tests."""

import random

WORDS = [
    "the",
    "a",
    "compressed",
    "expert",
    "router",
    "token",
    "layer",
    "matrix",
    "weight",
    "ternary",
    "code",
    "dictionary",
    "model",
    "sparse",
    "dense",
    "switch",
    "calibration",
    "hessian",
    "column",
    "row",
    "kernel",
    "decode",
    "encode",
    "quickly",
    "slowly",
    "runs",
    "holds",
    "reads",
    "writes",
    "small",
    "large",
    "every",
    "each",
    "one",
    "two",
    "three",
]


def synthetic_sentences(count: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [
        " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 14))) + "." for _ in range(count)
    ]
