"""The training run of the adaptation experiments (run under kungfu-run by the drivers here).

A small MLP on scikit-learn's digits (nothing downloaded) with model.fit, kf.ElasticData and
kf.Hook; the policies come from --policy. Rank 0 appends one JSON line per step to --out
(step, epoch, step time, every worker's compute time and batch size, learning rate, loss on a
fixed probe set) and one per epoch (test accuracy). Emulated compute and stragglers come from
the environment (KUNGFU_SAMPLE_TIME, KUNGFU_SLOWDOWN), set by the driver.

    --policy bsp                 no policy (equal split)
    --policy lb-last|lb-ewma|lb-narx   kf.policy.LoadBalancing with that predictor
    --policy jump:K@S            at step S the global batch becomes K times larger and the
                                 learning rate K times larger at once (the linear scaling rule)
    --policy none:K@S            the batch K times larger at step S, the learning rate unchanged
    --policy ramp:K@S:T          the batch K times larger at step S, kf.policy.MomentumCompensation
                                 ramps the learning rate over T steps
    --policy autoscale:S         kf.policy.ScalingAutoscaler(threshold=S) (under kungfu-run -w)
    --policy stragglers          kf.policy.StragglerReplacement() (under kungfu-run -w)
    --policy gns:MAX             kf.policy.GNSBatchGrowth(MAX), the learning rate by the sqrt rule
    --policy gns-adascale:MAX    GNSBatchGrowth(MAX) for the batch, kf.policy.AdaScale for the
                                 learning rate
    --policy talk-gns            the KungFu talk's GNS policy: after every step, one worker more
                                 while the noise scale (averaged over the workers) grows (under
                                 kungfu-run -w; asks beyond the job's slots are refused)
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import keras  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from sklearn.model_selection import train_test_split  # noqa: E402

import kungfu as kf  # noqa: E402
from kungfu.policy import (  # noqa: E402
    LoadBalancing,
    MomentumCompensation,
    ScalingAutoscaler,
    StragglerReplacement,
    AdaScale,
    GNSBatchGrowth,
)
from kungfu import elastic  # noqa: E402


class LrOutsideSGD(keras.optimizers.Optimizer):
    """SGD with momentum whose buffer holds gradients and whose learning rate multiplies the
    buffer: v = m v + g, w -= lr v. A larger learning rate scales the whole buffer at once,
    which is what momentum compensation is about (Lin et al.)."""

    def __init__(self, learning_rate=0.01, momentum=0.9, name="lr_outside_sgd", **kwargs):
        super().__init__(learning_rate=learning_rate, name=name, **kwargs)
        self.momentum = momentum

    def get_config(self):
        return {**super().get_config(), "momentum": self.momentum}

    def build(self, variables):
        if self.built:
            return
        super().build(variables)
        self.buffers = [self.add_variable_from_reference(v, "buffer") for v in variables]

    def update_step(self, gradient, variable, learning_rate):
        v = self.buffers[self._get_variable_index(variable)]
        self.assign(v, self.momentum * v + gradient)
        self.assign_sub(variable, learning_rate * v)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--policy", default="bsp")
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=16, help="per worker, at the start")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--optimizer", choices=("keras", "lr-outside"), default="keras",
                   help="keras: keras.optimizers.SGD (the buffer holds lr x gradient); "
                        "lr-outside: v = m v + g, w -= lr v (as PyTorch's and MXNet's SGD)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--hidden", default="64", help="widths of the hidden layers (default 64)")
    p.add_argument("--out", required=True)
    args = p.parse_args()

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int64)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.2,
                                                        random_state=args.seed)
    probe_x, probe_y = x_train[:256], y_train[:256]
    keras.utils.set_random_seed(args.seed)
    model = keras.Sequential([keras.Input((64,))]
                             + [keras.layers.Dense(int(w), activation="relu")
                                for w in args.hidden.split(",")]
                             + [keras.layers.Dense(10)])
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    if args.optimizer == "keras":
        base = keras.optimizers.SGD(args.lr, momentum=args.momentum)
    else:
        base = LrOutsideSGD(args.lr, momentum=args.momentum)
    gns = args.policy.startswith(("gns", "talk-gns"))
    opt = kf.Optimizer(base, monitor="gns" if gns else None)
    model.compile(optimizer=opt, loss=loss, metrics=["accuracy"], jit_compile=False)
    data = kf.ElasticData(x_train, y_train, batch_size=args.batch_size, seed=args.seed)

    policies = []
    kind, _, spec = args.policy.partition(":")
    if kind.startswith("lb-"):
        policies.append(LoadBalancing(predictor=kind[3:]))
    elif kind in ("jump", "none", "ramp"):
        k_at, _, steps = spec.partition(":")
        k, _, at = k_at.partition("@")
        k, at = int(k), int(at)

        class Grow(kf.BasePolicy):
            def after_step(self, state):
                if state.step == at:
                    kf.set_batch_size(k * state.local_batch_size)
                    if kind == "jump":
                        kf.set_learning_rate(k * state.learning_rate)

        policies.append(Grow())
        if kind == "ramp":
            policies.append(MomentumCompensation(steps=int(steps)))
    elif kind == "autoscale":
        policies.append(ScalingAutoscaler(threshold=float(spec or 0.1)))
    elif kind == "gns":
        policies.append(GNSBatchGrowth(int(spec), every_steps=20))
    elif kind == "gns-adascale":
        policies.append(GNSBatchGrowth(int(spec), lr_rule=None, every_steps=20))
        policies.append(AdaScale(base_batch=args.batch_size * kf.size(), base_lr=args.lr))
    elif kind == "stragglers":
        policies.append(StragglerReplacement())
    elif kind == "talk-gns":

        class TalkGNSPolicy(kf.BasePolicy):
            """As printed in the talk, with two fixes: `prev` starts at 0 (the talk's None cannot
            be compared), and NaN (no estimate yet) is not growth (NaN > x is False)."""

            def __init__(self):
                self.prev = 0.0

            def after_step(self):
                gns = kf.grad_noise_scale()
                avg = kf.allreduce(gns, "avg")
                if avg > self.prev:
                    kf.resize(kf.size() + 1)
                self.prev = avg

        policies.append(TalkGNSPolicy())
    elif kind != "bsp":
        raise SystemExit(f"unknown --policy {args.policy!r}")

    # Rank 0 records (it stays rank 0 through resizes; a joiner never becomes rank 0).
    out = open(args.out, "a") if kf.rank() == 0 and not os.environ.get(
        "KUNGFU_ELASTIC_JOINING") else None

    class Record(kf.BasePolicy):  # after the others: sees this step's state
        def after_step(self, state):
            if out is None:
                return
            logits = model(probe_x, training=False)
            out.write(json.dumps({
                "step": state.step, "epoch": state.epoch, "t": time.time(),
                "size": state.cluster_size, "version": elastic.context().current.version
                if elastic.context().enabled else 0,
                "step_time": state.metrics.get("step_time"),
                "compute_times": state.metrics.get("compute_times"),
                "part_sizes": state.metrics.get("part_sizes"),
                "batch_sizes": state.batch_sizes, "lr": state.learning_rate,
                "gns": state.metrics.get("gns"),
                "probe_loss": float(loss(probe_y, logits))}) + "\n")

        def after_epoch(self, state):
            if out is None:
                return
            pred = np.argmax(model(x_test, training=False), axis=1)
            out.write(json.dumps({"epoch_end": state.epoch, "t": time.time(),
                                  "accuracy": float(np.mean(pred == y_test))}) + "\n")
            out.flush()

    hook = kf.Hook(*policies, Record(), data=data)
    model.fit(data.dataset(), epochs=args.epochs, callbacks=[hook], verbose=0)
    if out is not None:
        for p_ in policies:
            if isinstance(p_, ScalingAutoscaler):
                out.write(json.dumps({"autoscaler": p_.trace}) + "\n")
            if isinstance(p_, StragglerReplacement):
                out.write(json.dumps({"replaced": p_.replaced}) + "\n")
        out.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
