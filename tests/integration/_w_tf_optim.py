"""Worker bodies for test_tf_optimizers.py: distributed Keras optimizers in real processes.

TensorFlow takes seconds to import, so each body runs many checks and returns raw results
(digests, weights, accuracies, error texts); the tests judge them. Workers deliberately start from
different random weights (seeded by rank): equal weights at the end need the broadcast and the
distributed optimizer to work.
"""
from __future__ import annotations

import copy
import hashlib
import os
import time
import warnings

import numpy as np

LR = 0.05
BATCH = 8  # per worker
STEPS = 5


def _setup():
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    warnings.filterwarnings("ignore")
    import tensorflow as tf

    # Up to three TensorFlow processes share two cores here.
    try:
        tf.config.threading.set_intra_op_parallelism_threads(1)
        tf.config.threading.set_inter_op_parallelism_threads(2)
    except RuntimeError:  # the runtime is already initialised
        pass
    import keras

    import kungfu as kf

    keras.utils.disable_interactive_logging()
    return kf, tf, keras


def _digest(arrays) -> str:
    h = hashlib.sha256()
    for a in arrays:
        a = np.asarray(a)
        h.update(str((a.dtype.str, a.shape)).encode())
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def _weights(variables):
    return [np.array(v.numpy()) for v in variables]


def _consensus(kf, arrays) -> bool:
    """True on every worker iff every worker holds bit-identical arrays."""
    return bool(kf.consensus(_digest(arrays)))


def _mlp(keras, seed, features=12, hidden=16, classes=5):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((features,)),
        keras.layers.Dense(hidden, activation="tanh"),
        keras.layers.Dense(classes),
    ])


def _embedding_model(keras, seed, vocab=40, length=5, classes=4):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((length,), dtype="int32"),
        keras.layers.Embedding(vocab, 4),
        keras.layers.Flatten(),
        keras.layers.Dense(classes),
    ])


def _global_data(n, features=12, classes=5, seed=7):
    """STEPS global batches of n * BATCH rows (the same on every worker)."""
    rs = np.random.RandomState(seed)
    x = rs.normal(size=(STEPS * n * BATCH, features)).astype("float32")
    y = rs.randint(0, classes, size=(STEPS * n * BATCH,)).astype("int32")
    return x, y


def _global_tokens(n, vocab=40, length=5, classes=4, seed=11):
    rs = np.random.RandomState(seed)
    # Few distinct tokens per batch: embedding gradients touch few rows (IndexedSlices).
    x = rs.randint(0, vocab, size=(STEPS * n * BATCH, length)).astype("int32")
    y = rs.randint(0, classes, size=(STEPS * n * BATCH,)).astype("int32")
    return x, y


def _shard(a, rank, n):
    """Rank's BATCH rows of every global batch, in step order."""
    steps = len(a) // (n * BATCH)
    return np.concatenate([a[(s * n + rank) * BATCH:(s * n + rank + 1) * BATCH]
                           for s in range(steps)])


