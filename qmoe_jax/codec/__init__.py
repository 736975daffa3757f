"""Sub-1-bit ternary codec: the QMoE dictionary, encoder, decoder and containers."""

from qmoe_jax.codec.adaptive import DictionaryMode as DictionaryMode
from qmoe_jax.codec.adaptive import adaptive_dictionary as adaptive_dictionary
from qmoe_jax.codec.adaptive import adaptive_p0 as adaptive_p0
from qmoe_jax.codec.adaptive import dictionary_for as dictionary_for
from qmoe_jax.codec.adaptive import estimate_p0 as estimate_p0
from qmoe_jax.codec.adaptive import tuned_dictionary as tuned_dictionary
from qmoe_jax.codec.containers import CompressedExperts as CompressedExperts
from qmoe_jax.codec.containers import CompressedMatrix as CompressedMatrix
from qmoe_jax.codec.dictionary import DEFAULT_P0 as DEFAULT_P0
from qmoe_jax.codec.dictionary import Dictionary as Dictionary
from qmoe_jax.codec.dictionary import build_dictionary as build_dictionary
from qmoe_jax.codec.encoder import count_codewords as count_codewords
from qmoe_jax.codec.encoder import encode as encode
from qmoe_jax.codec.encoder import encode_experts as encode_experts
from qmoe_jax.codec.reference import decode_codes as decode_codes
from qmoe_jax.codec.reference import decode_codes_jnp as decode_codes_jnp
from qmoe_jax.codec.reference import encode_reference as encode_reference
