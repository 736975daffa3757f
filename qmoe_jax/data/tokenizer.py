"""SentencePiece vocabulary with T5's 100 sentinels.

Lingo (T5): ids 0 = PAD (also the decoder start), 1 = EOS, 2 = UNK; the
SentencePiece model has ``n`` pieces; sentinel ``<extra_id_j>`` is id
``n + 99 - j``, so ``<extra_id_0>`` is the largest id. The model's embedding
table may be padded beyond ``n + 100`` rows (T5: 32128).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable

import numpy as np
import sentencepiece

PAD_ID = 0
EOS_ID = 1
UNK_ID = 2
NUM_SENTINELS = 100
SENTINEL_MARK = re.compile(r"<extra_id_(\d+)>")


class Tokenizer:
    """A SentencePiece model plus ``extra_ids`` sentinels, like T5's SentencePieceVocabulary."""

    def __init__(self, model_path: str, extra_ids: int = NUM_SENTINELS):
        if not os.path.isfile(model_path):
            raise FileNotFoundError(f"SentencePiece model {model_path!r} does not exist")
        self.model_path = model_path
        self._processor = sentencepiece.SentencePieceProcessor(model_file=model_path)
        for name, expected, actual in (
            ("pad", PAD_ID, self._processor.pad_id()),
            ("eos", EOS_ID, self._processor.eos_id()),
            ("unk", UNK_ID, self._processor.unk_id()),
        ):
            if actual != expected:
                raise ValueError(
                    f"{model_path} has {name}_id={actual}; T5 models need pad=0, eos=1, unk=2 "
                    "(train with pad_id=0 eos_id=1 unk_id=2 bos_id=-1)"
                )
        self.extra_ids = extra_ids
        self.pieces = self._processor.get_piece_size()

    @property
    def vocab_size(self) -> int:
        """Pieces plus sentinels (the model's embedding may be padded beyond this)."""
        return self.pieces + self.extra_ids

    def sentinel(self, j: int) -> int:
        """Id of ``<extra_id_j>``."""
        if not 0 <= j < self.extra_ids:
            raise ValueError(f"sentinel index {j} out of range [0, {self.extra_ids})")
        return self.vocab_size - 1 - j

    def is_sentinel(self, ids: np.ndarray) -> np.ndarray:
        ids = np.asarray(ids)
        return (ids >= self.pieces) & (ids < self.vocab_size)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no EOS appended)."""
        return self._processor.encode(text)

    def encode_with_sentinels(self, text: str) -> list[int]:
        """Token ids of ``text`` in which ``<extra_id_j>`` marks are sentinel ids (T5's
        span-infilling syntax), the text between them encoded as usual (no EOS appended)."""
        ids: list[int] = []
        for index, part in enumerate(SENTINEL_MARK.split(text)):
            if index % 2:
                if int(part) >= self.extra_ids:
                    raise ValueError(
                        f"unknown sentinel <extra_id_{part}>: this vocabulary has "
                        f"<extra_id_0> to <extra_id_{self.extra_ids - 1}>"
                    )
                ids.append(self.sentinel(int(part)))
            elif part.strip():
                ids.extend(self._processor.encode(part))
        return ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self._processor.encode(texts)

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids``; stops at EOS, skips PAD, writes sentinels as ``<extra_id_j>``."""
        out: list[str] = []
        run: list[int] = []
        for token in ids:
            token = int(token)
            if token == EOS_ID:
                break
            if token == PAD_ID:
                continue
            if self.pieces <= token < self.vocab_size:
                out.append(self._processor.decode(run))
                run = []
                out.append(f"<extra_id_{self.vocab_size - 1 - token}>")
            elif token >= self.vocab_size:
                raise ValueError(
                    f"token id {token} is outside the vocabulary ({self.vocab_size} ids)"
                )
            else:
                run.append(token)
        out.append(self._processor.decode(run))
        return "".join(out)


def train_sentencepiece(
    texts: Iterable[str], model_prefix: str, vocab_size: int, seed_sentencepiece_size: int = 200_000
) -> str:
    """Trains a unigram SentencePiece model in T5's id layout; returns the .model path.

    Args:
      texts: training sentences (lines).
      model_prefix: output path without extension.
      vocab_size: number of pieces (sentinels are added on top by ``Tokenizer``).
    """
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(texts),
        model_prefix=model_prefix,
        vocab_size=vocab_size,
        model_type="unigram",
        pad_id=PAD_ID,
        eos_id=EOS_ID,
        unk_id=UNK_ID,
        bos_id=-1,
        character_coverage=1.0,
        seed_sentencepiece_size=seed_sentencepiece_size,
        num_threads=1,
        minloglevel=2,
    )
    return model_prefix + ".model"
