"""CallbackStates: what a worker takes of rank 0's Keras callbacks at a resize must make its
callbacks decide as rank 0's do from then on.

Keras's monitoring callbacks (ReduceLROnPlateau, EarlyStopping, ModelCheckpoint) choose their
comparison at their first epoch end and turn min_delta's sign with it; a joiner that took rank
0's turned min_delta and then ran that set-up itself turned it back, and counted a near-tie
(within min_delta) as an improvement where rank 0 lowered its learning rate."""
from __future__ import annotations

import importlib.util
import pickle

import numpy as np
import pytest

pytestmark = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("tensorflow", "keras")),
    reason="needs tensorflow and keras")


def _model():
    import keras

    model = keras.Sequential([keras.Input(shape=(2,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    return model


def _callbacks():
    import keras

    return [keras.callbacks.ReduceLROnPlateau(monitor="val_loss", factor=0.5, patience=1,
                                              min_delta=1e-3),
            keras.callbacks.EarlyStopping(monitor="val_loss", patience=1, min_delta=1e-3)]


def _worker():
    model, callbacks = _model(), _callbacks()
    for c in callbacks:
        c.set_model(model)
        c.on_train_begin()
    return model, callbacks


def _epoch_end(model, callbacks, epoch, val_loss):
    import keras

    model.stop_training = False
    for c in callbacks:
        c.on_epoch_end(epoch, {"val_loss": val_loss})
    lr = float(keras.ops.convert_to_numpy(model.optimizer.learning_rate))
    return lr, callbacks[0].best, callbacks[0].wait, callbacks[1].wait, model.stop_training


# Improvements, then values within min_delta of the best (no improvement), then a real one.
LOSSES = [1.0, 0.5, 0.4995, 0.4992, 0.3, 0.2995]


@pytest.mark.parametrize("joins_after", [0, 1, 2, 4])
def test_a_worker_that_takes_rank_zeros_states_decides_as_rank_zero(joins_after):
    from kungfu.tensorflow.callbacks import CallbackStates

    rank0 = _worker()
    for epoch in range(joins_after):
        _epoch_end(*rank0, epoch, LOSSES[epoch])
    sent = CallbackStates()
    sent.callbacks = rank0[1]
    joiner = _worker()
    taken = CallbackStates()
    taken.callbacks = joiner[1]
    taken.load(pickle.loads(pickle.dumps(sent.read())))  # as the resize sends it
    taken.apply()
    assert taken.pending is None
    # The rate is the optimizer's: the resize sends it with the other variables.
    joiner[0].optimizer.learning_rate = rank0[0].optimizer.learning_rate
    for epoch in range(joins_after, len(LOSSES)):
        mine, theirs = (_epoch_end(*w, epoch, LOSSES[epoch]) for w in (joiner, rank0))
        assert mine == theirs, (epoch, mine, theirs)
    # The near-ties were no improvement: the rate was lowered on both.
    assert _epoch_end(*rank0, 99, 0.2995)[0] < 0.1


def test_a_callback_whose_class_differs_at_its_place_is_left_alone():
    import keras

    from kungfu.tensorflow.callbacks import CallbackStates

    rank0 = _worker()
    _epoch_end(*rank0, 0, 1.0)
    sent = CallbackStates()
    sent.callbacks = rank0[1]
    other = keras.callbacks.EarlyStopping(monitor="val_loss", patience=7)
    taken = CallbackStates()
    taken.callbacks = [other, rank0[1][1]]
    taken.load(sent.read())
    taken.apply()
    assert other.patience == 7 and other.best is None
    assert np.isfinite(rank0[1][1].best)


def test_states_taken_at_an_epochs_last_step_are_in_effect_before_its_end():
    """A switch at the end of an epoch's last step gives the workers that stay rank 0's states
    as they were before the epoch end; they must not be set after it, over its decisions (a
    stale best: another learning rate later)."""
    import keras

    import kungfu as kf

    x = np.random.RandomState(0).rand(64, 2).astype(np.float32)
    y = x.sum(axis=1, keepdims=True)
    model = _model()
    hook = kf.Hook()
    plateau = keras.callbacks.ReduceLROnPlateau(monitor="loss", patience=1)
    own_after_step = hook.after_step

    def after_step(logs=None):
        own_after_step(logs)
        if hook.state.step_in_epoch == 4:  # 64 / 16: the epoch's last step, as at a switch
            hook.load_shared_state(hook.shared_state())

    hook.after_step = after_step
    bests = []
    look = keras.callbacks.LambdaCallback(on_epoch_begin=lambda e, logs: bests.append(plateau.best))
    history = model.fit(x, y, batch_size=16, epochs=3, callbacks=[hook, plateau, look], verbose=0)
    assert bests[1:] == [min(history.history["loss"][:e]) for e in (1, 2)], bests
