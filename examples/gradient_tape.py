"""Data-parallel training with kungfu in a custom loop (tf.GradientTape inside tf.function).

    kungfu-run -np 4 python examples/gradient_tape.py    # 4 workers on this host
    python examples/gradient_tape.py                       # a single worker

The same data, split, shards and CNN as keras_digits.py (imported from it), trained by hand:

  * `broadcast_variables(model.variables, root=0)` once before the first step gives every worker
    rank 0's initial weights (the optimizer's slots start at zero everywhere, so they agree
    already),
  * `Optimizer(opt)` wraps the Keras optimizer: its apply_gradients averages the gradients over
    all workers before applying them, inside the compiled step,
  * the epoch's mean loss is averaged over the workers with kungfu's numpy API (`kf.allreduce`)
    before rank 0 prints it.

Rank 0 prints the test accuracy; every rank prints a digest of its final weights.
"""
from __future__ import annotations

import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

import kungfu as kf  # noqa: E402
from kungfu.tensorflow import Optimizer, broadcast_variables  # noqa: E402
from keras_digits import build_model, load_data, parse_args, shard, weights_digest  # noqa: E402


def main(argv=None) -> int:
    args = parse_args(argv)
    rank, size = kf.rank(), kf.size()
    keras.utils.set_random_seed(args.seed + rank)  # differs per worker until the broadcast

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
    opt = Optimizer(opt, algorithm="sync-sgd")

    model = build_model()
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    # Every worker starts from rank 0's weights.
    broadcast_variables(model.variables, root=0)

    @tf.function
    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))  # averaged over workers
        return loss

    if rank == 0:
        print(f"workers: {size}, training samples: {len(x_train)} ({len(x_shard)} per worker), "
              f"test samples: {len(x_test)}, batch: {args.batch_size} per worker "
              f"({args.batch_size * size} in all), {args.optimizer} lr {lr:g} "
              f"({base_lr:g} x {size})", flush=True)

    start = time.perf_counter()
    for epoch in range(args.epochs):
        total, steps = 0.0, 0
        for x, y in train:
            total += float(train_step(x, y))
            steps += 1
        mean_loss = kf.allreduce(np.float64(total / steps), op="avg", name="epoch-loss")
        if rank == 0:
            print(f"epoch {epoch + 1}/{args.epochs}: loss {mean_loss:.4f} ({steps} steps)",
                  flush=True)
    train_s = time.perf_counter() - start

    logits = model(x_test, training=False)
    accuracy = float(np.mean(np.argmax(logits.numpy(), axis=1) == y_test))
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
