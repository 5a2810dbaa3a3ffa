"""Worker bodies for test_keras_habits_2.py: Keras habits under kf.Hook (a custom train_step
as the Keras guide writes it, BackupAndRestore, CSVLogger, TensorBoard, the progress bar after a
resume), real processes."""
from __future__ import annotations

import numpy as np

from _w_tf_optim import _digest, _setup


def _guide_model(keras, tf):
    """A model whose train_step is written as Keras's "customizing fit()" guide writes it: the
    loss tracker counts one per step (`update_state(loss)`), and the logs are the metrics'
    results by name (the compiled metrics' entry is a dict)."""

    class Net(keras.Model):
        def train_step(self, data):
            x, y = data[:2]
            with tf.GradientTape() as tape:
                y_pred = self(x, training=True)
                loss = self.compute_loss(x=x, y=y, y_pred=y_pred)
            grads = tape.gradient(loss, self.trainable_variables)
            self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
            for m in self.metrics:
                if m.name == "loss":
                    m.update_state(loss)
                else:
                    m.update_state(y, y_pred)
            return {m.name: m.result() for m in self.metrics}

    keras.utils.set_random_seed(1)
    inp = keras.Input((8,))
    out = keras.layers.Dense(2)(keras.layers.Dense(16, activation="relu")(inp))
    return Net(inp, out)


def _labelled(rank: int, n: int = 256):
    """Rank 0's labels follow its inputs, rank 1's are noise: their own losses differ."""
    rng = np.random.default_rng(rank)
    x = rng.normal(size=(n, 8)).astype("float32")
    y = (x.sum(1) > 0).astype("int64") if rank == 0 else rng.integers(0, 2, n)
    return x, y


def guide_train_step():
    """model.fit of the guide's train_step with ReduceLROnPlateau(monitor="loss"): returns the
    batch size the Hook found, the global batch in the logs, the epoch losses, the final
    learning rate and the weights."""
    kf, tf, keras = _setup()
    x, y = _labelled(kf.rank())
    model = _guide_model(keras, tf)
    model.compile(kf.Optimizer(keras.optimizers.SGD(0.05)),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"], jit_compile=False)
    hook = kf.Hook()
    plateau = keras.callbacks.ReduceLROnPlateau(monitor="loss", factor=0.5, patience=0,
                                                min_delta=0.01)
    history = model.fit(x, y, batch_size=32, epochs=4, verbose=0, shuffle=False,
                        callbacks=[hook, plateau]).history
    return {"local_batch": hook.state.local_batch_size,
            "global_batch": history["global_batch_size"], "loss": history["loss"],
            "lr": float(keras.ops.convert_to_numpy(model.optimizer.learning_rate)),
            "weights": _digest(model.get_weights())}


def _small_model(keras, kf):
    keras.utils.set_random_seed(2)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(2)])
    model.compile(kf.Optimizer(keras.optimizers.SGD(0.1)),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  jit_compile=False)
    return model


def csv_and_tensorboard(folder: str):
    """model.fit for 2 epochs with a CSVLogger (append=True) and a TensorBoard that every
    worker points at the same file and folder, a CSVLogger of this worker's own, and one that
    rank 0 alone is given. Returns,
    after every worker's fit ended, the rows of each CSV file and the event files of the
    shared TensorBoard folder."""
    import csv
    import os

    kf, tf, keras = _setup()
    x, y = _labelled(0, 128)
    model = _small_model(keras, kf)
    shared = os.path.join(folder, "log.csv")
    own = os.path.join(folder, f"log{kf.rank()}.csv")
    first = os.path.join(folder, "rank0.csv")  # Horovod's habit: given to rank 0 only
    model.fit(x, y, batch_size=32, epochs=2, verbose=0, callbacks=[
        keras.callbacks.CSVLogger(shared, append=True),
        keras.callbacks.TensorBoard(os.path.join(folder, "tb")), kf.Hook(),
        keras.callbacks.CSVLogger(own)] + (
        [keras.callbacks.CSVLogger(first)] if kf.rank() == 0 else []))
    kf.barrier()

    def rows(path):
        with open(path) as f:
            return list(csv.reader(f))

    return {"shared": rows(shared), "own": rows(own), "first": rows(first),
            "events": sorted(os.listdir(os.path.join(folder, "tb", "train")))}


