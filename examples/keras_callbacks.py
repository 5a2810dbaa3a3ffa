"""A Keras training script with the usual callbacks, data-parallel with kungfu.

    kungfu-run -np 2 python examples/keras_callbacks.py --out runs/digits
    kungfu-run -w -np 3 -H 127.0.0.1:3 -builtin-config-port auto \
        python examples/keras_callbacks.py --out runs/digits --kill-self 1@20

The script is what a one-process Keras script looks like, plus kungfu's lines (marked `# kf`):

  * the data are TFRecord files (scikit-learn's digits, written by the script the first time):
    the training files are read by position (`kf.RecordFiles`) through `kf.ElasticData`, which
    gives every worker its part of each step's global batch, also after a worker is lost;
    the test file is read with `tf.data.TFRecordDataset` and validated with
    `kf.validation_dataset`, each worker its share of it at the current cluster size;
  * the optimizer is `kf.Optimizer(...)` (gradients averaged over the workers), the learning
    rate scaled by the number of workers;
  * `kf.Hook(data=data)` in the callbacks: every worker starts from rank 0's weights, the
    metrics the callbacks see are over all workers (so EarlyStopping and ReduceLROnPlateau decide
    the same everywhere), the files (CSVLogger, TensorBoard, ModelCheckpoint, BackupAndRestore)
    are written by rank 0 alone, and under `kungfu-run -w` the survivors of a lost worker go on;
  * mixed precision (`--mixed-precision`, on by default): Keras wraps the optimizer in its
    `LossScaleOptimizer`, and every worker skips the same overflowing steps.

Every rank prints a digest of its final weights, the learning rate of every epoch and the epoch
EarlyStopping stopped at: the same on every rank. `--kill-self RANK@STEP` makes the worker of
that rank kill itself (SIGKILL) after that step, once per `--out` folder, to see a job survive
the loss of a worker (under `kungfu-run -w`).
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import keras  # noqa: E402
import tensorflow as tf  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from sklearn.model_selection import train_test_split  # noqa: E402

import kungfu as kf  # noqa: E402
from keras_digits import weights_digest  # noqa: E402  (the digest keras_digits.py prints)

FEATURES = {"image": tf.io.FixedLenFeature([8, 8, 1], tf.float32),
            "label": tf.io.FixedLenFeature([], tf.int64)}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "kungfu-keras-callbacks"),
                   help="folder of the data, the logs, the checkpoint and the backup, the same "
                        "for every worker (default: kungfu-keras-callbacks in the temp folder)")
    p.add_argument("--epochs", type=int, default=20, help="at most this many epochs (default 20)")
    p.add_argument("--batch-size", type=int, default=32,
                   help="samples per step on each worker (default 32)")
    p.add_argument("--lr", type=float, default=0.01,
                   help="learning rate of one worker, times the number of workers (default 0.01)")
    p.add_argument("--patience", type=int, default=3,
                   help="EarlyStopping's patience; ReduceLROnPlateau's is 1 (default 3)")
    p.add_argument("--mixed-precision", action=argparse.BooleanOptionalAction, default=True,
                   help="train in mixed_float16 (default: on)")
    p.add_argument("--seed", type=int, default=1, help="train/test split and initial weights")
    p.add_argument("--kill-self", metavar="RANK@STEP",
                   help="the worker of this rank kills itself (SIGKILL) after this step, once "
                        "per --out folder (to try kungfu-run -w's recovery)")
    return p.parse_args(argv)


def write_records(path: str, x: np.ndarray, y: np.ndarray) -> None:
    """x and y as tf.train.Example records, written to a temporary file renamed to `path`: every
    worker writes the same file, and a reader sees either none or a whole one."""
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
    os.close(fd)
    with tf.io.TFRecordWriter(tmp) as w:
        for image, label in zip(x, y):
            w.write(tf.train.Example(features=tf.train.Features(feature={
                "image": tf.train.Feature(float_list=tf.train.FloatList(value=image.ravel())),
                "label": tf.train.Feature(int64_list=tf.train.Int64List(value=[label])),
            })).SerializeToString())
    os.replace(tmp, path)


def make_files(folder: str, seed: int, parts: int = 4):
    """The digits (8x8 images in [0, 1]) split into training and test files, written once:
    (training files, test file)."""
    os.makedirs(folder, exist_ok=True)
    train_files = [os.path.join(folder, f"train-{seed}-{i}.tfrecord") for i in range(parts)]
    test_file = os.path.join(folder, f"test-{seed}.tfrecord")
    if all(os.path.exists(f) for f in train_files + [test_file]):
        return train_files, test_file
    digits = load_digits()
    x = (digits.images.astype(np.float32) / 16.0)[..., None]
    x_train, x_test, y_train, y_test = train_test_split(
        x, digits.target, test_size=0.2, random_state=seed, stratify=digits.target)
    for path, rows in zip(train_files, np.array_split(np.arange(len(x_train)), parts)):
        write_records(path, x_train[rows], y_train[rows])
    write_records(test_file, x_test, y_test)
    return train_files, test_file


def parse(records):
    """A batch of serialized records -> (images, labels), for kf.RecordFiles."""
    got = tf.io.parse_example(records, FEATURES)
    return got["image"].numpy(), got["label"].numpy()


def read_all(path: str):
    """A whole TFRecord file as arrays, read with tf.data."""
    ds = tf.data.TFRecordDataset(path).map(lambda r: tf.io.parse_single_example(r, FEATURES))
    rows = list(ds.batch(1024).as_numpy_iterator())
    return (np.concatenate([r["image"] for r in rows]),
            np.concatenate([r["label"] for r in rows]))


def build_model() -> keras.Model:
    return keras.Sequential([
        keras.Input(shape=(8, 8, 1)),
        keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
        keras.layers.MaxPooling2D(2),
        keras.layers.Flatten(),
        keras.layers.Dense(64, activation="relu"),
        # float32 logits: the loss is computed in full precision under mixed_float16 too.
        keras.layers.Dense(10, dtype="float32"),
    ])


class KillSelf(keras.callbacks.Callback):
    """Kills this worker (SIGKILL, as the OOM killer would) after step `step` if it started as
    `rank`; a marker file keeps a replacement worker from doing it again."""

    def __init__(self, spec: str, marker: str):
        super().__init__()
        rank, step = spec.split("@")
        self.kill = int(rank) == kf.rank() and not os.path.exists(marker)
        self.step, self.marker, self.done = int(step), marker, 0

    def on_train_batch_end(self, batch, logs=None):
        self.done += 1
        if self.kill and self.done == self.step:
            open(self.marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.mixed_precision:
        keras.mixed_precision.set_global_policy("mixed_float16")
    # Initial weights differ between the workers on purpose: kf.Hook gives every worker rank 0's.
    keras.utils.set_random_seed(args.seed + kf.rank())

    train_files, test_file = make_files(os.path.join(args.out, "data"), args.seed)
    data = kf.ElasticData(kf.RecordFiles(train_files, parse),  # kf
                          batch_size=args.batch_size, seed=args.seed)
    x_test, y_test = read_all(test_file)
    validation = kf.validation_dataset(x_test, y_test, batch_size=128)  # kf

    opt = keras.optimizers.SGD(args.lr * kf.size(), momentum=0.9)  # kf: lr x workers
    opt = kf.Optimizer(opt)  # kf
    model = build_model()
    model.compile(optimizer=opt, jit_compile=False,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])

    out = args.out
    early_stopping = keras.callbacks.EarlyStopping(monitor="val_loss", patience=args.patience)
    callbacks = [
        kf.Hook(data=data),  # kf
        keras.callbacks.BackupAndRestore(os.path.join(out, "backup")),
        keras.callbacks.CSVLogger(os.path.join(out, "training.csv")),
        keras.callbacks.TensorBoard(os.path.join(out, "tensorboard")),
        keras.callbacks.ModelCheckpoint(os.path.join(out, "best.keras"), monitor="val_loss",
                                        save_best_only=True),
        early_stopping,
        keras.callbacks.ReduceLROnPlateau(monitor="val_loss", factor=0.5, patience=1),
    ]
    if args.kill_self:
        callbacks.append(KillSelf(args.kill_self, os.path.join(out, "killed")))
    # shuffle=False: ElasticData shuffles every epoch itself (the same order on every worker).
    history = model.fit(data.dataset(), validation_data=validation, epochs=args.epochs,
                        callbacks=callbacks, shuffle=False, verbose=2)

    stopped = early_stopping.stopped_epoch
    # A worker that joined in the last epoch's last steps may have ended no epoch of its own.
    rates = ",".join(f"{lr:g}" for lr in history.history.get("learning_rate", []))
    lr = float(keras.ops.convert_to_numpy(model.optimizer.learning_rate))
    print(f"rank {kf.rank()}: final weights digest {weights_digest(model)}, "
          f"learning rates {rates}, then {lr:g}, early stop at epoch {stopped or 'none'}",
          flush=True)
    if kf.rank() == 0:
        print(f"val accuracy {history.history['val_accuracy'][-1]:.4f} after "
              f"{len(history.epoch)} epochs, workers at the end: {kf.size()}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
