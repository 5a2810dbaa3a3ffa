"""Worker bodies for test_keras_habits.py: Keras callbacks as users write them, real processes."""
from __future__ import annotations

import numpy as np

from _w_tf_optim import _digest, _setup

SHARD = 64


def shard(rank: int):
    """Worker `rank`'s own data: y = x w + noise, rank 1's ten times larger (its loss is ~100
    times rank 0's, so decisions from local metrics differ)."""
    rng = np.random.default_rng(rank)
    x = rng.standard_normal((SHARD, 4)).astype(np.float32)
    y = x @ np.array([[1.0], [-2.0], [0.5], [3.0]], np.float32)
    y += 0.1 * rng.standard_normal((SHARD, 1)).astype(np.float32)
    return x, y * (10.0 if rank == 1 else 1.0)


def deciding_callbacks(hook_first: bool):
    """model.fit on this worker's shard with ReduceLROnPlateau, then with EarlyStopping, kf.Hook
    first or last in the list; then model.evaluate on the shard. Returns what each decided and
    the evaluation, with the loss and MAE over every worker's shard computed here with numpy."""
    kf, tf, keras = _setup()
    rank = kf.rank()
    x, y = shard(rank)
    keras.utils.set_random_seed(7)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer=kf.Optimizer(keras.optimizers.SGD(0.01)), loss="mse",
                  metrics=["mae"], jit_compile=False)
    kf.broadcast_variables(model.weights)

    def fit(callback, epochs):
        callbacks = [kf.Hook(), callback] if hook_first else [callback, kf.Hook()]
        return model.fit(x, y, batch_size=16, epochs=epochs, shuffle=False, verbose=0,
                         callbacks=callbacks).history

    # Improvements of rank 0's own loss are below min_delta (it would lower the rate at once),
    # those of rank 1's are far above (it never would); the loss over both is rank 1's kind.
    plateau = fit(keras.callbacks.ReduceLROnPlateau(monitor="loss", factor=0.1, patience=0,
                                                    min_delta=0.5, verbose=0), 4)
    lr = float(keras.ops.convert_to_numpy(model.optimizer.learning_rate))
    # Likewise: rank 0's own loss does not improve by min_delta (it would stop after two
    # epochs), the loss over both does (training goes on).
    early = fit(keras.callbacks.EarlyStopping(monitor="loss", min_delta=5.0, patience=1), 5)
    # After fit, evaluate is each worker's own (one worker may evaluate alone)...
    alone = model.evaluate(x, y, batch_size=16, verbose=0, return_dict=True)
    # ... unless the workers evaluate their shards together.
    kf.combine_metrics(model)
    got = model.evaluate(x, y, batch_size=16, verbose=0, return_dict=True)
    xs, ys = zip(*(shard(r) for r in range(kf.size())))
    pred = model.predict(np.concatenate(xs), verbose=0)
    err = pred - np.concatenate(ys)
    return {"plateau_loss": plateau["loss"], "lr": lr, "early_epochs": len(early["loss"]),
            "early_loss": early["loss"], "weights": _digest(model.get_weights()),
            "evaluate": got, "alone": alone, "expected": {"loss": float(np.mean(err ** 2)),
                                          "mae": float(np.mean(np.abs(err)))}}