def backup_and_restore(folder: str):
    """BackupAndRestore under kf.Hook, every worker naming the same folder: a first fit of 2
    epochs keeps its backup (delete_checkpoint=False); a second fit of 4 epochs restores it
    and deletes it at its end. Returns what this worker wrote in the folder (Python's audit
    events), the epochs each fit ran and the weights."""
    import os
    import sys

    kf, tf, keras = _setup()
    backup = os.path.abspath(os.path.join(folder, "backup"))
    wrote = []

    def audit(event, args):
        if event in ("open", "os.mkdir", "shutil.rmtree", "os.remove", "os.rename") and \
                args and isinstance(args[0], str) and \
                os.path.abspath(args[0]).startswith(backup):
            if event != "open" or any(c in str(args[1]) for c in "wax+"):
                wrote.append(event)

    sys.addaudithook(audit)
    x, y = _labelled(kf.rank(), 128)
    model = _small_model(keras, kf)
    first = model.fit(x, y, batch_size=32, epochs=2, verbose=0, callbacks=[
        kf.Hook(), keras.callbacks.BackupAndRestore(backup, delete_checkpoint=False)])
    kf.barrier()
    second = model.fit(x, y, batch_size=32, epochs=4, verbose=0, callbacks=[
        keras.callbacks.BackupAndRestore(backup), kf.Hook()])
    kf.barrier()
    return {"wrote": wrote, "first": len(first.history["loss"]),
            "second": len(second.history["loss"]), "left": os.path.exists(backup),
            "weights": _digest(model.get_weights())}


def resumed_progress(folder: str):
    """A job of 2 workers with kf.Hook(checkpoint=...) over kf.ElasticData (80 samples, 2 x 4 a
    step: 10 steps an epoch) stops after step 13 (3 steps into epoch 1 of 3); a second job
    resumes from the file with verbose=1. Returns what the second one printed."""
    import contextlib
    import io
    import os

    kf, tf, keras = _setup()
    x, y = _labelled(0, 80)
    ckpt = os.path.join(folder, "train.ckpt")

    def job(verbose):
        data = kf.ElasticData(x, y, batch_size=4, shuffle=False)
        model = _small_model(keras, kf)
        hook = kf.Hook(data=data, checkpoint=ckpt, checkpoint_every=1)

        def stop(batch, logs):
            if hook.state.step == 13:
                model.stop_training = True

        model.fit(data.dataset(), epochs=3, verbose=verbose, callbacks=[
            hook, keras.callbacks.LambdaCallback(on_train_batch_end=stop)])

    job(0)
    kf.barrier()
    keras.utils.enable_interactive_logging()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        job(1)
    return out.getvalue()


def _unbuilt_model(keras, kf):
    """The shape of Horovod's own Keras example: a Sequential without keras.Input (Keras builds
    it on its first batch; before, resume found "0 variables to sync, the checkpoint has 26"),
    on 8 x 8 images, with Adam."""
    keras.utils.set_random_seed(3)
    L = keras.layers
    model = keras.Sequential([
        L.Conv2D(4, 3, activation="relu"), L.Conv2D(8, 3, activation="relu"), L.MaxPooling2D(),
        L.Dropout(0.25), L.Flatten(), L.Dense(16, activation="relu"), L.Dropout(0.5),
        L.Dense(10)])
    model.compile(kf.Optimizer(keras.optimizers.Adam(0.01)),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True), jit_compile=False)
    return model


def resume_unbuilt(folder: str):
    """A job of 2 workers trains the unbuilt model with kf.Hook(checkpoint=...) into a folder
    that does not exist, over kf.ElasticData (96 images, batch 4 per worker), and stops after
    step 5; a second job (batch 8 in its script) resumes from the file and trains to step 8;
    a third, over plain arrays (nothing to build the model from), is refused. Returns the
    weights' digests, what the second job printed and the third's error."""
    import contextlib
    import io
    import os

    kf, tf, keras = _setup()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(96, 8, 8, 1)).astype("float32")
    y = rng.integers(0, 10, 96)
    ckpt = os.path.join(folder, "runs", "one", "train.ckpt")
    out = {}

    def job(batch, stop_at, record=None):
        data = kf.ElasticData(x, y, batch_size=batch, shuffle=False)
        model = _unbuilt_model(keras, kf)
        hook = kf.Hook(data=data, checkpoint=ckpt, checkpoint_every=1)

        def begin(logs):
            if record is not None:
                out[record] = _digest(model.get_weights())

        def stop(batch, logs):
            if hook.state.step == stop_at:
                model.stop_training = True

        model.fit(data.dataset(), epochs=2, verbose=0, callbacks=[
            hook, keras.callbacks.LambdaCallback(on_train_begin=begin, on_train_batch_end=stop)])
        return model, hook, data

    model, _, _ = job(4, 5)
    out["written"] = _digest(model.get_weights())
    kf.barrier()
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        _, hook, data = job(8, 8, record="resumed")
    out["printed"], out["step"], out["batch"] = err.getvalue(), hook.state.step, data.batch_size
    kf.barrier()
    model = _unbuilt_model(keras, kf)
    try:
        model.fit(x, y, batch_size=4, epochs=1, verbose=0,
                  callbacks=[kf.Hook(checkpoint=ckpt)])
        out["plain"] = ""
    except ValueError as e:
        out["plain"] = str(e)
    return out


