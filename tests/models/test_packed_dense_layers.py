"""The model with its dense matrices and embedding packed (bfloat16, or int8 with row scales)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.tiny_model import TINY, init, run, shift_right

from qmoe_jax.inference.dense_forms import QKV, dense_bytes, pack_dense_params, packed_orientation
from qmoe_jax.kernels import dense
from qmoe_jax.kernels.dense import PackedMatrix
from qmoe_jax.models import decode_step, init_cache
from qmoe_jax.models.layers import MultiHeadAttention

GATED_UNTIED = dataclasses.replace(TINY, mlp_activations=("gelu", "linear"), logits_dense=True)


def unpacked(params):
    """The float32 tree with exactly the weights a packed tree stands for (a fused ``qkv`` split
    back into the query, key and value kernels)."""

    def convert(node, path):
        if isinstance(node, dict):
            node = dict(node)
            if "qkv" in node:
                rows = np.split(np.asarray(dense.unpack(node.pop("qkv")["kernel"])), 3)
                node.update({name: {"kernel": m.T} for name, m in zip(QKV, rows)})
            return {key: convert(value, (*path, key)) for key, value in node.items()}
        if not isinstance(node, PackedMatrix):
            return node
        matrix = dense.unpack(node)
        return matrix if packed_orientation(path) == "as_is" else matrix.T

    return convert(params, ())


def decoded_token_by_token(model, params, encoder_tokens, decoder_inputs):
    """The logits ``[B, L, V]`` of incremental decoding, one decoder input per step, with a cache
    of the inputs' length."""
    encoded = run(model, params, encoder_tokens, method="encode")
    length = decoder_inputs.shape[1]
    cache = init_cache(model, params, encoded, encoder_tokens, max_decode_length=length)
    steps = []
    for t in range(length):
        logits, cache = decode_step(
            model, params, cache, encoded, encoder_tokens, decoder_inputs[:, t : t + 1]
        )
        steps.append(logits)
    return np.asarray(jnp.concatenate(steps, axis=1))


@pytest.mark.parametrize("form", dense.FORMS)
@pytest.mark.parametrize("config", [TINY, GATED_UNTIED], ids=["tied", "gated-untied"])
def test_packed_model_computes_with_the_weights_it_stores(form, config):
    model, params, encoder_tokens, targets = init(config)
    packed = pack_dense_params(params, form)
    flat = jax.tree_util.tree_flatten_with_path(
        packed, is_leaf=lambda leaf: isinstance(leaf, PackedMatrix)
    )[0]
    kinds = {jax.tree_util.keystr(path): type(leaf).__name__ for path, leaf in flat}
    assert kinds["['token_embedder']['embedding']"] == "PackedMatrix"
    # Self-attention's query, key and value are one matrix; cross-attention's stay apart.
    assert kinds["['decoder']['layers_0']['self_attention']['qkv']['kernel']"] == "PackedMatrix"
    assert kinds["['encoder']['layers_0']['attention']['qkv']['kernel']"] == "PackedMatrix"
    assert "['decoder']['layers_0']['self_attention']['query']['kernel']" not in kinds
    cross = "['decoder']['layers_0']['encoder_decoder_attention']"
    for name in QKV:
        assert kinds[f"{cross}['{name}']['kernel']"] == "PackedMatrix"
    assert kinds["['encoder']['layers_0']['mlp']['wo']['kernel']"] == "PackedMatrix"
    router = "['decoder']['layers_1']['mlp']['router']['router_weights']['w']['kernel']"
    assert kinds[router] == "ArrayImpl"
    assert kinds["['decoder']['layers_1']['mlp']['expert']['wo']['kernel']"] == "ArrayImpl"
    assert kinds["['decoder']['decoder_norm']['scale']"] == "ArrayImpl"
    if config.logits_dense:
        assert kinds["['decoder']['logits_dense']['kernel']"] == "PackedMatrix"
    inputs = (encoder_tokens, shift_right(targets), targets)
    logits = run(model, packed, *inputs)
    expected = run(model, unpacked(packed), *inputs)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(expected), rtol=1e-4, atol=1e-4)
    # The stored weights are close to the originals: so are the logits.
    original = run(model, params, *inputs)
    tolerance = 0.02 if form == "bfloat16" else 0.05
    assert float(jnp.max(jnp.abs(logits - original))) < tolerance * float(
        jnp.max(jnp.abs(original))
    )


