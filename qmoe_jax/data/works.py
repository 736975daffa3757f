"""The bundled downstream task "name_the_work": given a passage of the bundled corpus, name the
work.

Lingo: a *passage* is a run of consecutive non-blank lines of one work, cut
after the line that brings it to at least ``PASSAGE_WORDS`` words; passages
never overlap. Passage i of a work is held out for validation when
``i % VALIDATION_EVERY == VALIDATION_OFFSET`` (every tenth), so train and
validation share no passage but cover every work; the 42 works of the corpus
(both of its splits) are the classes. Inputs read ``name the work: <passage>``;
the target is the work's name with spaces (``julius caesar``).
"""

from __future__ import annotations

import os

from qmoe_jax.data import corpus
from qmoe_jax.data.seq2seq import Seq2SeqExample

PASSAGE_WORDS = 40
VALIDATION_EVERY = 10
VALIDATION_OFFSET = 5
PROMPT = "name the work: "


def passages(text: str, words: int = PASSAGE_WORDS) -> list[str]:
    """Non-overlapping passages of ``text`` (lines joined by " "); a short tail is dropped."""
    found, lines, count = [], [], 0
    for line in text.splitlines():
        line = line.strip()
        if not line:
            continue
        lines.append(line)
        count += len(line.split())
        if count >= words:
            found.append(" ".join(lines))
            lines, count = [], 0
    return found


def title(work: str) -> str:
    return work.replace("_", " ")


def examples(split: str) -> list[Seq2SeqExample]:
    """The split's examples ("train" or "validation"), work by work in name order, each with its
    source ``<work>#<passage index>``."""
    if split not in corpus.SPLITS:
        raise ValueError(f"unknown split {split!r}; name_the_work has {corpus.SPLITS}")
    found = []
    for work in corpus.work_names():
        with open(os.path.join(corpus.texts_dir(), f"{work}_gut.txt"), encoding="utf-8") as f:
            text = f.read()
        for index, passage in enumerate(passages(text)):
            held_out = index % VALIDATION_EVERY == VALIDATION_OFFSET
            if held_out == (split == "validation"):
                found.append(Seq2SeqExample(PROMPT + passage, title(work), f"{work}#{index}"))
    return found
