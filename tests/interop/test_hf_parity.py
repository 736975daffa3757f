"""Numerical parity with Hugging Face transformers' SwitchTransformers (PyTorch, CPU).

A tiny random HF model is mapped into the T5X tree and both run in float32.
Capacities are set so that no token drops in either model (HF: a fixed
per-sequence ``expert_capacity`` >= the sequence length; ours: eval capacity
factor E, i.e. capacity = tokens per group). Tolerance: max |Δlogit| <= 1e-4.
"""

import dataclasses

import jax
import numpy as np
import pytest

from qmoe_jax.checkpoints import hf_names
from qmoe_jax.models import MoeLayer, SwitchConfig, SwitchTransformer

torch = pytest.importorskip("torch", reason="parity tests need torch (pip install torch==2.13.0)")
transformers = pytest.importorskip(
    "transformers", reason="parity tests need transformers (pip install transformers protobuf)"
)

pytestmark = pytest.mark.parity

TOLERANCE = 1e-4
VOCAB, D_MODEL, HEADS, D_KV, D_FF, LAYERS, SPARSE, EXPERTS = 160, 32, 4, 8, 64, 4, 2, 4


def build_hf(tied: bool, seed: int, expert_capacity: int = 64):
    torch.manual_seed(seed)
    config = transformers.SwitchTransformersConfig(
        vocab_size=VOCAB,
        d_model=D_MODEL,
        d_kv=D_KV,
        d_ff=D_FF,
        num_heads=HEADS,
        num_layers=LAYERS,
        num_decoder_layers=LAYERS,
        num_experts=EXPERTS,
        num_sparse_encoder_layers=SPARSE,
        num_sparse_decoder_layers=SPARSE,
        expert_capacity=expert_capacity,
        dropout_rate=0.0,
        router_jitter_noise=0.0,
        router_dtype="float32",
        tie_word_embeddings=tied,
        decoder_start_token_id=0,
        pad_token_id=0,
    )
    model = transformers.SwitchTransformersForConditionalGeneration(config).eval()
    if not tied:
        # In transformers 5.x untying also unties the encoder/decoder input
        # embeddings; T5X shares one token embedder, so share it here too.
        model.encoder.embed_tokens.weight.data.copy_(model.shared.weight.data)
        model.decoder.embed_tokens.weight.data.copy_(model.shared.weight.data)
    return model


def our_config(tied: bool) -> SwitchConfig:
    return SwitchConfig(
        name="hf-parity",
        vocab_size=VOCAB,
        d_model=D_MODEL,
        num_heads=HEADS,
        d_kv=D_KV,
        d_ff=D_FF,
        num_encoder_layers=LAYERS,
        num_decoder_layers=LAYERS,
        num_experts=EXPERTS,
        num_encoder_sparse_layers=SPARSE,
        num_decoder_sparse_layers=SPARSE,
        logits_dense=not tied,
        eval_capacity_factor=float(EXPERTS),
        train_capacity_factor=float(EXPERTS),
        min_expert_capacity=1,
    )


def hf_to_t5x(model, config: SwitchConfig) -> dict:
    """Maps HF SwitchTransformers weights into the T5X tree in float32
    (``checkpoints.hf_names``)."""
    state = {k: v.detach().cpu().numpy().astype(np.float32) for k, v in model.state_dict().items()}
    return hf_names.hf_to_t5x(state, config)


def make_inputs(seed: int, padded: bool):
    rng = np.random.default_rng(seed)
    batch, enc_len, dec_len = 3, 24, 12
    encoder_tokens = rng.integers(2, VOCAB, (batch, enc_len)).astype(np.int32)
    targets = rng.integers(2, VOCAB, (batch, dec_len)).astype(np.int32)
    if padded:
        for row, (enc_keep, dec_keep) in enumerate([(24, 12), (17, 9), (5, 3)]):
            encoder_tokens[row, enc_keep:] = 0
            targets[row, dec_keep:] = 0
    decoder_inputs = np.concatenate([np.zeros((batch, 1), np.int32), targets[:, :-1]], axis=1)
    return encoder_tokens, decoder_inputs, targets