@pytest.mark.parametrize("form", dense.FORMS)
def test_fused_self_attention_computes_what_three_kernels_do(form):
    """One product of the stacked rows gives each row's sum exactly as its own product does, in
    teacher forcing and in incremental decoding."""
    model, params, encoder_tokens, targets = init(TINY)
    fused = pack_dense_params(params, form)
    apart = pack_dense_params(params, form, fuse_self_attention=False)
    assert "qkv" in fused["decoder"]["layers_0"]["self_attention"]
    assert set(QKV) <= set(apart["decoder"]["layers_0"]["self_attention"])
    np.testing.assert_array_equal(
        np.asarray(fused["encoder"]["layers_0"]["attention"]["qkv"]["kernel"].values),
        np.concatenate(
            [np.asarray(apart["encoder"]["layers_0"]["attention"][n]["kernel"].values) for n in QKV]
        ),
    )
    decoder_inputs = shift_right(targets)
    np.testing.assert_array_equal(
        run(model, fused, encoder_tokens, decoder_inputs, targets),
        run(model, apart, encoder_tokens, decoder_inputs, targets),
    )
    np.testing.assert_array_equal(
        decoded_token_by_token(model, fused, encoder_tokens, decoder_inputs[:, :3]),
        decoded_token_by_token(model, apart, encoder_tokens, decoder_inputs[:, :3]),
    )


@pytest.mark.parametrize("form", dense.FORMS)
def test_fused_kernel_serves_inputs_that_are_distinct_arrays(form):
    """A transformation may hand self-attention its input as two arrays: the fused kernel then
    runs as two products and computes the same."""
    config = TINY
    attention = MultiHeadAttention(config)
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 5, config.d_model))
    params = attention.init(jax.random.PRNGKey(1), x, x, None, None)["params"]
    fused = pack_dense_params({"attention": params}, form)["attention"]
    apart = pack_dense_params({"attention": params}, form, fuse_self_attention=False)["attention"]
    same = jax.jit(lambda p, x: attention.apply({"params": p}, x, x, None, None))
    copied = jax.jit(lambda p, x: attention.apply({"params": p}, x, x * 1.0 + 0.0, None, None))
    expected = np.asarray(same(apart, x))
    np.testing.assert_allclose(np.asarray(same(fused, x)), expected, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(copied(fused, x)), expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("form", dense.FORMS)
def test_packed_incremental_decoding_matches_teacher_forcing(form):
    model, params, encoder_tokens, targets = init(TINY)
    params = pack_dense_params(params, form)
    decoder_inputs = shift_right(targets)
    full = run(model, params, encoder_tokens, decoder_inputs, targets)
    steps = decoded_token_by_token(model, params, encoder_tokens, decoder_inputs)
    np.testing.assert_allclose(steps, full, rtol=1e-5, atol=1e-5)


def test_packed_forms_store_a_half_and_a_quarter():
    _, params, _, _ = init(TINY)
    dense_only = {
        key: value
        for key, value in jax.tree_util.tree_flatten_with_path(params)[0]
        if packed_orientation(tuple(k.key for k in key)) is not None
    }
    matrices = sum(np.asarray(v).nbytes for v in dense_only.values())
    total = dense_bytes(params)
    rows = sum(
        np.shape(v)[0 if "embedding" in jax.tree_util.keystr(k) else 1]
        for k, v in dense_only.items()
    )
    assert dense_bytes(pack_dense_params(params, "bfloat16")) == total - matrices // 2
    assert dense_bytes(pack_dense_params(params, "int8")) == total - matrices * 3 // 4 + 4 * rows
    with pytest.raises(ValueError, match="unknown dense dtype"):
        pack_dense_params(params, "float16")


def test_packing_may_release_the_source_tree():
    _, params, _, _ = init(TINY)
    source = jax.tree.map(np.asarray, params)
    kept = pack_dense_params(source, "int8")
    assert jax.tree.leaves(source), "without release_source the input stays whole"
    released = pack_dense_params(source, "int8", release_source=True)
    assert not jax.tree.leaves(source), "with release_source every source leaf is dropped"
    for a, b in zip(
        jax.tree.leaves(kept, is_leaf=lambda leaf: isinstance(leaf, PackedMatrix)),
        jax.tree.leaves(released, is_leaf=lambda leaf: isinstance(leaf, PackedMatrix)),
    ):
        np.testing.assert_array_equal(
            np.asarray(dense.unpack(a) if isinstance(a, PackedMatrix) else a),
            np.asarray(dense.unpack(b) if isinstance(b, PackedMatrix) else b),
        )
