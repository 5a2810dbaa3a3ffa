"""Worker of benchmarks/resize_latency.py (the driver starts it through kungfu-run; see there).

Trains a ~25M-parameter stack of Dense layers with model.fit on synthetic regression data
(kf.ElasticData, batch --batch-size per worker) and appends one JSON object per event to
OUT/<tag>-<port>-<pid>.jsonl, every timestamp from time.time() (one host: comparable across
processes):

  {"ev": "proc", ...}    once, at the start of fit: t_proc (the process's start, from
                         /proc/self/stat), t_main (this file starts running), t_imported
                         (TensorFlow, keras and kungfu imported), t_model (data made, model
                         compiled, optimizer built), t_built (checkpoint restored, if any),
                         t_fit (model.fit's on_train_begin, before kf.Hook: a joiner has not
                         connected yet), joining
  {"ev": "rehearsed"}    a joiner, when kf.Hook ran its training step alone (t0, t1); it
                         reports ready right after
  {"ev": "joined", ...}  a joiner, after kf.Hook connected it and synced rank 0's state
  {"ev": "step", ...}    every step: step, epoch, rank, size (during the step), size_after (after
                         kf.Hook's after_step, which may have resized), t_begin
                         (on_train_batch_begin, before kf.Hook), t_end (on_train_batch_end,
                         before kf.Hook), t_hook (after kf.Hook's after_step)
  {"ev": "ask", ...}     rank 0, when the policy calls kf.resize(n): t, step, from, to
  {"ev": "save", ...}    rank 0, the checkpoint written at the end: t0, t1, path, bytes
  {"ev": "abandoned"}    rank 0, a request to grow was abandoned or lost (the job then stops)
  {"ev": "end", ...}     after model.fit returned; then the process leaves with os._exit(0)
                         (--plain-exit: a normal interpreter exit)

--mode elastic (under kungfu-run -w): start at --small workers; after --warm steps rank 0 asks
for --big; --gap steps after the switch it asks for --small again; --gap steps and at least
--min-gap-seconds after that switch it asks for --big again; --cycles such round trips, then
--tail steps at --small and stop (writing the checkpoint to --save if given).
--mode restart (under plain kungfu-run -np N): restore --restore (model weights and optimizer
state, tf.train.Checkpoint; every worker reads the file), train --steps steps, write --save if
given, stop.
"""
from __future__ import annotations

import time

T_MAIN = time.time()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


