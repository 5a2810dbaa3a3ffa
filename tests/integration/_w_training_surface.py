"""Worker bodies for test_training_surface.py: SyncBatchNormalization, fp16 compression and
sparse gradients in real workers. Bodies return raw values; the tests judge them."""
from __future__ import annotations

import numpy as np


def bn_input(r: int) -> np.ndarray:
    """Worker r's batch: 6 rows of 3 channels, a different scale and offset per worker."""
    return (np.random.default_rng(r).normal(size=(6, 3)) * (r + 1) + 3 * r).astype(np.float32)


def _setup():
    import keras
    import tensorflow as tf

    import kungfu as kf

    keras.utils.set_random_seed(7)
    return kf, tf, keras


def sync_batch_norm() -> dict:
    kf, tf, keras = _setup()
    r = kf.rank()
    layer = kf.SyncBatchNormalization(momentum=0.5, epsilon=1e-3)
    x = tf.constant(bn_input(r))
    y = layer(x, training=True)
    out = {"y": y.numpy().tolist(), "moving_mean": layer.moving_mean.numpy().tolist(),
           "moving_variance": layer.moving_variance.numpy().tolist(),
           "inference": layer(x, training=False).numpy().tolist()}
    # In a model trained with model.fit and kf.Optimizer: every worker ends with equal weights.
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4),
                              kf.SyncBatchNormalization(), keras.layers.Dense(1)])
    model.compile(optimizer=kf.Optimizer(keras.optimizers.SGD(0.05)), loss="mse",
                  jit_compile=False)
    data = bn_input(r + 10)
    model.fit(data, data[:, :1], batch_size=3, epochs=2, verbose=0, shuffle=False,
              callbacks=[kf.BroadcastGlobalVariablesCallback()])
    out["fit_weights"] = [w.tolist() for w in model.get_weights()]
    return out


def _grads_model(keras, kf, **options):
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="tanh"),
                              keras.layers.Dense(1)])
    model.compile(optimizer=kf.Optimizer(keras.optimizers.SGD(0.1), **options), loss="mse",
                  jit_compile=False)
    return model


def compression() -> dict:
    kf, tf, keras = _setup()
    r = kf.rank()
    rng = np.random.default_rng(100 + r)
    x = rng.normal(size=(16, 8)).astype(np.float32)
    y = rng.normal(size=(16, 1)).astype(np.float32)
    out = {}
    for label, options in (("none", {}), ("fp16", {"compression": "fp16"}),
                           ("hvd-name", {"compression": kf.Compression.fp16})):
        model = _grads_model(keras, kf, op_prefix=f"cmp/{label}", **options)
        before = [w.copy() for w in model.get_weights()]
        model.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False)
        out[label] = [(w - b).tolist() for w, b in zip(model.get_weights(), before)]
    try:
        kf.Optimizer(keras.optimizers.SGD(0.1), compression="int8")
        out["bad"] = None
    except ValueError as e:
        out["bad"] = str(e)
    return out


def sparse_gradients() -> dict:
    """An Embedding trained one step with sparse_as_dense True and False: the same weights."""
    kf, tf, keras = _setup()
    r = kf.rank()
    ids = np.array([[r, 5], [r + 1, 5], [9, r]], np.int32)  # rows shared and rows of one worker
    target = np.full((3, 1), float(r), np.float32)
    out = {}
    for sparse in (False, True):
        keras.utils.set_random_seed(5)
        model = keras.Sequential([keras.Input((2,), dtype="int32"),
                                  keras.layers.Embedding(12, 4), keras.layers.Flatten(),
                                  keras.layers.Dense(1)])
        model.compile(optimizer=kf.Optimizer(keras.optimizers.SGD(0.5),
                                             sparse_as_dense=not sparse,
                                             op_prefix=f"sparse/{sparse}"),
                      loss="mse", jit_compile=False)
        model.fit(ids, target, batch_size=3, epochs=2, verbose=0, shuffle=False)
        out["sparse" if sparse else "dense"] = [w.tolist() for w in model.get_weights()]
    return out