def one_writer(folder: str, hook: bool):
    """model.fit with verbose=1 and ModelCheckpoint writing to this worker's own folder; the
    model is built at its first batch (no keras.Input) and starts from different weights on each
    worker. Returns what this worker printed, which files its folder holds, and its weights."""
    import contextlib
    import io
    import os

    kf, tf, keras = _setup()
    keras.utils.enable_interactive_logging()  # as in a user's script (_setup turns it off)
    rank = kf.rank()
    x, y = shard(0)
    keras.utils.set_random_seed(100 + rank)  # different initial weights on each worker
    model = keras.Sequential([keras.layers.Dense(3, activation="tanh"), keras.layers.Dense(1)])
    model.compile(optimizer=kf.Optimizer(keras.optimizers.Adam(0.01)), loss="mse",
                  jit_compile=False)
    mine = os.path.join(folder, f"rank{rank}")
    os.makedirs(mine)
    save = keras.callbacks.ModelCheckpoint(os.path.join(mine, "e{epoch}.weights.h5"),
                                           save_weights_only=True)
    first = kf.Hook() if hook else kf.BroadcastGlobalVariablesCallback()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        model.fit(x, y, batch_size=16, epochs=2, verbose=1, callbacks=[first, save])
    # After training every worker prints again and may save on its own.
    with contextlib.redirect_stdout(io.StringIO()) as after:
        model.evaluate(x, y, verbose=1)
    return {"printed": out.getvalue(), "after": after.getvalue(),
            "files": sorted(os.listdir(mine)), "weights": _digest(model.get_weights())}


def sharded_fit(samples: int, batch: int):
    """model.fit on kf.shard of arrays, then on kf.shard of a tf.data.Dataset. Returns the
    samples this worker trained on, its step counts and its weights."""
    kf, tf, keras = _setup()
    x = np.arange(samples, dtype=np.float32)[:, None] / samples
    y = 2 * x
    model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
    model.compile(optimizer=kf.Optimizer(keras.optimizers.SGD(0.1)), loss="mse",
                  jit_compile=False)
    xs, ys = kf.shard((x, y))
    steps = []
    history = model.fit(xs, ys, batch_size=batch, epochs=2, shuffle=False, verbose=0,
                        callbacks=[kf.Hook()])
    steps.append(len(history.history["loss"]))
    ds = kf.shard(tf.data.Dataset.from_tensor_slices((x, y))).batch(batch)
    counter = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda b, logs: steps.append(("batch", b)))
    model.fit(ds, epochs=1, verbose=0, callbacks=[kf.Hook(), counter])
    seen = [float(v[0]) for v, _ in ds.unbatch().as_numpy_iterator()]
    return {"arrays": (xs[:, 0] * samples).round().astype(int).tolist(),
            "dataset": [round(v * samples) for v in seen], "steps": steps,
            "weights": _digest(model.get_weights())}


def tensorboard_gns(folder: str, hook_first: bool):
    """model.fit with a gradient noise scale monitor and TensorBoard, kf.Hook first or last in
    the list; returns the scalars TensorBoard wrote for the epochs (rank 0's files)."""
    import glob
    import os

    kf, tf, keras = _setup()
    x, y = shard(kf.rank())
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    # No batch_size=: kf.Hook learns it from the first batch.
    opt = kf.Optimizer(keras.optimizers.SGD(0.001), monitor=["gns"])
    model.compile(optimizer=opt, loss="mse", jit_compile=False)
    logdir = os.path.join(folder, f"rank{kf.rank()}")
    board = keras.callbacks.TensorBoard(logdir, update_freq="epoch")
    callbacks = [kf.Hook(), board] if hook_first else [board, kf.Hook()]
    history = model.fit(x, y, batch_size=16, epochs=3, verbose=0, callbacks=callbacks)
    scalars = {}
    for path in glob.glob(os.path.join(logdir, "train", "events.out.tfevents.*")):
        for event in tf.compat.v1.train.summary_iterator(path):
            for value in event.summary.value:
                if value.tag.startswith("epoch_"):  # not the model's graph or config
                    scalars.setdefault(value.tag, []).append(
                        float(tf.make_ndarray(value.tensor)))
    return {"scalars": scalars, "history": history.history.get("gns"),
            "batch": float(opt.kungfu_monitor.batch_size.numpy()),
            "steps_per_epoch": -(-len(x) // 16), "params": sum(
                int(np.prod(v.shape)) for v in model.trainable_variables)}


