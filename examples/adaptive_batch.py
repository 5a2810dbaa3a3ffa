"""Adaptive batch size from the gradient noise scale: an MLP on scikit-learn's digits.

    kungfu-run -np 2 python examples/adaptive_batch.py
    python examples/adaptive_batch.py                      # a single worker (no noise scale)

The optimizer monitors the gradient noise scale (GNS, McCandlish et al. 2018) inside every
training step. A policy (kungfu.policy.GNSBatchGrowth) looks at it at the end of each epoch:
when the noise scale exceeds the global batch size (the batch is smaller than the "critical"
batch, so a larger one would waste few samples), it doubles every worker's batch (up to
--max-batch-size) and scales the learning rate with the square-root rule. kf.Hook applies the decision on every worker before the next
step, and kf.ElasticData keeps each epoch's samples exactly once through the change.
Rank 0 prints each decision, the test accuracy and a digest of the weights (same on every rank).
"""
from __future__ import annotations

import argparse
import hashlib
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import keras  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from sklearn.model_selection import train_test_split  # noqa: E402

import kungfu as kf  # noqa: E402


class GnsBatchPolicy(kf.policy.GNSBatchGrowth):
    """kungfu's ready policy (doubles the batch when the noise scale exceeds the global batch,
    checked per epoch; square-root learning-rate rule), printing each decision on rank 0."""

    def after_epoch(self, state):
        before = len(self.decisions)
        super().after_epoch(state)
        if len(self.decisions) > before and kf.rank() == 0:
            d = self.decisions[-1]
            print(f"epoch {state.epoch}: gns {d['gns']:.1f} > global batch "
                  f"{state.global_batch_size}: local batch -> {d['batch']}, lr -> "
                  f"{d['lr']:.4f}", flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--epochs", type=int, default=8, help="passes over the training set (8)")
    p.add_argument("--batch-size", type=int, default=8, help="initial local batch size (8)")
    p.add_argument("--max-batch-size", type=int, default=128, help="largest local batch (128)")
    p.add_argument("--lr", type=float, default=0.05, help="initial learning rate (0.05)")
    p.add_argument("--min-accuracy", type=float, default=0.0,
                   help="exit 1 if rank 0's test accuracy is below this")
    args = p.parse_args(argv)

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    x_train, x_test, y_train, y_test = train_test_split(x, digits.target, test_size=0.2,
                                                        random_state=0)
    keras.utils.set_random_seed(1)  # the same initial weights on every worker
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(64, activation="relu"),
                              keras.layers.Dense(10, activation="softmax")])
    opt = kf.Optimizer(keras.optimizers.SGD(args.lr, momentum=0.9), monitor="gns",
                       batch_size=args.batch_size)
    model.compile(optimizer=opt, loss="sparse_categorical_crossentropy", metrics=["accuracy"],
                  jit_compile=False)
    data = kf.ElasticData(x_train, y_train, batch_size=args.batch_size, seed=0)
    policy = GnsBatchPolicy(args.max_batch_size)
    model.fit(data.dataset(), epochs=args.epochs, verbose=0,
              callbacks=[kf.Hook(policy, data=data)])
    _, acc = model.evaluate(x_test, y_test, verbose=0)
    digest = hashlib.sha256(b"".join(w.tobytes() for w in model.get_weights())).hexdigest()[:16]
    print(f"rank {kf.rank()}: decisions {len(policy.decisions)}, final local batch "
          f"{data.batch_size}, weights {digest}", flush=True)
    if kf.rank() == 0:
        print(f"test accuracy: {acc:.4f}", flush=True)
        if acc < args.min_accuracy:
            print(f"FAILED: test accuracy {acc:.4f} < {args.min_accuracy}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