def _loss_fn(keras):
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _custom_loop(kf, tf, keras, model, opt, x, y, batch, compiled, extra=None):
    """STEPS steps of a GradientTape loop; `extra` is a variable the loss does not use (its
    gradient is None)."""
    loss_fn = _loss_fn(keras)
    variables = list(model.trainable_variables) + ([extra] if extra is not None else [])

    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb, training=True))
        grads = tape.gradient(loss, variables)
        opt.apply_gradients(zip(grads, variables))
        return loss

    if compiled:
        step = tf.function(step)
    for s in range(len(x) // batch):
        step(tf.constant(x[s * batch:(s + 1) * batch]), tf.constant(y[s * batch:(s + 1) * batch]))


def sync_sgd_checks():
    """Synchronous SGD through model.fit, a tf.function loop and an eager loop, plus the Adam
    state broadcast. Reference runs (plain optimizer on the union of the shards with the summed
    batch) happen on rank 0."""
    kf, tf, keras = _setup()
    rank, n = kf.rank(), kf.size()
    out = {"rank": rank, "size": n}
    t0 = time.perf_counter()

    # -- model.fit ------------------------------------------------------------------------
    x, y = _global_data(n)
    model = _mlp(keras, seed=100 + rank)
    out["fit_initial_digest"] = _digest(_weights(model.weights))
    opt = kf.Optimizer(keras.optimizers.SGD(LR))
    model.compile(optimizer=opt, loss=_loss_fn(keras))
    initial = {}

    class Record(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            if batch == 0:
                initial["w"] = _weights(self.model.weights)

    model.fit(_shard(x, rank, n), _shard(y, rank, n), batch_size=BATCH, epochs=1,
              shuffle=False, verbose=0,
              callbacks=[kf.BroadcastGlobalVariablesCallback(), Record()])
    final = _weights(model.weights)
    out["fit_after_broadcast_digest"] = _digest(initial["w"])
    out["fit_digest"] = _digest(final)
    out["fit_consensus"] = _consensus(kf, final)
    out["fit_iterations"] = int(opt.iterations.numpy())
    if rank == 0:
        ref = _mlp(keras, seed=1)
        ref.set_weights(initial["w"])
        ref.compile(optimizer=keras.optimizers.SGD(LR), loss=_loss_fn(keras))
        ref.fit(x, y, batch_size=n * BATCH, epochs=1, shuffle=False, verbose=0)
        out["fit_max_diff"] = max(float(np.max(np.abs(a - b)))
                                  for a, b in zip(final, _weights(ref.weights)))
        out["fit_moved"] = max(float(np.max(np.abs(a - b))) for a, b in zip(final, initial["w"]))

    # -- custom loops (embedding: IndexedSlices gradients; an unused variable: None) -------
    tx, ty = _global_tokens(n)
    for mode in ("graph", "eager"):
        compiled = mode == "graph"
        model = _embedding_model(keras, seed=200 + rank)
        unused = tf.Variable(tf.fill([3], float(rank)), name="unused")
        kf.broadcast_variables(model.weights + [unused], root=0)
        start = _weights(model.weights)
        opt = kf.Optimizer(keras.optimizers.SGD(LR))
        _custom_loop(kf, tf, keras, model, opt, _shard(tx, rank, n), _shard(ty, rank, n), BATCH,
                     compiled, extra=unused)
        final = _weights(model.weights)
        out[f"{mode}_start_digest"] = _digest(start)
        out[f"{mode}_digest"] = _digest(final)
        out[f"{mode}_consensus"] = _consensus(kf, final)
        out[f"{mode}_unused"] = unused.numpy().tolist()
        out[f"{mode}_iterations"] = int(opt.iterations.numpy())
        if rank == 0:
            ref = _embedding_model(keras, seed=1)
            ref.set_weights(start)
            _custom_loop(kf, tf, keras, ref, keras.optimizers.SGD(LR), tx, ty, n * BATCH,
                         compiled)
            out[f"{mode}_max_diff"] = max(float(np.max(np.abs(a - b)))
                                          for a, b in zip(final, _weights(ref.weights)))
            out[f"{mode}_moved"] = max(float(np.max(np.abs(a - b)))
                                       for a, b in zip(final, start))

    # -- Adam: the callback broadcasts slots and the iteration counter ---------------------
    model = _mlp(keras, seed=300 + rank)
    opt = kf.Optimizer(keras.optimizers.Adam(1e-2))
    model.compile(optimizer=opt, loss=_loss_fn(keras))
    opt.build(model.trainable_variables)
    # Give every worker its own optimizer state: rank + 2 local (not distributed) updates with
    # rank-specific gradients, through the wrapped class's own apply.
    rs = np.random.RandomState(rank)
    base_apply = keras.optimizers.Adam.apply
    for _ in range(rank + 2):
        grads = [tf.constant(rs.normal(size=v.shape).astype("float32"))
                 for v in model.trainable_variables]
        base_apply(opt, grads, model.trainable_variables)
    out["adam_before_digest"] = _digest(_weights(opt.variables))
    out["adam_before_iterations"] = int(opt.iterations.numpy())
    out["adam_slot_count"] = len(opt.variables)
    seen = {}

    class RecordAdam(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            if batch == 0:
                seen["opt"] = _weights(opt.variables)
                seen["model"] = _weights(self.model.weights)

    x1, y1 = x[: n * BATCH], y[: n * BATCH]
    model.fit(_shard(x1, rank, n), _shard(y1, rank, n), batch_size=BATCH, epochs=1,
              shuffle=False, verbose=0,
              callbacks=[kf.BroadcastGlobalVariablesCallback(root=0), RecordAdam()])
    out["adam_at_start_digest"] = _digest(seen["opt"])
    out["adam_model_at_start_digest"] = _digest(seen["model"])
    after = _weights(opt.variables)
    out["adam_after_digest"] = _digest(after)
    out["adam_after_consensus"] = _consensus(kf, after + _weights(model.weights))
    out["adam_after_iterations"] = int(opt.iterations.numpy())
    # -- op="adasum": one step of known gradients in a tf.function; model.fit ---------------
    from _w_adasum import tf_grads_of
    consts = [tf.constant(g) for g in tf_grads_of(rank)]
    variables = [tf.Variable(tf.zeros_like(g)) for g in consts]
    opt = kf.Optimizer(keras.optimizers.SGD(1.0), op="adasum")

    @tf.function
    def adasum_step():
        with tf.GradientTape() as tape:
            loss = sum(tf.reduce_sum(v * g) for v, g in zip(variables, consts))
        opt.apply(tape.gradient(loss, variables), variables)

    adasum_step()
    out["adasum_step"] = [-v.numpy() for v in variables]  # the Adasum of the gradients (lr 1)
    model = _mlp(keras, seed=400 + rank)
    model.compile(optimizer=kf.Optimizer(keras.optimizers.SGD(LR), op="adasum"),
                  loss=_loss_fn(keras))
    model.fit(_shard(x, rank, n), _shard(y, rank, n), batch_size=BATCH, epochs=1,
              shuffle=False, verbose=0, callbacks=[kf.BroadcastGlobalVariablesCallback()])
    out["adasum_fit_consensus"] = _consensus(kf, _weights(model.weights))
    out["seconds"] = time.perf_counter() - t0
    return out


def _digits(rank, n):
    from sklearn.datasets import load_digits

    d = load_digits()
    x = (d.data / 16.0).astype("float32")
    y = d.target.astype("int32")
    rs = np.random.RandomState(0)
    order = rs.permutation(len(x))
    x, y = x[order], y[order]
    train, test = (x[:1500], y[:1500]), (x[1500:], y[1500:])
    return (train[0][rank::n], train[1][rank::n]), test


def averaging_checks(epochs=8):
    """SMA and pair averaging train the digits MLP (and, for comparison, workers that never
    average); returns accuracies and the spread of the workers' models."""
    kf, tf, keras = _setup()
    rank, n = kf.rank(), kf.size()
    (x, y), (tx, ty) = _digits(rank, n)
    out = {"rank": rank, "size": n}
    for algorithm in ("local", "sma", "pair-averaging"):
        t0 = time.perf_counter()
        keras.utils.set_random_seed(500 + rank)
        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation="relu"),
                                  keras.layers.Dense(10)])
        opt = keras.optimizers.SGD(0.1, momentum=0.9)
        if algorithm != "local":  # local: no averaging at all, for comparison
            opt = kf.Optimizer(opt, algorithm=algorithm)
        model.compile(optimizer=opt, loss=_loss_fn(keras), metrics=["accuracy"])
        model.fit(x, y, batch_size=32, epochs=epochs, shuffle=False, verbose=0,
                  callbacks=[kf.BroadcastGlobalVariablesCallback()])
        acc = float(np.mean(np.argmax(model.predict(tx, verbose=0), -1) == ty))
        flat = np.concatenate([w.ravel() for w in _weights(model.trainable_weights)])
        everyone = kf.allgather(flat[None, :].astype(np.float64))
        mean = everyone.mean(axis=0)
        spread = float(np.max(np.linalg.norm(everyone - mean, axis=1)) / np.linalg.norm(mean))
        out[algorithm] = {"accuracy": acc, "spread": spread,
                          "iterations": int(opt.iterations.numpy()),
                          "seconds": time.perf_counter() - t0}
    return out