def detached_identity():
    """Both workers switch to a cluster of rank 0 alone (what a shrink does); returns what
    kf.rank(), kf.size() and kf.detached() say after it."""
    import kungfu as kf
    from kungfu import _peer

    ident = _peer.identity_from_env()
    kf.init()
    kf.barrier()
    _peer.replace(ident.self_spec, ident.peers[:1], ident.version + 1)
    return {"rank": kf.rank(), "size": kf.size(), "detached": kf.detached()}


def warmup(initial_lr: float, warmup_epochs: int):
    """model.fit for warmup_epochs + 1 epochs of 4 steps with LearningRateWarmupCallback; the
    learning rate each step trained with."""
    kf, tf, keras = _setup()
    x, y = shard(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer=kf.Optimizer(keras.optimizers.SGD(1.0)), loss="mse",
                  jit_compile=False)
    rates = []
    seen = keras.callbacks.LambdaCallback(on_train_batch_begin=lambda b, logs: rates.append(
        float(keras.ops.convert_to_numpy(model.optimizer.learning_rate))))
    model.fit(x, y, batch_size=16, epochs=warmup_epochs + 1, verbose=0,
              callbacks=[kf.LearningRateWarmupCallback(initial_lr, warmup_epochs), seen,
                         kf.Hook()])
    return rates


def resume_from_saved(folder: str, loader: str):
    """Rank 0 saves a model trained with kf.Optimizer(Adam) (.keras); every worker loads it with
    `loader` ("kf": kf.load_model, "keras": keras.models.load_model) and goes on training on its
    own shard with BroadcastGlobalVariablesCallback. Returns the loaded optimizer's state, the
    kungfu warnings fit gave, and the weights after it."""
    import os
    import warnings

    kf, tf, keras = _setup()
    rank = kf.rank()
    x, y = shard(rank)
    path = os.path.join(folder, "model.keras")
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer=kf.Optimizer(keras.optimizers.Adam(0.01)), loss="mse",
                  jit_compile=False)
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    saved = _digest([v.numpy() for v in model.optimizer.variables])
    if rank == 0:
        os.makedirs(folder, exist_ok=True)
        model.save(path)
    kf.barrier()
    model = (kf.load_model(path) if loader == "kf" else keras.models.load_model(path))
    opt = model.optimizer
    loaded = {"distributed": isinstance(opt, kf.Optimizer), "iterations": int(opt.iterations),
              "slots": _digest([v.numpy() for v in opt.variables]), "saved_slots": saved}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(x, y, batch_size=16, epochs=2, verbose=0,
                  callbacks=[kf.BroadcastGlobalVariablesCallback()])
    return {**loaded, "warnings": [str(w.message) for w in caught if "kungfu" in str(w.message)],
            "weights": _digest(model.get_weights())}


def own_train_step_no_warning():
    """A model whose own train_step averages the gradients (Horovod's way), with a plain
    optimizer: fit must not warn that each worker trains alone; the workers stay equal."""
    import warnings

    kf, tf, keras = _setup()
    from kungfu.tensorflow import ops

    class Averaging(keras.Sequential):
        def train_step(self, data):
            x, y = data
            with tf.GradientTape() as tape:
                loss = self.compute_loss(x=x, y=y, y_pred=self(x, training=True))
            grads = tape.gradient(loss, self.trainable_variables)
            grads = ops.group_all_reduce(grads, name="own-step")
            n = float(kf.size())
            self.optimizer.apply([g / n for g in grads], self.trainable_variables)
            return {"loss": loss}

    x, y = shard(kf.rank())
    keras.utils.set_random_seed(5 + kf.rank())
    model = Averaging([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse", jit_compile=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(x, y, batch_size=16, epochs=2, verbose=0,
                  callbacks=[kf.BroadcastGlobalVariablesCallback()])
    return {"warnings": [str(w.message) for w in caught if "kungfu" in str(w.message)],
            "weights": _digest(model.get_weights())}
