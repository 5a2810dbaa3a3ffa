"""Worker bodies for test_horovod_names.py: the Horovod names (DistributedGradientTape,
backward_passes_per_step, LearningRateScheduleCallback) and mixed precision under kf.Optimizer,
in real processes.

Each body runs several checks and returns raw values (arrays as lists, digests, error texts);
the tests judge them."""
from __future__ import annotations

import numpy as np

from _w_tf_optim import _digest, _mlp, _setup, _weights


def error_of(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test compares the kind and the message
        return [type(e).__name__, str(e)]
    return None


def _data(rank, rows, features=12, classes=5):
    rs = np.random.RandomState(100 + rank)
    return (rs.normal(size=(rows, features)).astype("float32"),
            rs.randint(0, classes, size=(rows,)).astype("int32"))


def tape_checks():
    kf, tf, keras = _setup()
    r, n = kf.rank(), kf.size()
    out = {}
    model = _mlp(keras, seed=1)
    x, y = _data(r, 16)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    variables = model.trainable_variables

    def loss():
        return loss_fn(y, model(x, training=True))

    with tf.GradientTape() as plain:
        value = loss()
    local = [g.numpy() for g in plain.gradient(value, variables)]
    out["expected"] = [(kf.allreduce(g) / n).tolist() for g in local]

    # Horovod's form: wrap the tape after recording.
    with tf.GradientTape() as t:
        value = loss()
    out["after"] = [g.numpy().tolist() for g in kf.DistributedGradientTape(t).gradient(
        value, variables)]

    # As a context manager, inside tf.function, with a dict of sources and an unused variable.
    extra = tf.Variable(1.0)

    @tf.function
    def traced():
        with kf.DistributedGradientTape(tf.GradientTape()) as tape:
            value = loss()
        return tape.gradient(value, {"kernel": variables[0], "unused": extra})

    got = traced()
    out["traced"] = got["kernel"].numpy().tolist()
    out["unused"] = got["unused"] is None

    # fp16 compression: close to the average.
    with tf.GradientTape() as t:
        value = loss()
    out["fp16"] = kf.DistributedGradientTape(t, compression=kf.Compression.fp16).gradient(
        value, variables)[0].numpy().tolist()

    # An embedding's IndexedSlices: gathered (sparse_as_dense=False) or summed dense: the same.
    emb = keras.layers.Embedding(30, 3)
    emb.build((None, 4))
    tokens = tf.constant(np.random.RandomState(r).randint(0, 30, size=(6, 4)).astype("int32"))
    results = {}
    for dense in (True, False):
        with tf.GradientTape() as t:
            value = tf.reduce_sum(emb(tokens) ** 2)
        tape = kf.DistributedGradientTape(t, sparse_as_dense=dense, op_prefix=f"emb/{dense}")
        g = tape.gradient(value, emb.embeddings)
        results[dense] = (type(g).__name__, tf.convert_to_tensor(g).numpy())
    out["sparse_kind"] = [results[True][0], results[False][0]]
    out["sparse_equal"] = bool(np.allclose(results[True][1], results[False][1], atol=1e-6))

    out["bad"] = [
        error_of(lambda: kf.DistributedGradientTape(tf.GradientTape(), compression="bf16")),
        error_of(lambda: kf.DistributedGradientTape("tape"))]

    # A custom loop with a plain optimizer: every worker ends with the same weights.
    opt = keras.optimizers.SGD(0.1)
    for step in range(3):
        with tf.GradientTape() as t:
            value = loss()
        tape = kf.DistributedGradientTape(t)
        opt.apply_gradients(zip(tape.gradient(value, variables), variables))
    out["digest"] = _digest(_weights(variables))
    return out


PASSES, BATCH = 3, 4


def accumulation_checks():
    kf, tf, keras = _setup()
    r = kf.rank()
    x, y = _data(r, PASSES * BATCH)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    out = {}

    def fit(batch, rows, lr=0.1, **options):
        model = _mlp(keras, seed=1)
        opt = kf.Optimizer(keras.optimizers.SGD(lr), **options)
        model.compile(opt, loss)
        model.fit(x[:rows], y[:rows], batch_size=batch, epochs=1, shuffle=False, verbose=0)
        return model, opt

    initial = _weights(_mlp(keras, seed=1).trainable_variables)
    model, opt = fit(BATCH, (PASSES - 1) * BATCH, backward_passes_per_step=PASSES)
    out["before_update"] = [bool(np.array_equal(a, b)) for a, b in
                            zip(initial, _weights(model.trainable_variables))]
    out["wait_before"] = opt.kungfu_allreduce_wait  # NaN: no allreduce yet
    model, opt = fit(BATCH, PASSES * BATCH, backward_passes_per_step=PASSES)
    accumulated = _weights(model.trainable_variables)
    out["iterations"] = int(opt.iterations.numpy())
    out["wait_after"] = opt.kungfu_allreduce_wait
    model, _ = fit(PASSES * BATCH, PASSES * BATCH)
    big = _weights(model.trainable_variables)
    out["moved"] = max(float(np.abs(a - b).max()) for a, b in zip(initial, big))
    out["diff"] = max(float(np.abs(a - b).max()) for a, b in zip(accumulated, big))
    # Horovod's sum of the passes: the step of the k*b batch at k times the learning rate.
    summed = _weights(fit(BATCH, PASSES * BATCH, backward_passes_per_step=PASSES,
                          average_aggregated_gradients=False)[0].trainable_variables)
    faster = _weights(fit(PASSES * BATCH, PASSES * BATCH, lr=0.1 * PASSES)[0].trainable_variables)
    out["summed diff"] = max(float(np.abs(a - b).max()) for a, b in zip(summed, faster))
    out["summed vs mean"] = max(float(np.abs(a - b).max()) for a, b in zip(summed, accumulated))
    out["digest"] = _digest(accumulated)
    # LearningRateScheduleCallback with momentum: the same rates and weights on every worker.
    model = _mlp(keras, seed=1)
    model.compile(kf.Optimizer(keras.optimizers.SGD(0.1, momentum=0.9)), loss)
    schedule = kf.LearningRateScheduleCallback(initial_lr=0.1, multiplier=0.5, start_epoch=1)
    model.fit(x, y, batch_size=BATCH, epochs=3, shuffle=False, verbose=0, callbacks=[schedule])
    out["schedule_lr"] = float(model.optimizer.learning_rate.numpy())
    out["schedule_digest"] = _digest(_weights(model.trainable_variables))
    out["bad"] = [error_of(lambda k=k: kf.Optimizer(keras.optimizers.SGD(0.1),
                                                    backward_passes_per_step=k))
                  for k in (0, -1, 1.5)]
    return out


def mixed_precision_checks(order):
    """Review 3's repro: rank 1's inputs x51 overflow first. order "compile": compile wraps
    kf.Optimizer(SGD) in LossScaleOptimizer; "inner": kf.Optimizer(LossScaleOptimizer(SGD));
    "sma": compile wraps kf.Optimizer(SGD, algorithm="sma")."""
    kf, tf, keras = _setup()
    keras.mixed_precision.set_global_policy("mixed_float16")
    r = kf.rank()
    rng = np.random.default_rng(r)
    x = rng.normal(size=(256, 8, 8, 1)).astype("float32") * (1 + 50 * r)
    y = rng.integers(0, 10, 256)
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Conv2D(8, 3, activation="relu"),
                              keras.layers.Flatten(), keras.layers.Dense(10, dtype="float32")])
    sgd = keras.optimizers.SGD(0.01)
    if order == "inner":
        opt = kf.Optimizer(keras.optimizers.LossScaleOptimizer(sgd))
    elif order == "sma":
        opt = kf.Optimizer(sgd, algorithm="sma")
    else:
        opt = kf.Optimizer(sgd)
    model.compile(opt, keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    lso = model.optimizer
    applied = []  # the optimizer's step count after every batch: a skipped step adds nothing

    class Record(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            applied.append(int(lso.iterations.numpy()))

    model.fit(x, y, batch_size=32, epochs=2, verbose=0, callbacks=[Record()])
    return {"wrapper": type(lso).__name__, "applied": applied,
            "scale": float(lso.dynamic_scale.numpy()),
            "digest": _digest(_weights(model.trainable_variables))}


def accumulation_disagreement():
    """Rank 0 accumulates 2 passes per step, rank 1 3: every worker fails, naming both."""
    import time

    kf, tf, keras = _setup()
    r = kf.rank()
    x, y = _data(r, 12 * BATCH)
    model = _mlp(keras, seed=1)
    model.compile(kf.Optimizer(keras.optimizers.SGD(0.1), backward_passes_per_step=2 + r),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    start = time.monotonic()
    try:
        model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
        return {"error": None, "digest": _digest(_weights(model.trainable_variables))}
    except Exception as e:  # noqa: BLE001 - the test reads the message
        return {"error": f"{type(e).__name__}: {e}", "seconds": time.monotonic() - start}