def single_worker_checks():
    """np=1: every algorithm equals the plain optimizer; bad input; get_config round trip;
    the lazy names of the top-level package."""
    import sys

    import kungfu as kf_plain

    out = {"tf_before": "tensorflow" in sys.modules}
    lazy = kf_plain.Optimizer  # imports kungfu.tensorflow (and TensorFlow) on first access
    out["tf_after_import"] = "kungfu.tensorflow" in sys.modules
    kf, tf, keras = _setup()
    from kungfu.tensorflow import optimizers as kopt

    out["lazy"] = (lazy is kopt.Optimizer,
                   kf_plain.BroadcastGlobalVariablesCallback.__module__,
                   kf_plain.broadcast_variables.__module__)

    # Every algorithm at size 1 equals the plain optimizer (bit for bit).
    x, y = _global_data(1)
    results = {}
    for algorithm in (None, "sync-sgd", "sma", "pair-averaging"):
        model = _mlp(keras, seed=3)
        base = keras.optimizers.Adam(1e-2)
        opt = base if algorithm is None else kf.Optimizer(base, algorithm=algorithm)
        model.compile(optimizer=opt, loss=_loss_fn(keras))
        model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
        results[algorithm or "plain"] = _digest(_weights(model.weights) + _weights(opt.variables))
    out["size1_digests"] = results
    # Loss scaling and gradient accumulation of the wrapped optimizer keep working.
    more = {}
    for key, make in (("loss_scale", lambda: keras.optimizers.LossScaleOptimizer(
            keras.optimizers.SGD(0.1))),
                      ("accumulate", lambda: keras.optimizers.SGD(
                          0.1, gradient_accumulation_steps=2))):
        for wrap in (False, True):
            model = _mlp(keras, seed=3)
            opt = kf.Optimizer(make()) if wrap else make()
            model.compile(optimizer=opt, loss=_loss_fn(keras))
            model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
            more[(key, wrap)] = _digest(_weights(model.weights))
    out["size1_more"] = more

    # Pair averaging's choice of peer: never itself, uniform over the others.
    from kungfu.tensorflow.optimizers._core import choose_peer

    pick = tf.function(choose_peer)
    out["peer_counts"] = {
        (r, size): np.bincount([int(pick(tf.constant(s, tf.int64), tf.constant(r),
                                         tf.constant(size))) for s in range(1200)],
                               minlength=size).tolist()
        for r, size in ((0, 4), (2, 4), (3, 4), (1, 2))}

    # Bad input.
    errors = {}

    def expect(key, fn):
        try:
            fn()
            errors[key] = None
        except Exception as e:  # noqa: BLE001 - the test judges type and message
            errors[key] = (type(e).__name__, str(e))

    sgd = keras.optimizers.SGD(0.1)
    expect("string", lambda: kf.Optimizer("sgd"))
    expect("none", lambda: kf.Optimizer(None))
    expect("op", lambda: kf.Optimizer(keras.optimizers.SGD(0.1), op="sum"))
    expect("adasum_monitor", lambda: kf.Optimizer(keras.optimizers.SGD(0.1), op="adasum",
                                                  monitor="variance"))
    expect("tf_module", lambda: kf.Optimizer(tf.keras))
    expect("algorithm", lambda: kf.Optimizer(sgd, algorithm="nope"))
    expect("algorithm_type", lambda: kf.Optimizer(sgd, algorithm=3))
    expect("option", lambda: kf.Optimizer(sgd, algorithm="sync-sgd", alpha=0.5))
    expect("alpha", lambda: kf.Optimizer(sgd, algorithm="sma", alpha=1.5))
    expect("twice", lambda: kf.Optimizer(kf.Optimizer(sgd)))
    expect("root", lambda: kf.broadcast_variables([tf.Variable(1.0)], root=1))
    expect("not_variable", lambda: kf.broadcast_variables([tf.constant(1.0)]))
    expect("nccl", lambda: kopt.SynchronousSGDOptimizer(sgd, nccl=True))
    out["errors"] = errors

    # XLA: a clear error; the callback switches a model compiled for XLA back to plain graphs.
    model = _mlp(keras, seed=5)
    model.compile(kf.Optimizer(keras.optimizers.SGD(0.1)), _loss_fn(keras), jit_compile=True)
    expect("xla", lambda: model.fit(x, y, batch_size=BATCH, verbose=0))
    expect("xla_callback", lambda: model.fit(x, y, batch_size=BATCH, verbose=0,
                                             callbacks=[kf.BroadcastGlobalVariablesCallback()]))
    out["xla_after_callback"] = model.jit_compile
    model = _mlp(keras, seed=5)  # kf.Hook alone does the same
    model.compile(kf.Optimizer(keras.optimizers.SGD(0.1)), _loss_fn(keras), jit_compile=True)
    expect("xla_hook", lambda: model.fit(x, y, batch_size=BATCH, verbose=0,
                                         callbacks=[kf.Hook()]))
    out["xla_after_hook"] = model.jit_compile

    # get_config / serialization round trip.
    configs = {}
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.5)
    originals = {
        "sgd": keras.optimizers.SGD(0.05, momentum=0.9, nesterov=True, name="my_sgd"),
        "adam": keras.optimizers.Adam(learning_rate=schedule, beta_1=0.8, clipnorm=1.0),
        "adamw": keras.optimizers.AdamW(3e-4, weight_decay=0.01),
        "rmsprop": keras.optimizers.RMSprop(1e-3, rho=0.8),
    }
    for key, original in originals.items():
        for algorithm in ("sync-sgd", "sma", "pair-averaging"):
            wrapped = kf.Optimizer(original, algorithm=algorithm)
            ser = keras.optimizers.serialize(wrapped)
            back = keras.optimizers.deserialize(copy.deepcopy(ser))  # it edits its input
            rewrapped = kf.Optimizer(type(original).from_config(wrapped.get_config()),
                                     algorithm=algorithm)
            configs[f"{key}/{algorithm}"] = {
                "same_config": wrapped.get_config() == original.get_config(),
                "same_serialized": ser == keras.optimizers.serialize(original),
                "deserialized_type": type(back).__name__,
                "deserialized_plain": not isinstance(back, kf.Optimizer),
                "deserialized_config": back.get_config() == original.get_config(),
                "rewrapped_config": rewrapped.get_config() == original.get_config(),
                "isinstance": (isinstance(wrapped, type(original)),
                               isinstance(wrapped, keras.optimizers.Optimizer),
                               isinstance(wrapped, kf.Optimizer)),
                "algorithm": wrapped.kungfu_algorithm,
            }
    out["configs"] = configs
    sma = kopt.SynchronousAveragingOptimizer(keras.optimizers.SGD(0.1), alpha=0.25)
    pair = kopt.PairAveragingOptimizer(keras.optimizers.SGD(0.1), fused_model_name="mine")
    ssgd = kopt.SynchronousSGDOptimizer(keras.optimizers.SGD(0.1))
    out["compat"] = (sma.kungfu_algorithm, sma.kungfu_options()["alpha"],
                     pair.kungfu_algorithm, pair.kungfu_options()["op_prefix"],
                     ssgd.kungfu_algorithm)

    # A built optimizer's state is carried over.
    model = _mlp(keras, seed=4)
    adam = keras.optimizers.Adam(1e-2)
    adam.apply([tf.ones_like(v) for v in model.trainable_variables], model.trainable_variables)
    wrapped = kf.Optimizer(adam)
    same = _digest(_weights(adam.variables)) == _digest(_weights(wrapped.variables))
    out["state_copied"] = (same, int(wrapped.iterations.numpy()))
    return out


