"""A numpy trainer for the elastic tests (run under kungfu-run -w): linear regression by SGD on
kf.ElasticData, the gradients averaged over the workers, driven by kungfu._loop.Loop as kf.Hook
and ElasticTrainer drive theirs (the same start, commits, recovery and joins), with no framework
to import: a worker starts in about a second.

    kungfu-run -w -np 3 -H 127.0.0.1:3 -builtin-config-port P python elastic_numpy.py \\
        --out DIR --max-steps 20

Every worker appends one JSON line per step to DIR/<host_port>.jsonl, as elastic_train.py does
(step, epoch, size, rank, pid, t, served, slice, digest), and {"done": ..., "recoveries": ...}
when training ends.

Faults (the worker of RANK in the first cluster; never a joiner), --kill RANK@POINT (repeatable):
  import     SIGKILL before it connects (it never reaches kungfu)
  broadcast  SIGKILL once it connected, as it enters the broadcast of rank 0's initial state
  step       SIGKILL right before its first training step
  S or S+    SIGKILL after its step S (a number), once the Loop is done with it
  S-         SIGKILL after its training step S, before the Loop's agreement of the step
--hang RANK@S stops the worker (SIGSTOP) after its step S instead (--wake-after: continued that
many seconds later); --kill-after-check-in, --kill-after-decision and --kill-while-lending kill
it at those points of a recovery or a resize, as elastic_train.py's options of the same names.
A worker writes {"fault": signal, "at": time} to its records before it faults.

--fail-joiner makes a joiner exit with code 3 at once. --schedule SIZES has rank 0 ask for each
size in turn (--gap steps at the size before), as elastic_train.py's policy does; --tail steps at
the last size end training.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys
import time

# A worker started to join a running job; under kungfu-run -spares, a warm spare always is.
JOINING = (os.environ.get("KUNGFU_ELASTIC_JOINING") == "1"
           or os.environ.get("KUNGFU_SPARE_FD") is not None)
if "--fail-joiner" in sys.argv and os.environ.get("KUNGFU_ELASTIC_JOINING") == "1":
    sys.exit(3)  # a joiner that fails at once
if not JOINING and "--slow-start" in sys.argv:  # RANK:SECONDS, as a framework's import
    _rank, _, _seconds = sys.argv[sys.argv.index("--slow-start") + 1].partition(":")
    if os.environ.get("RANK") == _rank:
        time.sleep(float(_seconds))
if JOINING and "--slow-join" in sys.argv:  # SECONDS: a joiner (or spare) starts this much later
    time.sleep(float(sys.argv[sys.argv.index("--slow-join") + 1]))
if not JOINING and f"{os.environ.get('RANK')}@import" in [
        sys.argv[i + 1] for i, a in enumerate(sys.argv[:-1]) if a == "--kill"]:
    os.kill(os.getpid(), signal.SIGKILL)  # a worker lost before it connected

import numpy as np  # noqa: E402

import kungfu as kf  # noqa: E402
from kungfu import _peer  # noqa: E402
from kungfu._loop import Loop  # noqa: E402
from kungfu.elastic import ElasticData  # noqa: E402
from kungfu.policy import BasePolicy  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/
from numpy_variables import NumpyVariables  # noqa: E402

import _fault  # noqa: E402  (next to this file)


class Trainer(Loop):
    face = "NumpyTrainer"

    def __init__(self, values, *policies, data, before_broadcast=None, checkpoint=None):
        self.values = values
        self.before_broadcast = before_broadcast
        super().__init__(*policies, data=data, name="numpy", checkpoint=checkpoint)

    def _binding(self):
        return NumpyVariables(self.values)

    def after_train(self):
        super().after_train()
        self._exit_if_detached()  # as kf.Hook's: a worker left out leaves with exit code 0

    def _start_equal(self):
        if _peer.identity().size > 1:
            if self.before_broadcast is not None:
                self.before_broadcast()
            for i, v in enumerate(self.values):
                v[...] = kf.broadcast(v, name=f"numpy/start/{i}")


class Schedule(BasePolicy):
    """Rank 0 asks for each size in turn once the previous change is done and `gap` steps have
    passed at that size; `tail` steps at the last size set `stop`."""

    def __init__(self, sizes, gap, tail):
        self.sizes, self.gap, self.tail = sizes, gap, tail
        self.next, self.size_seen, self.since, self.stop = 0, None, 0, False

    def after_step(self, state):
        if state.cluster_size != self.size_seen:
            self.size_seen, self.since = state.cluster_size, 0
        self.since += 1
        if self.next < len(self.sizes):
            if self.since >= self.gap and state.cluster_size == (
                    self.sizes[self.next - 1] if self.next else state.cluster_size):
                if kf.rank() == 0:
                    kf.resize(self.sizes[self.next])
                self.next += 1
        elif state.cluster_size == self.sizes[-1] and self.since >= self.tail:
            self.stop = True


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--samples", type=int, default=240)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-steps", type=int, default=20)
    p.add_argument("--step-sleep", type=float, default=0.02)
    p.add_argument("--kill", action="append", default=[], metavar="RANK@POINT")
    p.add_argument("--hang", default="", metavar="RANK@STEP")
    p.add_argument("--wake-after", type=float, default=0.0)
    p.add_argument("--kill-after-check-in", default="", metavar="RANK")
    p.add_argument("--kill-after-decision", default="", metavar="RANK")
    p.add_argument("--kill-while-lending", default="", metavar="RANK")
    p.add_argument("--pause-pid", type=int, default=0,
                   help="a worker that faults first stops this process (SIGSTOP) for "
                        "--pause-seconds (the config store, to test an outage)")
    p.add_argument("--pause-seconds", type=float, default=3.0)
    p.add_argument("--schedule", default="", metavar="SIZES")
    p.add_argument("--gap", type=int, default=3)
    p.add_argument("--tail", type=int, default=4)
    p.add_argument("--checkpoint", help="the Loop's checkpoint file (resumed from if there)")
    p.add_argument("--hold-record", default="", metavar="RANK@STEP",
                   help="the worker of this rank (in the first cluster) waits 60 s between this "
                        "step and its record (as one descheduled on a loaded machine, but long "
                        "enough to be killed meanwhile)")
    p.add_argument("--slow-start", default="", metavar="RANK:SECONDS",
                   help="the worker of this rank (in the first cluster) starts this much later "
                        "(as one that imports a framework on a loaded machine)")
    p.add_argument("--slow-join", type=float, default=0.0,
                   help="a joiner starts this much later (as one that imports a framework)")
    p.add_argument("--fail-joiner", action="store_true",
                   help="a joining worker exits with code 3 at once (a joiner that fails)")
    p.add_argument("--no-guard", action="store_true",
                   help="train without trainer.guard: a job that cannot recover")
    p.add_argument("--stop-at-version", default="", metavar="V:N",
                   help="stop N steps after the first step at cluster version V or later")
    args = p.parse_args()
    held = args.hold_record.partition("@")
    stop_version, stop_after = (int(v) for v in (args.stop_at_version or "-1:0").split(":"))
    stop_at = None  # the step to stop after, once version V was seen
    first_rank = str(kf.rank())  # in the first cluster (read before anything connects)
    name = os.environ.get("KUNGFU_SELF_SPEC", "single").replace(":", "_")
    out = open(os.path.join(args.out, f"{name}.jsonl"), "a")
    kills = {point for victim, _, point in (k.partition("@") for k in args.kill)
             if victim == first_rank}

    def mine(what):
        return not JOINING and what in kills

    def mine_rank(flag):
        return not JOINING and flag == first_rank

    def fault(sig=signal.SIGKILL):
        _fault.fault(out, sig, args.pause_pid, args.pause_seconds, args.wake_after)

    def connect_and_die():
        _peer.get()
        fault()

    rng = np.random.default_rng(0)
    x = rng.standard_normal((args.samples, 8)).astype(np.float32)
    y = (x @ np.linspace(-1, 1, 8).astype(np.float32))[:, None]
    # Each worker starts from its own weights: training starts from rank 0's.
    seed = int(os.environ.get("KUNGFU_SELF_SPEC", "x:0").rpartition(":")[2])
    w = np.random.default_rng(seed).standard_normal((8, 1)).astype(np.float32)
    values = [w]
    data = ElasticData(x, y, batch_size=args.batch_size, seed=2, record=True)
    sizes = [int(n) for n in args.schedule.split(",") if n]
    policies = [Schedule(sizes, args.gap, args.tail)] if sizes else []
    trainer = Trainer(values, *policies, data=data, checkpoint=args.checkpoint,
                      before_broadcast=connect_and_die if mine("broadcast") else None)
    if mine_rank(args.kill_while_lending):
        binding = trainer.membership.variables
        lend = binding.lend

        def lend_and_die(variables, names):
            lend(variables, names)
            fault()  # lent: the joiners are about to request them

        binding.lend = lend_and_die
    if mine_rank(args.kill_after_check_in):
        store = kf.elastic.context().store
        mark_alive = store.mark_alive

        def check_in_and_die(*a, **kw):
            mark_alive(*a, **kw)
            fault()  # the others saw it alive: its launcher now says it died

        store.mark_alive = check_in_and_die
    if mine_rank(args.kill_after_decision):
        def die_instead(*a, **kw):  # Elastic.recover swaps in the agreed cluster's peer here
            fault()

        _peer.replace = die_instead

    def train_step(bx, by, bw):
        err = (bx @ values[0] - by) * bw[:, None]
        grad = kf.allreduce(bx.T @ err / max(len(bx), 1), op="avg", name="numpy/grad")
        values[0] -= 0.05 * grad
        return float((err ** 2).mean())

    step = train_step if args.no_guard else trainer.guard(train_step)
    trainer.before_train()
    done = False
    while not done:
        trainer.before_epoch()
        for bx, by, bw in data.epoch_batches():
            if mine("step") and trainer.state.step == 0:
                fault()
            trainer.before_step()
            version = kf.elastic.context().current.version
            loss = step(bx, by, bw)
            if mine(f"{trainer.state.step + 1}-"):
                fault()
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
            if mine(str(s.step)) or mine(f"{s.step}+"):
                kills.discard(str(s.step))
                kills.discard(f"{s.step}+")
                fault()
            if not JOINING and args.hang == f"{first_rank}@{s.step}":
                args.hang = ""
                fault(signal.SIGSTOP)
            time.sleep(args.step_sleep)
            if stop_version >= 0 and version >= stop_version and stop_at is None:
                stop_at = s.step + stop_after
            # A worker a shrink left out stops here, as kf.Hook stops model.fit.
            if s.step >= min(args.max_steps, stop_at or args.max_steps) or \
                    (policies and policies[0].stop) or trainer.detached:
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
