"""Data-parallel Keras training with kungfu: a small CNN on scikit-learn's digits.

    kungfu-run -np 4 python examples/keras_digits.py     # 4 workers on this host
    python examples/keras_digits.py                        # a single worker

The digits data set (1,797 8x8 grey-scale images of the digits 0-9) ships inside scikit-learn,
so nothing is downloaded. Every worker:

  * splits the same data the same way into a training and a held-out test set (fixed seed),
  * trains on its own shard of the training set (samples rank, rank + size, rank + 2 size, ...),
  * wraps its optimizer in kungfu's synchronous SGD (`Optimizer`): after every step the gradients
    are averaged over all workers before the optimizer applies them, so all workers take the same
    step with an effective batch of size x --batch-size,
  * scales the learning rate by the number of workers (the linear scaling rule, which keeps the
    step per sample the same as one worker with a size-times smaller batch),
  * starts from rank 0's initial weights (`BroadcastGlobalVariablesCallback`): the workers seed
    their random initialisers differently on purpose, and the broadcast makes them agree.

Rank 0 prints the test accuracy; every rank prints a digest of its final weights, which is the
same on every rank when the workers stayed in step.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import keras  # noqa: E402
import tensorflow as tf  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from sklearn.model_selection import train_test_split  # noqa: E402

import kungfu as kf  # noqa: E402
from kungfu.tensorflow import BroadcastGlobalVariablesCallback, Optimizer  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--epochs", type=int, default=20,
                   help="passes over the training set (default 20)")
    p.add_argument("--batch-size", type=int, default=32,
                   help="samples per step on each worker (default 32)")
    p.add_argument("--optimizer", choices=("sgd", "adam"), default="sgd",
                   help="sgd: SGD with momentum 0.9 (default); adam: Adam")
    p.add_argument("--lr", type=float, default=None,
                   help="learning rate of one worker, multiplied by the number of workers "
                        "(default 0.01 for sgd, 0.001 for adam)")
    p.add_argument("--seed", type=int, default=1, help="seed of the train/test split and of the "
                   "initial weights (each worker adds its rank) (default 1)")
    p.add_argument("--test-fraction", type=float, default=0.2,
                   help="fraction of the data held out for testing (default 0.2)")
    p.add_argument("--compression", choices=("none", "fp16"), default="none",
                   help="fp16: gradients travel as float16 (kf.Optimizer(compression=...)) "
                        "(default none)")
    p.add_argument("--min-accuracy", type=float, default=None,
                   help="exit with code 1 when the test accuracy is below this "
                        "(default: only print it)")
    return p.parse_args(argv)


def load_data(seed: int, test_fraction: float):
    """The same split on every worker: ((x_train, y_train), (x_test, y_test)); x is NHWC
    float32 in [0, 1]."""
    digits = load_digits()
    x = (digits.images.astype(np.float32) / 16.0)[..., None]
    y = digits.target.astype(np.int64)
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=test_fraction, random_state=seed, stratify=y)
    return (x_train, y_train), (x_test, y_test)


def shard(x, y, rank: int, size: int):
    """This worker's part of the training set. Every worker gets the same number of samples (the
    last len % size samples are dropped), so every worker runs the same number of steps per epoch:
    synchronous SGD needs each step to be taken by all workers."""
    n = len(x) - len(x) % size
    return x[rank:n:size], y[rank:n:size]


def build_model() -> keras.Model:
    return keras.Sequential([
        keras.Input(shape=(8, 8, 1)),
        keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
        keras.layers.Conv2D(64, 3, padding="same", activation="relu"),
        keras.layers.MaxPooling2D(2),
        keras.layers.Flatten(),
        keras.layers.Dense(128, activation="relu"),
        keras.layers.Dropout(0.25),
        keras.layers.Dense(10),
    ])


def weights_digest(model: keras.Model) -> str:
    h = hashlib.sha256()
    for w in model.get_weights():
        h.update(np.ascontiguousarray(w).tobytes())
    return h.hexdigest()[:16]


def main(argv=None) -> int:
    args = parse_args(argv)
    rank, size = kf.rank(), kf.size()
    # Different initial weights (and dropout masks) on every worker; the broadcast callback
    # replaces them with rank 0's before the first step.
    keras.utils.set_random_seed(args.seed + rank)

    (x_train, y_train), (x_test, y_test) = load_data(args.seed, args.test_fraction)
    x_shard, y_shard = shard(x_train, y_train, rank, size)
    train = (tf.data.Dataset.from_tensor_slices((x_shard, y_shard))
             .shuffle(len(x_shard), seed=args.seed + rank, reshuffle_each_iteration=True)
             .batch(args.batch_size))

    base_lr = args.lr if args.lr is not None else (0.01 if args.optimizer == "sgd" else 0.001)
    lr = base_lr * size
    if args.optimizer == "sgd":
        opt = keras.optimizers.SGD(learning_rate=lr, momentum=0.9)
    else:
        opt = keras.optimizers.Adam(learning_rate=lr)
    opt = Optimizer(opt, algorithm="sync-sgd", compression=args.compression)

    model = build_model()
    # jit_compile=False: kungfu's collectives have no XLA kernels, and Keras' default ("auto")
    # turns XLA on when a GPU is present.
    model.compile(optimizer=opt,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"], jit_compile=False)
    if rank == 0:
        print(f"workers: {size}, training samples: {len(x_train)} ({len(x_shard)} per worker), "
              f"test samples: {len(x_test)}, batch: {args.batch_size} per worker "
              f"({args.batch_size * size} in all), {args.optimizer} lr {lr:g} "
              f"({base_lr:g} x {size})", flush=True)

    start = time.perf_counter()
    model.fit(train, epochs=args.epochs, verbose=2 if rank == 0 else 0, shuffle=False,
              callbacks=[BroadcastGlobalVariablesCallback()])
    train_s = time.perf_counter() - start

    _, accuracy = model.evaluate(x_test, y_test, batch_size=256, verbose=0)
    digest = weights_digest(model)
    print(f"rank {rank}: final weights digest {digest}", flush=True)
    if rank == 0:
        print(f"test accuracy: {accuracy:.4f} ({len(x_test)} held-out samples, {size} workers, "
              f"{args.epochs} epochs in {train_s:.1f} s)", flush=True)
    if args.min_accuracy is not None and accuracy < args.min_accuracy:
        if rank == 0:
            print(f"FAILED: test accuracy {accuracy:.4f} is below --min-accuracy "
                  f"{args.min_accuracy}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
