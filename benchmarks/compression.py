"""fp16 gradient compression (kf.Optimizer(compression="fp16")): its speed and its error.

    kungfu-run -np 2 python benchmarks/compression.py [--rounds 3] [--iters 10]

Averages ResNet-50's gradient set (214 float32 tensors, 97.6 MiB; benchmarks/resnet50_sizes.json)
over the workers the way kf.Optimizer does (one group allreduce per dtype inside a tf.function),
without compression and with fp16, the two arms interleaved round by round. Prints one JSON
line per arm and round (ms per average, the bytes each worker sends into the allreduce) and,
once, the error of the fp16 result against the float32 one: the largest absolute error relative
to the largest gradient element, and the relative error of the whole set (L2).

The accuracy of a real training run with and without compression:

    kungfu-run -np 4 python examples/keras_digits.py --compression fp16
"""
from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import kungfu as kf  # noqa: E402
from kungfu.tensorflow.optimizers._fusion import mean_over_workers  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    ap.add_argument("--iters", type=int, default=10, help="timed averages per arm and round")
    ap.add_argument("--warmup", type=int, default=2, help="untimed averages before each arm")
    return ap.parse_args(argv)


def gradients(rank: int):
    spec = json.load(open(os.path.join(HERE, "resnet50_sizes.json")))
    rng = np.random.default_rng(rank)
    # Gradient-like magnitudes: most elements small, a few larger.
    return [tf.constant(rng.standard_normal(t["shape"]).astype(np.float32) * 1e-3)
            for t in spec["tensors"]]


def main(argv=None) -> int:
    args = parse_args(argv)
    rank, size = kf.rank(), kf.size()
    grads = gradients(rank)
    nbytes = sum(int(np.prod(g.shape)) * 4 for g in grads)
    arms = {}
    for arm in ("none", "fp16"):
        arms[arm] = tf.function(
            lambda arm=arm: mean_over_workers(grads, f"bench/{arm}", None, None,
                                              None if arm == "none" else arm),
            autograph=False)
    full = [t.numpy() for t in arms["none"]()]
    half = [t.numpy() for t in arms["fp16"]()]
    top = max(float(np.abs(f).max()) for f in full)
    max_err = max(float(np.abs(h - f).max()) for h, f in zip(half, full))
    l2 = np.sqrt(sum(float(((h - f).astype(np.float64) ** 2).sum()) for h, f in zip(half, full)))
    norm = np.sqrt(sum(float((f.astype(np.float64) ** 2).sum()) for f in full))
    if rank == 0:
        print(json.dumps({"bench": "compression", "np": size, "what": "error",
                          "max_abs_error_over_max": max_err / top, "l2_relative_error": l2 / norm}),
              flush=True)
    for r in range(args.rounds):
        for arm in (("none", "fp16") if r % 2 == 0 else ("fp16", "none")):
            for _ in range(args.warmup):
                arms[arm]()
            kf.barrier(name=f"bench/{arm}/{r}")
            times = []
            for _ in range(args.iters):
                t0 = time.perf_counter()
                arms[arm]()
                times.append(time.perf_counter() - t0)
            if rank == 0:
                print(json.dumps({"bench": "compression", "np": size, "arm": arm, "round": r,
                                  "ms_median": 1e3 * float(np.median(times)),
                                  "ms_min": 1e3 * float(np.min(times)),
                                  "bytes_sent": nbytes // 2 if arm == "fp16" else nbytes}),
                      flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
