"""A numpy trainer for the elastic tests (run under kungfu-run -w): linear regression by SGD on
kf.ElasticData, the gradients averaged over the workers, driven by kungfu._loop.Loop as kf.Hook
and ElasticTrainer drive theirs (the same start, commits, recovery and joins), with no framework
to import: a worker starts in about a second.

    kungfu-run -w -np 3 -H 127.0.0.1:3 -builtin-config-port P python elastic_numpy.py \\
        --out DIR --max-steps 20

Every worker appends one JSON line per step to DIR/<host_port>.jsonl, as elastic_train.py does
(step, epoch, size, rank, pid, t, served, slice, digest), and {"done": ..., "recoveries": ...}
when training ends.

Faults (the worker of RANK in the first cluster; never a joiner), --kill RANK@POINT:
  import     SIGKILL before it connects (it never reaches kungfu)
  broadcast  SIGKILL once it connected, as it enters the broadcast of rank 0's initial state
  step       SIGKILL right before its first training step
  S          SIGKILL after its step S (a number), once the Loop is done with it
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys
import time

JOINING = os.environ.get("KUNGFU_ELASTIC_JOINING") == "1"
if not JOINING and "--slow-start" in sys.argv:  # RANK:SECONDS, as a framework's import
    _rank, _, _seconds = sys.argv[sys.argv.index("--slow-start") + 1].partition(":")
    if os.environ.get("RANK") == _rank:
        time.sleep(float(_seconds))
if not JOINING and "--kill" in sys.argv and \
        sys.argv[sys.argv.index("--kill") + 1] == f"{os.environ.get('RANK')}@import":
    os.kill(os.getpid(), signal.SIGKILL)  # a worker lost before it connected

import numpy as np  # noqa: E402

import kungfu as kf  # noqa: E402
from kungfu import _peer  # noqa: E402
from kungfu._loop import Loop  # noqa: E402
from kungfu.elastic import ElasticData  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/
from numpy_variables import NumpyVariables  # noqa: E402


class Trainer(Loop):
    face = "NumpyTrainer"

    def __init__(self, values, *policies, data, before_broadcast=None):
        self.values = values
        self.before_broadcast = before_broadcast
        super().__init__(*policies, data=data, name="numpy")

    def _binding(self):
        return NumpyVariables(self.values)

    def _start_equal(self):
        if _peer.identity().size > 1:
            if self.before_broadcast is not None:
                self.before_broadcast()
            for i, v in enumerate(self.values):
                v[...] = kf.broadcast(v, name=f"numpy/start/{i}")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--samples", type=int, default=240)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-steps", type=int, default=20)
    p.add_argument("--step-sleep", type=float, default=0.02)
    p.add_argument("--kill", default="", metavar="RANK@POINT")
    p.add_argument("--hold-record", default="", metavar="RANK@STEP",
                   help="the worker of this rank (in the first cluster) waits 60 s between this "
                        "step and its record (as one descheduled on a loaded machine, but long "
                        "enough to be killed meanwhile)")
    p.add_argument("--slow-start", default="", metavar="RANK:SECONDS",
                   help="the worker of this rank (in the first cluster) starts this much later "
                        "(as one that imports a framework on a loaded machine)")
    p.add_argument("--no-guard", action="store_true",
                   help="train without trainer.guard: a job that cannot recover")
    p.add_argument("--stop-at-version", default="", metavar="V:N",
                   help="stop N steps after the first step at cluster version V or later")
    args = p.parse_args()
    held = args.hold_record.partition("@")
    stop_version, stop_after = (int(v) for v in (args.stop_at_version or "-1:0").split(":"))
    stop_at = None  # the step to stop after, once version V was seen
    victim, _, point = args.kill.partition("@")
    first_rank = str(kf.rank())  # in the first cluster (read before anything connects)

    def mine(what):
        return not JOINING and point == what and victim == first_rank

    def die():
        os.kill(os.getpid(), signal.SIGKILL)

    def connect_and_die():
        _peer.get()
        die()

    rng = np.random.default_rng(0)
    x = rng.standard_normal((args.samples, 8)).astype(np.float32)
    y = (x @ np.linspace(-1, 1, 8).astype(np.float32))[:, None]
    # Each worker starts from its own weights: training starts from rank 0's.
    seed = int(os.environ.get("KUNGFU_SELF_SPEC", "x:0").rpartition(":")[2])
    w = np.random.default_rng(seed).standard_normal((8, 1)).astype(np.float32)
    values = [w]
    data = ElasticData(x, y, batch_size=args.batch_size, seed=2, record=True)
    trainer = Trainer(values, data=data, before_broadcast=connect_and_die if mine("broadcast") else None)

    def train_step(bx, by, bw):
        err = (bx @ values[0] - by) * bw[:, None]
        grad = kf.allreduce(bx.T @ err / max(len(bx), 1), op="avg", name="numpy/grad")
        values[0] -= 0.05 * grad
        return float((err ** 2).mean())

    step = train_step if args.no_guard else trainer.guard(train_step)
    name = os.environ.get("KUNGFU_SELF_SPEC", "single").replace(":", "_")
    out = open(os.path.join(args.out, f"{name}.jsonl"), "a")
    trainer.before_train()
    done = False
    while not done:
        trainer.before_epoch()
        for bx, by, bw in data.epoch_batches():
            if mine("step") and trainer.state.step == 0:
                die()
            trainer.before_step()
            version = kf.elastic.context().current.version
            loss = step(bx, by, bw)
            trainer.after_step({"loss": loss})
            s = trainer.state
            if (held[0], held[2]) == (first_rank, str(s.step)) and not JOINING:
                time.sleep(60)
            out.write(json.dumps({
                "step": s.step, "epoch": s.epoch, "size": kf.size(), "rank": kf.rank(),
                "pid": os.getpid(), "t": time.time(), "loss": loss,
                "served": data.served[-1].tolist() if data.served else [],
                "slice": [data.offset - data.last_length, data.last_length],
                "digest": hashlib.sha256(values[0].tobytes()).hexdigest()}) + "\n")
            out.flush()
            if mine(str(s.step)):
                die()
            time.sleep(args.step_sleep)
            if stop_version >= 0 and version >= stop_version and stop_at is None:
                stop_at = s.step + stop_after
            if s.step >= min(args.max_steps, stop_at or args.max_steps):
                done = True
                break
        if not done:
            trainer.after_epoch()
    trainer.after_train()
    out.write(json.dumps({"done": True, "step": trainer.state.step, "size": kf.size(),
                          "recoveries": trainer.recoveries}) + "\n")
    out.close()


if __name__ == "__main__":
    main()
