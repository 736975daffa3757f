"""benchmarks/dense_product.py --step lists a decoded token's dense products in the decoder's
order."""

import dataclasses
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))

import dense_product

from qmoe_jax.models.configs import get_config


def test_switch_base_step_is_every_dense_product_of_a_decoded_token():
    shapes = dense_product.decoding_step(get_config("switch-base-8"))
    attention = [(2304, 768), (768, 768), (768, 768), (768, 768)]
    mlp = [(3072, 768), (768, 3072)]
    # Switch's sparse layers are the odd ones (layers_1, layers_3, ...): their MLP is the experts'.
    expected = []
    for layer in range(12):
        expected += attention + (mlp if layer % 2 == 0 else [])
    assert shapes == expected + [(32128, 768)]
    assert len(shapes) == 61
    assert sum(rows * cols for rows, cols in shapes) == 95_453_184  # bytes in int8


def test_a_gated_dense_layer_has_both_input_kernels():
    config = dataclasses.replace(
        get_config("switch-base-8"), mlp_activations=("gelu", "linear"), num_decoder_sparse_layers=0
    )
    shapes = dense_product.decoding_step(config)
    assert shapes[4:7] == [(3072, 768), (3072, 768), (768, 3072)]
    assert len(shapes) == 12 * 7 + 1
