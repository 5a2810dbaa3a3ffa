"""The Horovod names without peers (a process alone is a cluster of size 1): the adapter of
Keras's LossScaleOptimizer, LearningRateScheduleCallback, and -builtin-config-port auto."""
from __future__ import annotations

import importlib.util

import numpy as np
import pytest

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(importlib.util.find_spec("tensorflow") is None,
                       reason="TensorFlow is not installed"),
]


@pytest.fixture(scope="module")
def tfk():
    import keras
    import tensorflow as tf

    import kungfu as kf

    return kf, tf, keras


def test_loss_scale_adapter_matches_this_keras(tfk):
    """Fails when Keras's LossScaleOptimizer changes under kungfu's adapter."""
    kf, tf, keras = tfk
    from kungfu.tensorflow import _internals

    assert _internals.loss_scale_compatible()
    assert keras.__version__.startswith(_internals.CHECKED["keras"]), keras.__version__
    kf.Optimizer(keras.optimizers.SGD(0.1))
    assert keras.optimizers.LossScaleOptimizer._common_apply.kungfu_agreed is True


def test_loss_scale_around_kungfu_skips_and_applies(tfk):
    """LossScaleOptimizer(kf.Optimizer(SGD)) through the adapter: a non-finite gradient skips
    the step and halves the scale; a finite one is unscaled and applied once."""
    kf, tf, keras = tfk
    w = tf.Variable([1.0, 2.0])
    lso = keras.optimizers.LossScaleOptimizer(kf.Optimizer(keras.optimizers.SGD(0.5)),
                                              initial_scale=4.0)
    lso.apply([tf.constant([np.inf, 1.0])], [w])
    assert w.numpy().tolist() == [1.0, 2.0]
    assert float(lso.dynamic_scale.numpy()) == 2.0 and int(lso.iterations.numpy()) == 0
    lso.apply([tf.constant([2.0, 4.0])], [w])  # unscaled: [1, 2]
    np.testing.assert_allclose(w.numpy(), [0.5, 1.0])
    assert int(lso.iterations.numpy()) == 1
    # Traced, as model.fit runs it.
    tf.function(lambda g: lso.apply([g], [w]))(tf.constant([np.nan, 0.0]))
    np.testing.assert_allclose(w.numpy(), [0.5, 1.0])
    assert float(lso.dynamic_scale.numpy()) == 1.0


def _fit_recording(tfk, callback, epochs=4, steps=4, momentum=0.0):
    """The learning rate each batch trained at, [[per batch] per epoch], under model.fit."""
    kf, tf, keras = tfk
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(kf.Optimizer(keras.optimizers.SGD(0.3, momentum=momentum)), "mse")
    seen = []

    class Record(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            seen.append([])

        def on_train_batch_begin(self, batch, logs=None):
            seen[-1].append(float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate)))

    x = np.ones((steps * 2, 3), "float32")
    model.fit(x, np.zeros((steps * 2, 1), "float32"), batch_size=2, epochs=epochs, verbose=0,
              callbacks=[callback, Record()])
    return seen


def test_schedule_constant_multiplier_decays_by_epoch(tfk):
    kf, tf, keras = tfk
    cb = kf.LearningRateScheduleCallback(initial_lr=0.1, multiplier=0.5, start_epoch=1,
                                         end_epoch=3)
    seen = _fit_recording(tfk, cb)
    # Epoch 0 is outside the range (the optimizer's own 0.3); 1 and 2 decay; 3 keeps the last.
    expected = [0.3, 0.1, 0.05, 0.05]
    for epoch, rates in zip(expected, seen):
        np.testing.assert_allclose(rates, [epoch] * 4, rtol=1e-6)


def test_schedule_function_per_batch(tfk):
    kf, tf, keras = tfk
    cb = kf.LearningRateScheduleCallback(initial_lr=0.1, multiplier=lambda e: 1.0 / (1.0 + e),
                                         staircase=False)
    seen = _fit_recording(tfk, cb, epochs=2)
    for epoch, rates in enumerate(seen):
        np.testing.assert_allclose(rates, [0.1 / (1.0 + epoch + b / 4) for b in range(4)],
                                   rtol=1e-6)


def test_schedule_momentum_correction(tfk):
    """A change of rate from lr to lr' scales SGD's momentum buffers by lr'/lr (once)."""
    kf, tf, keras = tfk
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    opt = keras.optimizers.SGD(0.4, momentum=0.9)
    model.compile(opt, "mse")
    opt.build(model.trainable_variables)
    for m in opt.momentums:
        m.assign(np.ones(m.shape, "float32"))
    cb = kf.LearningRateScheduleCallback(initial_lr=0.4, multiplier=0.25)
    cb.set_model(model)
    cb.on_epoch_begin(0)  # 0.4 * 0.25 ** 0: no change
    cb.on_epoch_begin(1)  # 0.1: momentum * 0.25
    assert all(np.allclose(m.numpy(), 0.25) for m in opt.momentums)
    off = kf.LearningRateScheduleCallback(initial_lr=0.4, multiplier=0.5,
                                          momentum_correction=False)
    off.set_model(model)
    off.on_epoch_begin(2)
    assert all(np.allclose(m.numpy(), 0.25) for m in opt.momentums)
    np.testing.assert_allclose(float(opt.learning_rate.numpy()), 0.1)


