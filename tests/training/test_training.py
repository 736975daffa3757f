import numpy as np
import optax
import pytest
from helpers.switch_fixtures import TINY, random_params

from qmoe_jax.models import SwitchTransformer
from qmoe_jax.training.pretrain import (
    TrainConfig,
    learning_rate_schedule,
    load_snapshot,
    make_optimizer,
    moe_aux_losses,
    save_snapshot,
    train,
    training_batches,
)


def chunks(count=20, length=30, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 150, length).astype(np.int32) for _ in range(count)]


def test_batches_are_a_function_of_the_step():
    a = training_batches(
        chunks(), first_sentinel=191, batch_size=4, encoder_length=32, decoder_length=16, seed=3
    )
    steps = [next(a) for _ in range(7)]
    b = training_batches(
        chunks(),
        first_sentinel=191,
        batch_size=4,
        encoder_length=32,
        decoder_length=16,
        seed=3,
        start_step=5,
    )
    for expected in steps[5:]:
        got = next(b)
        for key in expected:
            np.testing.assert_array_equal(expected[key], got[key])
    # A new epoch reshuffles and re-corrupts: step 0 and step 5 (= epoch 1, position 0) differ.
    assert not np.array_equal(steps[0]["encoder_input_tokens"], steps[5]["encoder_input_tokens"])


def test_schedule_warms_up_then_decays():
    config = TrainConfig(steps=100, warmup_steps=10, peak_learning_rate=1e-3)
    schedule = learning_rate_schedule(config)
    assert float(schedule(0)) == 0.0
    assert abs(float(schedule(10)) - 1e-3) < 1e-9
    assert float(schedule(100)) < float(schedule(50)) < float(schedule(10))


@pytest.mark.slow
def test_training_lowers_the_loss_and_resumes(tmp_path):
    config = TrainConfig(
        steps=6, warmup_steps=1, eval_every=3, snapshot_every=3, peak_learning_rate=3e-3
    )
    model = SwitchTransformer(TINY)
    data = chunks(40)
    evals = [next(training_batches(data, 191, 8, 32, 16, seed=9))]
    snapshot = str(tmp_path / "snapshot")
    params, history = train(
        model,
        random_params(TINY),
        data,
        evals,
        191,
        32,
        16,
        config,
        moe_aux_losses,
        snapshot,
        log=lambda _: None,
    )
    assert [record["step"] for record in history] == [3, 6]
    assert history[-1]["validation_loss"] < history[0]["validation_loss"] - 0.1
    assert all(np.isfinite(record["cross_entropy"]) for record in history)
    step, restored, _, restored_history = load_snapshot(
        snapshot, params, make_optimizer(config).init(params)
    )
    assert step == 6 and restored_history == history
    # Re-running with the same snapshot resumes at the end: nothing left to do.
    again, again_history = train(
        model,
        random_params(TINY, seed=1),
        data,
        evals,
        191,
        32,
        16,
        config,
        moe_aux_losses,
        snapshot,
        log=lambda _: None,
    )
    assert again_history == history
    np.testing.assert_array_equal(
        np.asarray(again["token_embedder"]["embedding"]),
        np.asarray(restored["token_embedder"]["embedding"]),
    )


def test_snapshot_round_trip(tmp_path):
    params = random_params(TINY)
    opt_state = optax.adam(1e-3).init(params)
    save_snapshot(str(tmp_path / "s"), 42, params, opt_state, [{"step": 42}])
    step, restored, _, history = load_snapshot(str(tmp_path / "s"), params, opt_state)
    assert step == 42 and history == [{"step": 42}]
    np.testing.assert_array_equal(
        np.asarray(restored["encoder"]["encoder_norm"]["scale"]),
        np.asarray(params["encoder"]["encoder_norm"]["scale"]),
    )