def main():
    """Run under kungfu-run -w (test_keras_habits_2.py): the guide's train_step on
    kf.ElasticData; the worker of rank --kill-rank kills itself (SIGKILL) after its step
    --kill-step, before kf.Hook's agreement of that step (a callback before the Hook), so the
    others fail in that agreement and train the step again. With --shrink-at STEP a policy
    resizes the job to 1 worker after that step, and the workers print Keras's progress bar.
    Each worker that trains to the end writes a JSON line to --out: its weights, its
    recoveries, the loss of its last epoch and what it printed."""
    import contextlib
    import io
    import argparse
    import json
    import os
    import signal

    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--kill-rank", type=int, default=1)
    p.add_argument("--kill-step", type=int, default=3)
    p.add_argument("--shrink-at", type=int, default=0)
    args = p.parse_args()
    kf, tf, keras = _setup()
    x, y = _labelled(0)
    data = kf.ElasticData(x, y, batch_size=16, shuffle=False)
    model = _guide_model(keras, tf)
    model.compile(kf.Optimizer(keras.optimizers.SGD(0.05)),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"], jit_compile=False)

    class Shrink(kf.BasePolicy):
        def after_step(self, state):
            if state.step == args.shrink_at and state.cluster_size > 1:
                kf.resize(1)

    hook = kf.Hook(Shrink(), data=data)
    doomed = kf.rank() == args.kill_rank

    def kill(batch, logs):
        if doomed and hook.state.step + 1 == args.kill_step:  # the Hook counts it after this
            os.kill(os.getpid(), signal.SIGKILL)

    if args.shrink_at:
        keras.utils.enable_interactive_logging()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        history = model.fit(data.dataset(), epochs=2, verbose=int(args.shrink_at > 0),
                            callbacks=[keras.callbacks.LambdaCallback(on_train_batch_end=kill),
                                       hook]).history
    with open(os.path.join(args.out, f"{os.getpid()}.json"), "w") as f:
        json.dump({"rank": kf.rank(), "size": kf.size(), "step": hook.state.step,
                   "recoveries": len(hook.recoveries), "loss": history["loss"][-1],
                   "weights": _digest(model.get_weights()), "printed": out.getvalue()}, f)


if __name__ == "__main__":
    main()


def uneven_shards(hook: bool):
    """Rank 1 has one batch more than rank 0: model.fit fails at once on every worker, naming
    each worker's steps per epoch (with kf.Hook, or with BroadcastGlobalVariablesCallback only)."""
    import time

    import keras

    import kungfu as kf

    n = 32 + 8 * kf.rank()
    x, y = np.ones((n, 4), np.float32), np.zeros((n, 1), np.float32)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(kf.Optimizer(keras.optimizers.SGD(0.1)), "mse")
    callback = kf.Hook() if hook else kf.BroadcastGlobalVariablesCallback()
    start = time.monotonic()
    try:
        model.fit(x, y, batch_size=8, epochs=2, verbose=0, callbacks=[callback])
        return {"error": None}
    except ValueError as e:
        return {"error": str(e), "seconds": time.monotonic() - start}


def drifting_learning_rate():
    """A callback lowers the learning rate on rank 1 only at the end of epoch 1 (as one that
    decides from a worker's own metrics would): every worker fails at the next epoch's first
    step, naming each one's rate."""
    import time

    import keras

    import kungfu as kf

    x, y = np.ones((32, 4), np.float32), np.zeros((32, 1), np.float32)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(kf.Optimizer(keras.optimizers.SGD(0.1)), "mse")

    def lower(epoch, logs):
        if epoch == 1 and kf.rank() == 1:
            model.optimizer.learning_rate = 0.05

    steps = []
    callbacks = [kf.Hook(), keras.callbacks.LambdaCallback(
        on_epoch_end=lower, on_train_batch_end=lambda b, logs: steps.append(b))]
    start = time.monotonic()
    try:
        model.fit(x, y, batch_size=8, epochs=4, verbose=0, callbacks=callbacks)
        return {"error": None, "steps": len(steps)}
    except RuntimeError as e:
        return {"error": str(e), "seconds": time.monotonic() - start, "steps": len(steps)}


def validation_shares():
    """model.fit with validation_data=kf.validation_dataset(...) (each worker evaluates its share,
    kf.Hook combines): the epoch's val_loss is the loss over the whole validation set."""
    import keras

    import kungfu as kf

    rng = np.random.default_rng(0)  # the same validation data on every worker
    xv = rng.normal(size=(37, 4)).astype(np.float32)
    yv = rng.normal(size=(37, 1)).astype(np.float32)
    x = np.random.default_rng(1 + kf.rank()).normal(size=(32, 4)).astype(np.float32)
    y = x.sum(axis=1, keepdims=True)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(kf.Optimizer(keras.optimizers.SGD(0.05)), "mse")
    history = model.fit(x, y, batch_size=8, epochs=2, verbose=0, callbacks=[kf.Hook()],
                        validation_data=kf.validation_dataset(xv, yv, batch_size=5))
    whole = model.evaluate(xv, yv, batch_size=37, verbose=0)  # this worker, every sample
    rows = [int(i) for bx, in kf.validation_dataset(np.arange(37), batch_size=5)
            for i in bx.numpy()]
    return {"val_loss": history.history["val_loss"][-1], "whole": float(whole), "rows": rows}
