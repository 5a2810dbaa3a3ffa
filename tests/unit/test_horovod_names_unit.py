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
    from kungfu.tensorflow.optimizers import _loss_scale

    assert _loss_scale.compatible()
    assert keras.__version__.startswith(_loss_scale.CHECKED_KERAS), keras.__version__
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
