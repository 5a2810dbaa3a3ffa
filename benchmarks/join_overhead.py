"""What kf.JoinCallback costs a model.fit step when no worker runs out of data early.

    python benchmarks/join_overhead.py [--np 2] [--rounds 8] [--steps 40] [--model mlp]

Starts one `kungfu-run -np N` job. Every worker builds two copies of one model (the same
weights, kf.Optimizer), and the two take turns, round by round (the first copy starts in even
rounds, the second in odd ones): one epoch of --steps batches of 32 digits (scikit-learn's) with
`callbacks=[kf.JoinCallback()]`, one without. Inside the Join block each step's allreduce is
described to the others first (a small asynchronous allgather and a tf.numpy_function per
allreduce); this measures that cost. A warm-up epoch of each copy (tracing) is not counted.

Prints one JSON line per round and arm (`arm`, `round`, `step_ms`: rank 0's time from the end of
the epoch's first step to the epoch's end, the join and the broadcast of the last joined rank's
model included, over the steps after the first), then a summary line: the median step time of each arm, their [min, max], and
overhead = median(join) / median(plain) - 1.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


def _worker(args) -> None:
    import numpy as np
    import keras
    import tensorflow as tf
    from sklearn.datasets import load_digits

    import kungfu as kf

    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype("float32")
    r = kf.rank()
    rng = np.random.default_rng(r)
    idx = rng.integers(0, len(x), 32 * args.steps)
    data = tf.data.Dataset.from_tensor_slices((x[idx], y[idx])).batch(32)

    def model():
        keras.utils.set_random_seed(0)
        width = 512 if args.model == "wide" else 64
        m = keras.Sequential([keras.Input((64,)), keras.layers.Dense(width, activation="relu"),
                              keras.layers.Dense(width, activation="relu"),
                              keras.layers.Dense(10)])
        m.compile(optimizer=kf.Optimizer(keras.optimizers.SGD(0.05)),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return m

    arms = {"plain": (model(), lambda: []), "join": (model(), lambda: [kf.JoinCallback()])}

    class Clock(keras.callbacks.Callback):
        """From the end of the epoch's first step to its end (the join and the model's
        broadcast included, a fit's start and a tracing not)."""

        def on_train_batch_end(self, batch, logs=None):
            if batch == 0:
                self.start = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            self.seconds = time.perf_counter() - self.start

    def epoch(arm: str) -> float:
        m, callbacks = arms[arm]
        clock = Clock()
        m.fit(data, epochs=1, verbose=0, callbacks=callbacks() + [clock])
        return clock.seconds

    for arm in arms:
        epoch(arm)  # tracing
    for rnd in range(args.rounds):
        order = list(arms) if rnd % 2 == 0 else list(arms)[::-1]
        for arm in order:
            seconds = epoch(arm)
            if r == 0:
                print("RESULT " + json.dumps({"arm": arm, "round": rnd, "np": kf.size(),
                                              "model": args.model,
                                              "step_ms": 1e3 * seconds / (args.steps - 1)}),
                      flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--np", type=int, default=2, help="workers (default 2)")
    p.add_argument("--rounds", type=int, default=8, help="epochs of each arm (default 8)")
    p.add_argument("--steps", type=int, default=40, help="steps an epoch (default 40)")
    p.add_argument("--model", choices=("mlp", "wide"), default="mlp",
                   help="mlp: 64-64-64-10 (4.9k parameters); wide: 64-512-512-10 (301k)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        _worker(args)
        return
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [REPO] + [v for v in [os.environ.get("PYTHONPATH")] if v]))
    cmd = [sys.executable, "-m", "kungfu.cmd", "-np", str(args.np), sys.executable,
           os.path.abspath(__file__), "--worker", "--rounds", str(args.rounds), "--steps",
           str(args.steps), "--model", args.model]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)
    rows = [json.loads(line.split("RESULT ", 1)[1]) for line in out.stdout.splitlines()
            if "RESULT " in line]
    if out.returncode != 0 or not rows:
        sys.stderr.write(out.stdout[-3000:] + out.stderr[-3000:])
        sys.exit(out.returncode or 1)
    for row in rows:
        print(json.dumps(row))
    times = {arm: sorted(r["step_ms"] for r in rows if r["arm"] == arm) for arm in ("plain",
                                                                                    "join")}

    def median(v):
        return (v[(len(v) - 1) // 2] + v[len(v) // 2]) / 2

    print(json.dumps({"summary": True, "np": args.np, "model": args.model,
                      **{f"{a}_ms": round(median(v), 3) for a, v in times.items()},
                      **{f"{a}_range_ms": [round(v[0], 3), round(v[-1], 3)]
                         for a, v in times.items()},
                      "overhead": round(median(times["join"]) / median(times["plain"]) - 1, 4)}))


if __name__ == "__main__":
    main()