@pytest.mark.parametrize("kwargs, error", [
    (dict(initial_lr=0.1, multiplier="0.5"), "multiplier must be a number or a function"),
    (dict(initial_lr=0.1, multiplier=0.5, start_epoch=-1), "start_epoch must be an integer"),
    (dict(initial_lr=0.1, multiplier=0.5, start_epoch=3, end_epoch=3), "end_epoch (3) must be"),
    (dict(initial_lr=0.1, multiplier=0.5, steps_per_epoch=0), "steps_per_epoch must be"),
])
def test_schedule_bad_arguments(tfk, kwargs, error):
    kf, tf, keras = tfk
    with pytest.raises((TypeError, ValueError)) as e:
        kf.LearningRateScheduleCallback(**kwargs)
    assert error in str(e.value)


def test_builtin_config_port_auto():
    from kungfu._launch import flags

    opts = flags.parse_args(["-w", "-np", "2", "-builtin-config-port", "auto", "prog"])
    assert opts.builtin_config_port == 0  # the store binds port 0: the system picks one
    assert flags.parse_args(["-w", "-builtin-config-port", "9100", "prog"]).builtin_config_port \
        == 9100
    assert "auto: a port the system gives" in flags.help_text()
    with pytest.raises(flags.UsageError, match="must be a port number or auto, got 'any'"):
        flags.parse_args(["-w", "-builtin-config-port", "any", "prog"])


def test_distributed_tape_alone_and_copied(tfk):
    """At size 1 the average is the gradient; the wrapper copies (no recursion before __init__
    set its tape) and passes the tape's own API through."""
    import copy

    kf, tf, keras = tfk
    v = tf.Variable(3.0)
    tape = kf.DistributedGradientTape(tf.GradientTape(persistent=True))
    with tape:
        y = v * v
    assert float(tape.gradient(y, v)) == 6.0
    assert float(copy.copy(tape).gradient(y, [v])[0]) == 6.0
    assert tape.watched_variables() == (v,)


def test_compile_under_mixed_float16_still_turns_xla_off_for_the_wrapped_optimizer():
    """compile wraps kf.Optimizer in a LossScaleOptimizer: model.fit's preparation looks through it
    (XLA off, as for kf.Optimizer itself; XLA would fail on kungfu's collectives)."""
    import warnings

    import keras

    import kungfu as kf

    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2, dtype="float32")])
        model.compile(kf.Optimizer(keras.optimizers.SGD(0.1)), "mse", jit_compile=True)
        x, y = np.ones((16, 4), np.float32), np.zeros((16, 2), np.float32)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model.fit(x, y, batch_size=8, epochs=1, verbose=0,
                      callbacks=[kf.BroadcastGlobalVariablesCallback()])
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert type(model.optimizer).__name__ == "LossScaleOptimizer"
    assert model.jit_compile is False
    assert any("training without XLA" in str(w.message) for w in caught)


def test_compression_objects_compress_and_decompress(tfk):
    """Horovod's Compression.fp16.compress/decompress, in TensorFlow and PyTorch: floating
    point goes to float16 and comes back in its dtype, other dtypes pass as they are."""
    kf, tf, _ = tfk
    from kungfu.tensorflow.optimizers import Compression

    assert Compression.fp16 == "fp16" and Compression.none == "none"
    for dtype in (tf.float32, tf.float64):
        small, ctx = Compression.fp16.compress(tf.fill([5, 5], tf.constant(1.5, dtype)))
        assert small.dtype == tf.float16
        back = Compression.fp16.decompress(small, ctx)
        assert back.dtype == dtype and np.all(back.numpy() == 1.5)
    for dtype in (tf.int32, tf.uint8):
        same, ctx = Compression.fp16.compress(tf.ones([3], dtype))
        assert same.dtype == dtype and Compression.fp16.decompress(same, ctx).dtype == dtype
    t, ctx = Compression.none.compress(tf.ones([2]))
    assert Compression.none.decompress(t, ctx).dtype == tf.float32
    torch = pytest.importorskip("torch")
    from kungfu.torch.optimizers import Compression as TorchCompression

    for dtype in (torch.float32, torch.float64):
        small, ctx = TorchCompression.fp16.compress(torch.full((5, 5), 1.5, dtype=dtype))
        assert small.dtype == torch.float16
        back = TorchCompression.fp16.decompress(small, ctx)
        assert back.dtype == dtype and torch.all(back == 1.5)
    for dtype in (torch.int64, torch.int8):
        same, ctx = TorchCompression.fp16.compress(torch.ones(3, dtype=dtype))
        assert same.dtype == dtype and TorchCompression.fp16.decompress(same, ctx).dtype == dtype
    assert TorchCompression.none.compress(torch.ones(2))[1] is None
