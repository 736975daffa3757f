"""Calibration and evaluation data: sources, tokenizer, T5 span corruption, batching, premasking."""

from qmoe_jax.data.batches import PREMASKS as PREMASKS
from qmoe_jax.data.batches import SpanCorruptionConfig as SpanCorruptionConfig
from qmoe_jax.data.batches import batch_examples as batch_examples
from qmoe_jax.data.batches import check_premask as check_premask
from qmoe_jax.data.batches import hessian_masks as hessian_masks
from qmoe_jax.data.batches import span_corruption_examples as span_corruption_examples
from qmoe_jax.data.batches import token_chunks as token_chunks
from qmoe_jax.data.seq2seq import Seq2SeqExample as Seq2SeqExample
from qmoe_jax.data.seq2seq import read_jsonl as read_jsonl
from qmoe_jax.data.seq2seq import tokenize_examples as tokenize_examples
from qmoe_jax.data.sources import c4_documents as c4_documents
from qmoe_jax.data.sources import string_documents as string_documents
from qmoe_jax.data.sources import text_file_documents as text_file_documents
from qmoe_jax.data.span_corruption import random_spans_helper as random_spans_helper
from qmoe_jax.data.span_corruption import random_spans_noise_mask as random_spans_noise_mask
from qmoe_jax.data.span_corruption import span_corrupt as span_corrupt
from qmoe_jax.data.tokenizer import Tokenizer as Tokenizer
from qmoe_jax.data.tokenizer import train_sentencepiece as train_sentencepiece