def overhead(steps=60, batch=64, repeats=3):
    """Seconds per model.fit step of a small CNN, plain optimizer vs kf.Optimizer (np=1)."""
    kf, tf, keras = _setup()
    rs = np.random.RandomState(0)
    x = rs.rand(steps * batch, 16, 16, 1).astype("float32")
    y = rs.randint(0, 10, size=(steps * batch,)).astype("int32")
    times = {}
    for rep in range(repeats):
        for algorithm in (None, "sync-sgd", "sma", "pair-averaging"):
            keras.utils.set_random_seed(0)
            model = keras.Sequential([
                keras.Input((16, 16, 1)),
                keras.layers.Conv2D(16, 3, activation="relu"),
                keras.layers.MaxPooling2D(),
                keras.layers.Conv2D(32, 3, activation="relu"),
                keras.layers.Flatten(),
                keras.layers.Dense(10),
            ])
            base = keras.optimizers.SGD(0.01)
            opt = base if algorithm is None else kf.Optimizer(base, algorithm=algorithm)
            model.compile(optimizer=opt, loss=_loss_fn(keras))
            model.fit(x[:batch], y[:batch], batch_size=batch, epochs=1, verbose=0)  # trace
            t0 = time.perf_counter()
            model.fit(x, y, batch_size=batch, epochs=1, verbose=0, shuffle=False)
            dt = (time.perf_counter() - t0) / steps
            key = algorithm or "plain"
            times[key] = min(times.get(key, float("inf")), dt)
    return times