@pytest.fixture(autouse=True)
def flush_denormals():
    """Fast torch CPU math (denormals flushed to zero), restored after the test: the flag is
    process-wide and would otherwise change later tests' floating point."""
    torch.set_flush_denormal(True)
    yield
    torch.set_flush_denormal(False)


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("padded", [False, True], ids=["full", "padded"])
def test_logits_match_hugging_face(tied, padded):
    hf_model = build_hf(tied, seed=1 + tied)
    config = our_config(tied)
    params = hf_to_t5x(hf_model, config)
    model = SwitchTransformer(config)
    encoder_tokens, decoder_inputs, targets = make_inputs(seed=7, padded=padded)

    expected_tree = jax.eval_shape(
        lambda: model.init(jax.random.PRNGKey(0), encoder_tokens, decoder_inputs, targets)
    )["params"]
    assert jax.tree.structure(params) == jax.tree.structure(expected_tree)
    assert jax.tree.map(np.shape, params) == jax.tree.map(lambda s: s.shape, expected_tree)

    with torch.no_grad():
        hf = hf_model(
            input_ids=torch.from_numpy(encoder_tokens).long(),
            attention_mask=torch.from_numpy(encoder_tokens > 0).long(),
            decoder_input_ids=torch.from_numpy(decoder_inputs).long(),
            decoder_attention_mask=torch.from_numpy(targets > 0).long(),
        )
    hf_logits = hf.logits.numpy()
    hf_encoded = hf.encoder_last_hidden_state.numpy()
    ours = np.asarray(model.apply({"params": params}, encoder_tokens, decoder_inputs, targets))
    encoded = np.asarray(model.apply({"params": params}, encoder_tokens, method="encode"))

    valid = targets > 0
    assert np.abs(ours - hf_logits)[valid].max() <= TOLERANCE
    assert np.abs(encoded - hf_encoded)[encoder_tokens > 0].max() <= TOLERANCE
    # The comparison is not vacuous: logits vary across the vocabulary.
    assert np.abs(hf_logits[valid]).max() > 1.0


def first_come_kept(experts: np.ndarray, capacity: int) -> np.ndarray:
    """For each row of ``experts [rows, S]`` (chosen expert per token): whether fewer
    than ``capacity`` earlier tokens of the row chose the same expert."""
    chose = experts[..., None] == np.arange(EXPERTS)
    earlier = np.cumsum(chose, axis=1)[chose].reshape(experts.shape) - 1
    return earlier < capacity


@pytest.mark.skipif(
    int(transformers.__version__.split(".")[0]) < 5,
    reason="transformers 4.x passes over-capacity tokens through instead of zeroing them",
)
def test_capacity_drops_follow_each_rule():
    """With a small capacity each MoE layer zeroes the output of exactly the tokens its
    own rule drops (docs/t5x.md §6, §9): T5X gives an expert C slots per routing group,
    HF ``expert_capacity`` slots per sequence; tokens both keep get the same output."""
    batch, length, capacity = 3, 24, 2
    # T5X splits the N = 72 tokens row-major into G = 4 groups of S = 18 (the smallest
    # G >= E dividing N and divisible by E), so groups straddle sequences; CF 0.5 gives
    # C = round(0.5 * 18 / 4) = 2 slots per group, as many as HF gives per sequence.
    groups, per_group = 4, 18
    config = dataclasses.replace(
        our_config(tied=True), eval_capacity_factor=0.5, min_expert_capacity=1
    )
    hf_model = build_hf(tied=True, seed=3, expert_capacity=capacity)
    mlp_params = hf_to_t5x(hf_model, config)["encoder"]["layers_1"]["mlp"]
    x = np.random.default_rng(5).normal(size=(batch, length, D_MODEL)).astype(np.float32)

    ours = np.asarray(MoeLayer(config).apply({"params": mlp_params}, x))
    with torch.no_grad():
        theirs = hf_model.encoder.block[1].layer[1].mlp(torch.from_numpy(x)).numpy()

    experts = np.argmax(x @ mlp_params["router"]["router_weights"]["w"]["kernel"], axis=-1)
    t5x_kept = first_come_kept(experts.reshape(groups, per_group), capacity).reshape(batch, length)
    hf_kept = first_come_kept(experts, capacity)
    np.testing.assert_array_equal(np.any(ours != 0, axis=-1), t5x_kept)
    np.testing.assert_array_equal(np.any(theirs != 0, axis=-1), hf_kept)
    assert (t5x_kept != hf_kept).any()
    both = t5x_kept & hf_kept
    assert both.any()
    np.testing.assert_allclose(ours[both], theirs[both], atol=TOLERANCE)
