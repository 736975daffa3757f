"""The model with its dense matrices and embedding packed (bfloat16, or int8 with row scales)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.tiny_model import TINY, init, run, shift_right

from qmoe_jax.inference.dense_forms import dense_bytes, pack_dense_params, packed_orientation
from qmoe_jax.kernels import dense
from qmoe_jax.kernels.dense import PackedMatrix
from qmoe_jax.models import decode_step, init_cache

GATED_UNTIED = dataclasses.replace(TINY, mlp_activations=("gelu", "linear"), logits_dense=True)


def unpacked(params):
    """The float32 tree with exactly the weights a packed tree stands for."""

    def convert(node, path):
        if isinstance(node, dict):
            return {key: convert(value, (*path, key)) for key, value in node.items()}
        if not isinstance(node, PackedMatrix):
            return node
        matrix = dense.unpack(node)
        return matrix if packed_orientation(path) == "as_is" else matrix.T

    return convert(params, ())


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
    assert kinds["['decoder']['layers_0']['self_attention']['query']['kernel']"] == "PackedMatrix"
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
def test_packed_incremental_decoding_matches_teacher_forcing(form):
    model, params, encoder_tokens, targets = init(TINY)
    params = pack_dense_params(params, form)
    decoder_inputs = shift_right(targets)
    full = run(model, params, encoder_tokens, decoder_inputs, targets)
    encoded = run(model, params, encoder_tokens, method="encode")
    cache = init_cache(model, params, encoded, encoder_tokens, max_decode_length=6)
    steps = []
    for t in range(6):
        logits, cache = decode_step(
            model, params, cache, encoded, encoder_tokens, decoder_inputs[:, t : t + 1]
        )
        steps.append(logits)
    np.testing.assert_allclose(jnp.concatenate(steps, axis=1), full, rtol=1e-5, atol=1e-5)


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
