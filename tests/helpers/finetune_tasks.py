"""The fine-tuning task of the tests: name a sentence's first word, as a jsonl task."""

import json

from helpers.text import synthetic_sentences


def write_first_word_task(root) -> str:
    """Writes train.jsonl (360 pairs) and validation.jsonl (40) under ``root``; returns the
    ``--task`` that reads them."""
    sentences = synthetic_sentences(400, seed=3)
    lines = [json.dumps({"inputs": "first word: " + s, "targets": s.split()[0]}) for s in sentences]
    (root / "train.jsonl").write_text("\n".join(lines[:360]) + "\n")
    (root / "validation.jsonl").write_text("\n".join(lines[360:]) + "\n")
    return f"jsonl:{root / 'train.jsonl'},{root / 'validation.jsonl'}"
