"""A worker of the emulated cluster (emulated.py runs it under kungfu-run): numpy only.

Its compute is an emulated accelerator (_emulator.Device): a step on p samples sleeps the
device's time for p at this worker's slowness (_emulator.Speeds), less what the real compute
took. The real compute is small: a digits MLP (64-H-10, numpy) whose gradients are real and
are really allreduced (one fused float32 buffer through kungfu's runtime), so the gradient noise
scale is measured, not assumed. After the real allreduce the worker sleeps what the allreduce
of a large model's gradients would take (_emulator.Link), when one is given. Everything else is
kungfu's: kungfu-run, the Loop that drives the policies (kungfu._loop, as kf.Hook and
kungfu.torch's ElasticTrainer), kf.ElasticData, resize, recovery, warm spares, checkpoints.

Progress is counted by Pollux's statistical efficiency (_emulator.Progress, fed by the measured
noise scale): training stops at the step where it reaches --target (the same step on every
worker: everything it depends on is global). Whoever is rank 0 appends one JSON line per step
to --out, and at the end one line with the policies' decisions and the test accuracy.

--real: no emulation: the MLP's compute is the step (calibration: --hidden 1024,1024).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _emulator import Device, Link, NoiseScale, Progress, Speeds  # noqa: E402

from kungfu import _collective, _peer  # noqa: E402
from kungfu._loop import Loop  # noqa: E402
from kungfu.elastic import ElasticData, Variables, context, set_batch_size  # noqa: E402
from kungfu.policy import (  # noqa: E402
    BasePolicy,
    GNSBatchGrowth,
    LoadBalancing,
    ScalingAutoscaler,
    StragglerReplacement,
)


class Arrays(Variables):
    """Variables that are numpy arrays, changed in place."""

    def __init__(self, arrays):
        self._arrays = arrays

    def synced(self):
        return list(self._arrays)

    def snapshot(self, variables):
        return [v.copy() for v in variables]

    def restore(self, variables, snapshot):
        for v, s in zip(variables, snapshot):
            np.copyto(v, s)

    def arrays(self, snapshot):
        return [s.copy() for s in snapshot]

    def load(self, variables, arrays):
        for v, a in zip(variables, arrays):
            np.copyto(v, np.asarray(a, v.dtype).reshape(v.shape))

    def describe(self, variables):
        return [(f"v{i}", tuple(v.shape), str(v.dtype)) for i, v in enumerate(variables)]

    def lend(self, variables, names):
        for name, v in zip(names, variables):
            _collective.save(name, v)

    def borrow(self, variables, names):
        for name, v in zip(names, variables):
            np.copyto(v, _collective.request(0, name, like=v))

    def unlend(self, names):
        for name in names:
            _collective.drop(name)


class Sgd:
    """SGD with momentum over the MLP's arrays; the Loop reads its learning rate and the wait
    of its last allreduce (to tell a worker's compute from its wait for the others)."""

    def __init__(self, lr, momentum):
        self.lr, self.momentum = lr, momentum
        self.kungfu_allreduce_wait = math.nan


class Trainer(Loop):
    face = "the emulated worker"

    def __init__(self, arrays, opt, *policies, data, checkpoint=None, checkpoint_every=100):
        self.arrays = arrays
        self.measured = None  # the last step's global gradient statistics
        super().__init__(*policies, data=data, optimizer=opt, name="emu",
                         checkpoint=checkpoint, checkpoint_every=checkpoint_every,
                         cluster_logs=False)

    def _binding(self):
        return Arrays(self.arrays)

    def _learning_rate(self, bits=64):
        lr = self.optimizer.lr
        return float(np.float32(lr)) if bits == 32 else float(lr)

    def _set_learning_rate(self, lr):
        self.optimizer.lr = lr

    def _start_equal(self):
        if _peer.identity().size > 1:
            for i, a in enumerate(self.arrays):
                np.copyto(a, _collective.broadcast(a, 0, name=f"emu/start/{i}"))


class Monitor(BasePolicy):
    """The noise scale from the step's measured squared norms (the same on every worker), and
    the progress it makes; both in the policies' state, so joiners and rollbacks keep them."""

    def __init__(self, trainer, base, target, global_batch=None):
        self.trainer = trainer
        self.global_batch = global_batch  # kept at every size (strong scaling), or None
        self.gns = NoiseScale(0.9)
        self.progress = Progress(base, target)
        self.seen = 0

    def state_dict(self):
        return {"g2": self.gns.g2, "trace": self.gns.trace, "done": self.progress.done,
                "seen": self.seen}

    def load_state_dict(self, s):
        self.gns.g2, self.gns.trace = s["g2"], s["trace"]
        self.progress.done, self.seen = s["done"], s["seen"]

    def after_step(self, state):
        m = self.trainer.measured
        if m is not None:
            self.gns.update(*m)
        phi = self.gns.value
        state.metrics["gns"] = phi
        state.metrics["grad_noise_stats"] = (self.gns.trace or math.nan, self.gns.g2 or math.nan)
        samples = state.samples_seen - self.seen
        self.seen = state.samples_seen
        if samples > 0:
            self.progress.add(samples, phi)
        if self.global_batch and state.local_batch_size != self.global_batch // \
                state.cluster_size:
            set_batch_size(self.global_batch // state.cluster_size)


def mlp(widths, seed):
    rng = np.random.default_rng(seed)
    out = []
    for a, b in zip(widths, widths[1:]):
        out += [(rng.standard_normal((a, b)) * np.sqrt(2.0 / a)).astype(np.float32),
                np.zeros(b, np.float32)]
    return out


def grads(params, x, y, w):
    """The gradient of the weighted mean cross-entropy of the MLP on (x, y), as one vector."""
    acts = [x]
    for i in range(0, len(params), 2):
        z = acts[-1] @ params[i] + params[i + 1]
        acts.append(np.maximum(z, 0) if i + 2 < len(params) else z)
    z = acts[-1] - acts[-1].max(axis=1, keepdims=True)
    p = np.exp(z)
    p /= p.sum(axis=1, keepdims=True)
    p[np.arange(len(y)), y] -= 1
    d = p * (w / len(y))[:, None]
    out = []
    for i in range(len(params) - 2, -1, -2):
        out = [acts[i // 2].T @ d, d.sum(axis=0)] + out
        if i:
            d = (d @ params[i].T) * (acts[i // 2] > 0)
    return np.concatenate([g.ravel() for g in out])


def load(seed, copies):
    from sklearn.datasets import load_digits

    d = load_digits()
    x = (d.data / 16.0).astype(np.float32)
    y = d.target.astype(np.int64)
    rng = np.random.default_rng(seed)
    idx = rng.permutation(len(x))
    test, train = idx[:360], idx[360:]
    # More samples than digits has: copies with a little noise, so that an epoch spans many
    # steps of a large global batch (epoch ends are rare, as in a large data set).
    xs = [x[train]] + [np.clip(x[train] + rng.normal(0, 0.05, x[train].shape), 0, 1)
                       .astype(np.float32) for _ in range(copies - 1)]
    return np.concatenate(xs), np.tile(y[train], copies), x[test], y[test]


def build_policies(spec, args):
    kind, _, arg = spec.partition(":")
    if kind in ("none", ""):
        return []
    if kind == "autoscaler":
        return [ScalingAutoscaler(threshold=float(arg or 0.1), step=args.probe_step,
                                  window=args.window, settle=args.settle)]
    if kind == "stragglers":
        return [StragglerReplacement()]
    if kind == "lbbsp":
        return [LoadBalancing(predictor=arg or "ewma")]
    if kind in ("gns", "gns-goodput"):
        return [GNSBatchGrowth(int(arg), every_steps=args.window,
                               goodput=kind == "gns-goodput")]
    raise SystemExit(f"unknown --policy {spec!r}")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--policy", default="none")
    p.add_argument("--device", default="0.02,0.001", help="FIXED,PER_SAMPLE[,SATURATION]")
    p.add_argument("--speeds", default="", help="RANK:FACTOR[@STEP],...")
    p.add_argument("--link", default="", help="BYTES,INTRA_Bps,INTER_Bps,PER_HOST[,ALPHA]")
    p.add_argument("--scale", type=float, default=1.0, help="emulated seconds -> wall seconds")
    p.add_argument("--startup", type=float, default=0.0, help="emulated start-up seconds")
    p.add_argument("--batch-size", type=int, default=32, help="per worker")
    p.add_argument("--base-batch", type=int, default=32)
    p.add_argument("--global-batch", type=int, help="keep it at every size (strong scaling)")
    p.add_argument("--target", type=float, default=1e5, help="base-batch samples of progress")
    p.add_argument("--max-steps", type=int, default=100000)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--hidden", default="64")
    p.add_argument("--copies", type=int, default=16)
    p.add_argument("--window", type=int, default=10)
    p.add_argument("--settle", type=int, default=5)
    p.add_argument("--probe-step", type=int, default=1)
    p.add_argument("--checkpoint")
    p.add_argument("--checkpoint-every", type=int, default=100)
    p.add_argument("--pid-dir")
    p.add_argument("--real", action="store_true")
    p.add_argument("--no-compute", action="store_true",
                   help="calibration: allreduce zeros of the model's size, compute nothing")
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args()

    if args.pid_dir:
        Path(args.pid_dir, str(os.getpid())).write_text("")
    if args.startup > 0:  # the device's and framework's start-up (before the first step)
        time.sleep(args.startup * args.scale)
    device = Device.parse(args.device)
    speeds = Speeds.parse(args.speeds)
    link = Link.parse(args.link) if args.link else None
    started_as = None if _peer.started_as_joiner() else _peer.identity_from_env().rank

    x, y, x_test, y_test = load(args.seed, args.copies)
    params = mlp([64] + [int(h) for h in args.hidden.split(",")] + [10], args.seed)
    velocity = [np.zeros_like(a) for a in params]
    opt = Sgd(args.lr, 0.9)
    data = ElasticData(x, y, batch_size=args.batch_size, seed=args.seed)
    policies = build_policies(args.policy, args)
    holder = {}
    monitor = Monitor(None, args.base_batch, args.target, args.global_batch)
    trainer = Trainer(params + velocity, opt, monitor, *policies, data=data,
                      checkpoint=args.checkpoint, checkpoint_every=args.checkpoint_every)
    monitor.trainer = trainer
    out = {"file": None}

    def record(row):
        if trainer.state.rank != 0 or trainer.detached:
            return
        if out["file"] is None:
            out["file"] = open(args.out, "a")
        out["file"].write(json.dumps(row) + "\n")
        out["file"].flush()

    sizes = [a.size for a in params]

    def train_step(xb, yb, wb):
        t0, c0 = time.perf_counter(), time.thread_time()
        n = trainer.state.cluster_size
        part = int(len(xb) * (wb.sum() > 0))
        buf = np.zeros(sum(sizes) + 3, np.float32)
        if part and not args.no_compute:
            # Two halves: the gradient of the part, and squared norms at half the batch for
            # the noise scale (one forward and backward pass over the part in all).
            h = max(part // 2, 1)
            g1 = grads(params, xb[:h], yb[:h], wb[:h])
            if part - h:
                g2 = grads(params, xb[h:part], yb[h:part], wb[h:part])
                buf[:-3] = (h * g1 + (part - h) * g2) / part
                buf[-3:] = [(g1 @ g1 + g2 @ g2) / 2, 1.0, part / 2]
            else:
                buf[:-3] = g1
        holder["cpu"] = time.thread_time() - c0  # this worker's real compute, in CPU seconds
        holder["compute"] = time.perf_counter() - t0  # ... and as the clock saw it
        if not args.real:
            speed = speeds.factor(started_as, trainer.state.step)
            rest = device.step_time(part, speed) * args.scale - (time.perf_counter() - t0)
            if rest > 0:
                time.sleep(rest)
        ta = time.perf_counter()
        total = _collective.allreduce(buf, "sum", name="emu/grad")
        if link is not None and not args.real:
            time.sleep(link.allreduce_time(n) * args.scale)
        opt.kungfu_allreduce_wait = time.perf_counter() - ta
        g = total[:-3] / n
        if total[-2] > 0:
            trainer.measured = (float(total[-3] / total[-2]), float(total[-1] / total[-2]),
                                float(g @ g), float(trainer.data.last_length or part * n))
        else:
            trainer.measured = None
        at = 0
        for a, v in zip(params, velocity):
            v *= opt.momentum
            v -= opt.lr * g[at:at + a.size].reshape(a.shape)
            a += v
            at += a.size

    step = trainer.guard(train_step)
    trainer.before_train()
    t_start = time.time()
    stop = False
    while not stop and not trainer.detached:
        trainer.before_epoch()
        for xb, yb, wb in data.epoch_batches():
            trainer.before_step()
            step(xb, yb, wb)
            trainer.after_step({})
            s = trainer.state
            stop = monitor.progress.reached or s.step >= args.max_steps
            record({"step": s.step, "t": time.time(), "size": s.cluster_size,
                    "batch": s.global_batch_size, "sizes": s.batch_sizes,
                    "progress": monitor.progress.done, "gns": s.metrics.get("gns"),
                    "step_time": s.metrics.get("step_time"), "cpu": holder.get("cpu"),
                    "compute": holder.get("compute"),
                    "compute_times": s.metrics.get("compute_times"),
                    "version": context().current.version if context().enabled else 0})
            if stop or trainer.detached:
                break
        trainer.after_epoch({})
    trainer.after_train()
    if not trainer.detached:
        acts = x_test
        for i in range(0, len(params), 2):
            acts = acts @ params[i] + params[i + 1]
            acts = np.maximum(acts, 0) if i + 2 < len(params) else acts
        acc = float(np.mean(acts.argmax(axis=1) == y_test))
        decisions = {}
        for pol in policies:
            for attr in ("trace", "replaced", "decisions"):
                if hasattr(pol, attr):
                    decisions[type(pol).__name__] = getattr(pol, attr)
        record({"done": True, "steps": trainer.state.step, "t": time.time(),
                "t_start": t_start, "reached": monitor.progress.reached,
                "progress": monitor.progress.done, "accuracy": acc, "decisions": decisions,
                "recoveries": len(trainer.recoveries)})
    trainer._exit_if_detached()
    return 0


if __name__ == "__main__":
    sys.exit(main())