def process_start_time() -> float:
    """This process's start (wall clock), from /proc: its start in clock ticks after boot
    against the uptime now (both 10 ms resolution; /proc/stat's btime has whole seconds)."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rpartition(")")[2].split()
        ticks = int(fields[19])  # field 22 of stat(5); fields[0] is field 3
        with open("/proc/uptime") as f:
            now, uptime = time.time(), float(f.read().split()[0])
        return now - uptime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return T_MAIN


T_PROC = process_start_time()


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=["elastic", "restart"], required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--tag", required=True)
    p.add_argument("--small", type=int, default=2)
    p.add_argument("--big", type=int, default=4)
    p.add_argument("--cycles", type=int, default=1)
    p.add_argument("--warm", type=int, default=5)
    p.add_argument("--gap", type=int, default=5)
    p.add_argument("--tail", type=int, default=5)
    p.add_argument("--min-gap-seconds", type=float, default=3.0)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--samples", type=int, default=8192)
    p.add_argument("--width", type=int, default=4096)
    p.add_argument("--optimizer", choices=["sgd", "momentum", "adam"], default="momentum")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--restore", default=None)
    p.add_argument("--save", default=None)
    p.add_argument("--plain-exit", action="store_true",
                   help="return from main normally (default: os._exit(0) after fit)")
    p.add_argument("--broadcast", action="store_true",
                   help="restart mode: also broadcast rank 0's state at the start")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    import numpy as np
    import keras
    import tensorflow as tf

    import kungfu as kf
    from kungfu import _peer, elastic as _elastic

    tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    tf.config.threading.set_inter_op_parallelism_threads(max(2, args.threads))
    t_imported = time.time()

    spec = os.environ.get("KUNGFU_SELF_SPEC", "127.0.0.1:0")
    port = spec.rpartition(":")[2]
    out = open(os.path.join(args.out, f"{args.tag}-{port}-{os.getpid()}.jsonl"), "a")

    def log(**rec):
        out.write(json.dumps(rec) + "\n")
        out.flush()

    # Inputs of 1024 features -> width -> width -> 1024 -> 1: 25,176,065 parameters at 4096.
    rng = np.random.default_rng(0)
    x = rng.standard_normal((args.samples, 1024), dtype=np.float32)
    y = (x[:, :16] @ np.linspace(-1, 1, 16, dtype=np.float32))[:, None]
    keras.utils.set_random_seed(1)
    w = args.width
    model = keras.Sequential([keras.Input((1024,)), keras.layers.Dense(w, activation="relu"),
                              keras.layers.Dense(w, activation="relu"),
                              keras.layers.Dense(1024, activation="relu"),
                              keras.layers.Dense(1)])
    base = {"sgd": lambda: keras.optimizers.SGD(1e-4),
            "momentum": lambda: keras.optimizers.SGD(1e-4, momentum=0.9),
            "adam": lambda: keras.optimizers.Adam(1e-5)}[args.optimizer]()
    model.compile(optimizer=kf.Optimizer(base), loss="mse", jit_compile=False)
    model.optimizer.build(model.trainable_variables)  # slots exist before a restore
    ckpt = tf.train.Checkpoint(model=model, optimizer=model.optimizer)
    t_model = time.time()
    if args.restore:
        ckpt.read(args.restore).assert_existing_objects_matched()
    t_built = time.time()

    data = kf.ElasticData(x, y, batch_size=args.batch_size, seed=2)
    joining = _peer.joining()

    class Cycle(kf.BasePolicy):
        """Elastic mode: small -> big -> small, --cycles times, then --tail steps. Every
        worker runs the same decisions (the state is kf.Hook's, agreed; joiners take rank 0's
        policy state); only rank 0 calls kf.resize."""

        def __init__(self):
            self.asked = 0  # resize requests so far
            self.asked_at = 0  # the step of the latest one
            self.size_seen = None
            self.since = 0  # steps at the current size
            self.done = False
            self.abandoned = False
            self.t_size = time.time()  # rank 0: when the current size began

        def after_step(self, state):
            if state.cluster_size != self.size_seen:
                self.size_seen, self.since = state.cluster_size, 0
                self.t_size = time.time()
            self.since += 1
            if self.asked % 2 == 1 and state.cluster_size == args.small and \
                    state.step > self.asked_at and _elastic.context().pending is None:
                # The request to grow was abandoned (its joiners were not ready in time) or
                # lost: stop, the driver reports it.
                self.abandoned = self.done = True
                return
            if self.asked < 2 * args.cycles:
                grow = self.asked % 2 == 0
                at = args.small if grow else args.big
                need = args.warm if self.asked == 0 else args.gap
                if state.cluster_size == at and self.since >= need:
                    if grow and self.asked > 0:
                        # Give the workers the last shrink left out time to exit: rank 0
                        # decides from its clock, everyone follows.
                        ok = time.time() - self.t_size >= args.min_gap_seconds
                        ok = bool(kf.broadcast(np.array([ok], np.int32), name=(
                            f"resize_latency/gap/{state.step}"))[0])
                        if not ok:
                            return
                    to = args.big if grow else args.small
                    if kf.rank() == 0:
                        log(ev="ask", t=time.time(), step=state.step, to=to,
                            **{"from": state.cluster_size})
                        kf.resize(to)
                    self.asked += 1
                    self.asked_at = state.step
            elif state.cluster_size == args.small and self.since >= args.tail:
                self.done = True

    class Steps(kf.BasePolicy):
        """Restart mode: --steps steps."""

        def __init__(self):
            self.done = False

        def after_step(self, state):
            if state.step >= args.steps:
                self.done = True

    class TimedHook(kf.Hook):
        def _rehearse(self):  # a joiner: runs its step alone, then reports ready
            t0 = time.time()
            super()._rehearse()
            if self.rehearsed:
                log(ev="rehearsed", t0=t0, t1=time.time())

    policy = Cycle() if args.mode == "elastic" else Steps()
    hook = TimedHook(policy, data=data)
    cur = {}

    class Pre(keras.callbacks.Callback):
        """Runs before kf.Hook."""

        def on_train_begin(self, logs=None):
            log(ev="proc", t_proc=T_PROC, t_main=T_MAIN, t_imported=t_imported, t_model=t_model,
                t_built=t_built,
                t_fit=time.time(), joining=joining, spec=spec, pid=os.getpid(),
                version=int(os.environ.get("KUNGFU_INIT_CLUSTER_VERSION", "0") or 0))

        def on_train_batch_begin(self, batch, logs=None):
            cur["t_begin"] = time.time()
            cur["size"] = kf.size()
            cur["rank"] = kf.rank()

        def on_train_batch_end(self, batch, logs=None):
            cur["t_end"] = time.time()

    class Post(keras.callbacks.Callback):
        """Runs after kf.Hook."""

        def on_train_begin(self, logs=None):
            if joining:
                log(ev="joined", t=time.time(), rank=kf.rank(), size=kf.size(),
                    step=hook.state.step)

        def on_train_batch_end(self, batch, logs=None):
            log(ev="step", step=hook.state.step, epoch=hook.state.epoch, size_after=kf.size(),
                t_hook=time.time(), detached=hook.detached, **cur)
            if getattr(policy, "abandoned", False) and kf.rank() == 0:
                log(ev="abandoned", t=time.time(), step=hook.state.step)
                policy.abandoned = False
            if policy.done and not hook.detached:
                if args.save and kf.rank() == 0:
                    t0 = time.time()
                    path = ckpt.write(args.save)
                    t1 = time.time()
                    nbytes = sum(os.path.getsize(os.path.join(os.path.dirname(path), f))
                                 for f in os.listdir(os.path.dirname(path)))
                    log(ev="save", t0=t0, t1=t1, step=hook.state.step, path=path, bytes=nbytes)
                self.model.stop_training = True

    callbacks = [Pre(), hook]
    if args.mode == "restart" and args.broadcast:
        callbacks.insert(1, kf.BroadcastGlobalVariablesCallback())
    callbacks.append(Post())
    model.fit(data.dataset(), epochs=1000, verbose=0, callbacks=callbacks)
    log(ev="end", t=time.time(), step=hook.state.step, size=kf.size())
    out.close()
    if not args.plain_exit:
        # Leave without the interpreter's teardown: destroying model.fit's tf.data iterator
        # waits for tf.data's autotuning thread, which sleeps up to 60 s between rounds once
        # training has run for a while (kf.Hook exits detached workers the same way).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
