"""Training script for the elastic tests (run under kungfu-run -w): model.fit on a synthetic
regression task with a policy that resizes the cluster through a schedule of sizes.

    kungfu-run -w -np 1 -H 127.0.0.1:4 -builtin-config-port P python elastic_train.py \\
        --schedule 2,4,3,1,4 --out DIR

The policy asks for the next size of the schedule (on rank 0 only) once the previous change is
done and `--gap` steps have passed at that size; after the last one it trains --tail more steps
and stops. Every worker appends one JSON line per step to DIR/<host_port>.jsonl: step, epoch,
cluster size, rank, the indices of the samples it trained on, the loss and a digest of the
weights after the step.
"""
from __future__ import annotations

import os
import sys

if "--fail-joiner" in sys.argv and os.environ.get("KUNGFU_ELASTIC_JOINING") == "1":
    sys.exit(3)  # a joiner that fails at once, before importing anything heavy

import argparse  # noqa: E402
import faulthandler  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import signal  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # noqa: E402

import numpy as np  # noqa: E402
import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

import kungfu as kf  # noqa: E402

import _fault  # noqa: E402  (next to this file)

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(2)


# A worker started to join a running job; under kungfu-run -spares, a warm spare always is (it
# learns its place at its first kf.rank(), so nothing here asks before model.fit).
JOINING = (os.environ.get("KUNGFU_ELASTIC_JOINING") == "1"
           or os.environ.get("KUNGFU_SPARE_FD") is not None)


# The identity variables each record carries as os.environ holds them after the step.
ENV_RANK_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "KUNGFU_SELF_SPEC",
                 "KUNGFU_INIT_PEERS", "KUNGFU_INIT_CLUSTER_VERSION")


class Records:
    """DIR/<host_port>.jsonl, opened at the first record (by then a spare has its address)."""

    def __init__(self, directory):
        self.directory = directory
        self.file = None

    def write(self, text):
        if self.file is None:
            me = os.environ.get("KUNGFU_SELF_SPEC", "single").replace(":", "_")
            self.file = open(os.path.join(self.directory, f"{me}.jsonl"), "a")
        self.file.write(text)

    def flush(self):
        if self.file is not None:
            self.file.flush()

    def close(self):
        if self.file is not None:
            self.file.close()


class Schedule(kf.BasePolicy):
    def __init__(self, sizes, gap, tail, model, bad_requests=False):
        self.sizes = list(sizes)
        self.gap, self.tail = gap, tail
        self.model = model
        self.next = 0
        self.size_seen = None
        self.since = 0
        self.bad_requests = bad_requests
        self.errors = []

    def after_step(self, state):
        if state.cluster_size != self.size_seen:
            self.size_seen, self.since = state.cluster_size, 0
        self.since += 1
        if self.bad_requests and state.step == 2:
            for n in (0, -1, 99, "2"):
                try:
                    if kf.resize(n) is False:
                        self.errors.append(f"refused {n}")  # more than the slots: a warning
                except ValueError as e:
                    self.errors.append(str(e))
        if self.next < len(self.sizes):
            if self.since >= self.gap and state.cluster_size == (
                    self.sizes[self.next - 1] if self.next else state.cluster_size):
                if kf.rank() == 0:
                    kf.resize(self.sizes[self.next])
                elif self.bad_requests and kf.rank() == 1:
                    kf.resize(1)  # a conflicting request: the lowest deciding rank wins
                self.next += 1
        elif state.cluster_size == self.sizes[-1] and self.since >= self.tail:
            self.model.stop_training = True


def traces(train_function):
    """How often Keras's compiled step function was traced (its tf.functions' counts)."""
    if train_function is None:  # a custom loop
        return None
    train_function = getattr(train_function, "kungfu_guarded", train_function)  # kf.Hook's wrap
    counts = [c.cell_contents.experimental_get_tracing_count()
              for c in (train_function.__closure__ or ())
              if hasattr(c.cell_contents, "experimental_get_tracing_count")]
    return sum(counts) if counts else None


def custom_loop(model, opt, data, hook, record, faults_, fault_):
    """What model.fit does with the callbacks, written out as a user's loop would."""
    mse = keras.losses.MeanSquaredError()

    @tf.function
    def train_step(x, y, w):
        with tf.GradientTape() as tape:
            loss = mse(y, model(x, training=True), sample_weight=w)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    step = hook.guard(train_step)
    hook.before_train()
    record.on_train_begin()
    for epoch in range(1000):
        hook.before_epoch(epoch)
        for x, y, w in data.epoch_batches():
            record.on_train_batch_begin(0)
            hook.before_step()
            logs = {"loss": float(step(x, y, w))}
            sig = faults_.pop((hook.state.step + 1, "-"), None)
            if sig is not None:
                fault_(sig)
            hook.after_step(logs)
            record.on_train_batch_end(0, logs)
            if model.stop_training:
                break
        hook.after_epoch()
        if model.stop_training:
            break
    hook.after_train()


def main():
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # stacks on demand, for a hang
    p = argparse.ArgumentParser()
    p.add_argument("--schedule", default="2")
    p.add_argument("--gap", type=int, default=3)
    p.add_argument("--tail", type=int, default=4)
    p.add_argument("--samples", type=int, default=240)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--step-sleep", type=float, default=0.05)
    p.add_argument("--bad-requests", action="store_true")
    p.add_argument("--fail-joiner", action="store_true",
                   help="a joining worker exits with code 3 at once (a joiner that fails)")
    p.add_argument("--max-steps", type=int, default=0, help="stop after this many steps")
    p.add_argument("--stop-at-version", default="", metavar="V:N",
                   help="stop N steps after the first step at cluster version V or later (every "
                        "member trains that step at the same version, so all stop together)")
    p.add_argument("--joiner-width", type=int, default=16,
                   help="hidden units of a joining worker's model (others: 16); another width "
                        "is a joiner whose variables differ from rank 0's")
    p.add_argument("--kill", action="append", default=[], metavar="RANK@STEP",
                   help="the worker of this rank (in the first cluster) kills itself with "
                        "SIGKILL during this step, or with STEP+ right after it, once its Hook "
                        "is done with it, or with STEP- (--custom-loop) after its training step "
                        "but before the Hook's (repeatable)")
    p.add_argument("--hang", default="", metavar="RANK@STEP",
                   help="the worker of this rank stops itself (SIGSTOP) during this step")
    p.add_argument("--wake-after", type=float, default=0.0,
                   help="with --hang: the stopped worker is continued (SIGCONT) this many "
                        "seconds later")
    p.add_argument("--kill-while-lending", type=int, default=-1, metavar="RANK",
                   help="the worker of this rank (in the first cluster) kills itself just after "
                        "it lent its variables to the joiners of the first resize")
    p.add_argument("--kill-in-start", type=int, default=-1, metavar="RANK",
                   help="the worker of this rank (in the first cluster) kills itself (SIGKILL) "
                        "once it connected, as kf.Hook begins to broadcast rank 0's initial "
                        "state: before its first step")
    p.add_argument("--kill-after-check-in", type=int, default=-1, metavar="RANK",
                   help="the worker of this rank (in the first cluster) kills itself (SIGKILL) "
                        "as soon as it has checked in alive in a recovery (inside the recovery "
                        "window when another worker hangs)")
    p.add_argument("--kill-after-decision", type=int, default=-1, metavar="RANK",
                   help="the worker of this rank (in the first cluster) kills itself (SIGKILL) "
                        "once it holds the survivors' decision of a recovery that keeps it, "
                        "before it connects to that cluster")
    p.add_argument("--tfrecord", metavar="DIR",
                   help="read the samples from the TFRecord files in DIR (kf.RecordFiles), "
                        "checking each batch against the arrays")
    p.add_argument("--stream", action="store_true",
                   help="with --tfrecord: read the files as a tf.data.TFRecordDataset stream "
                        "(kf.ElasticData over a dataset) instead of by position")
    p.add_argument("--write-tfrecord", metavar="DIR",
                   help="write the samples to 3 TFRecord files in DIR and exit")
    p.add_argument("--checkpoint", help="kf.Hook's checkpoint file (resumes from it if there)")
    p.add_argument("--checkpoint-every", type=int, default=4)
    p.add_argument("--custom-loop", action="store_true",
                   help="train in a GradientTape loop over data.epoch_batches() (kf.Hook's "
                        "methods called by hand, the step wrapped by hook.guard) instead of "
                        "model.fit")
    p.add_argument("--pause-pid", type=int, default=0,
                   help="a worker that faults first stops this process (SIGSTOP) for "
                        "--pause-seconds (the config store, to test an outage)")
    p.add_argument("--pause-seconds", type=float, default=3.0)
    p.add_argument("--print-ranks", action="store_true",
                   help="print 'step S rank R of N' after every step (kungfu-run prefixes it)")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    stop_at = None  # --stop-at-version: [V, N, the step to stop after once V was seen]
    if args.stop_at_version:
        stop_at = [int(x) for x in args.stop_at_version.split(":")] + [None]

    rng = np.random.default_rng(0)
    x = rng.standard_normal((args.samples, 8)).astype(np.float32)
    y = (x @ np.linspace(-1, 1, 8).astype(np.float32))[:, None]
    keras.utils.set_random_seed(1)
    width = args.joiner_width if JOINING else 16
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(width, activation="tanh"),
                              keras.layers.Dense(1)])
    opt = kf.Optimizer(keras.optimizers.SGD(0.05), monitor=["gns", "variance"],
                       batch_size=args.batch_size)
    model.compile(optimizer=opt, loss="mse", jit_compile=False)
    features = {"x": tf.io.FixedLenFeature([8], tf.float32),
                "y": tf.io.FixedLenFeature([1], tf.float32)}
    if args.write_tfrecord:
        for part, rows in enumerate(np.array_split(np.arange(args.samples), 3)):
            path = os.path.join(args.write_tfrecord, f"part-{part}.tfrecord")
            with tf.io.TFRecordWriter(path) as w:
                for i in rows:
                    w.write(tf.train.Example(features=tf.train.Features(feature={
                        "x": tf.train.Feature(float_list=tf.train.FloatList(value=x[i])),
                        "y": tf.train.Feature(float_list=tf.train.FloatList(value=y[i])),
                    })).SerializeToString())
        return
    if args.tfrecord:
        def parse(records):
            got = tf.io.parse_example(records, features)
            return got["x"].numpy(), got["y"].numpy()

        class Checked(kf.RecordFiles):
            def read(self, indices):  # every batch read from the files is the arrays' one
                fx, fy = super().read(indices)
                if not (np.array_equal(fx, x[indices]) and np.array_equal(fy, y[indices])):
                    raise AssertionError(f"records {list(indices)[:4]}... differ from the data")
                return fx, fy

        files = os.path.join(args.tfrecord, "*.tfrecord")
        if args.stream:
            # Unshuffled, the stream's position i holds sample i (files in name order).
            class CheckedStream(kf.ElasticData):
                def _fetch(self, idx):
                    fx, fy = super()._fetch(idx)
                    if not (np.array_equal(fx, x[idx]) and np.array_equal(fy, y[idx])):
                        raise AssertionError(f"stream positions {list(idx)[:4]}... differ")
                    return fx, fy

            stream = tf.data.TFRecordDataset(sorted(tf.io.gfile.glob(files))).map(
                lambda r: tuple(tf.io.parse_single_example(r, features)[k] for k in "xy"))
            data = CheckedStream(stream, batch_size=args.batch_size, record=True)
        else:
            data = kf.ElasticData(Checked(files, parse), batch_size=args.batch_size, seed=2,
                                  record=True)
    else:
        data = kf.ElasticData(x, y, batch_size=args.batch_size, seed=2, record=True)
    sizes = [int(s) for s in args.schedule.split(",") if s]
    policy = Schedule(sizes, args.gap, args.tail, model, args.bad_requests)
    out = Records(args.out)

    def faults(spec_list):
        """{step: signal} for this worker, from RANK@STEP specs (first cluster only)."""
        if JOINING or not any(spec for spec, _ in spec_list):
            return {}
        out = {}
        for spec, sig in spec_list:
            rank, _, step = spec.partition("@")
            if spec and int(rank) == kf.rank():
                mode = step[-1] if step[-1] in "+-" else ""
                out[(int(step.rstrip("+-")), mode)] = sig
        return out

    my_faults = faults([(k, signal.SIGKILL) for k in args.kill] + [(args.hang, signal.SIGSTOP)])

    def fault(sig):
        _fault.fault(out, sig, args.pause_pid, args.pause_seconds, args.wake_after)

    def weights_digest():
        return hashlib.sha256(b"".join(w.tobytes() for w in model.get_weights())).hexdigest()

    class Record(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):  # after kf.Hook's, which may have resumed
            if args.checkpoint:
                out.write(json.dumps({"begin": weights_digest(), "step": hook.state.step}) + "\n")
                out.flush()

        def on_train_batch_begin(self, batch, logs=None):
            # The version this step trains at (kf.Hook may switch at its end, before the record).
            self.version = kf.elastic.context().current.version
            sig = my_faults.pop((hook.state.step + 1, ""), None)
            if sig is not None:  # during the step: a moment after it started
                threading.Timer(0.005, fault, (sig,)).start()

        def on_train_batch_end(self, batch, logs=None):
            st = hook.state
            served = data.served[-1].tolist() if data.served else []
            out.write(json.dumps({"step": st.step, "epoch": st.epoch, "size": kf.size(),
                                  "t": time.time(), "from_files": data.source is not None or data.stream is not None,
                                  "rank": kf.rank(), "pid": os.getpid(), "served": served,
                                  "loss": float(logs["loss"]), "digest": weights_digest(),
                                  # the step's slice of the epoch's order: [start, length]
                                  "slice": [data.offset - data.last_length, data.last_length],
                                  "errors": policy.errors,
                                  "monitor_n": float(opt.kungfu_monitor.stats.numpy()[4]),
                                  "gns": kf.grad_noise_scale(), "rehearsed": hook.rehearsed,
                                  "traces": traces(model.train_function),
                                  "env": {k: os.environ.get(k) for k in ENV_RANK_VARS}}) + "\n")
            out.flush()
            if args.print_ranks:
                me = os.environ.get("KUNGFU_SELF_SPEC")
                print(f"step {st.step} rank {kf.rank()} of {kf.size()} at {me}", flush=True)
            sig = my_faults.pop((st.step, "+"), None)
            if sig is not None:
                fault(sig)
            time.sleep(args.step_sleep)
            if args.max_steps and st.step >= args.max_steps:
                model.stop_training = True
            if stop_at is not None and self.version >= stop_at[0]:
                if stop_at[2] is None:
                    stop_at[2] = st.step + stop_at[1]
                if st.step >= stop_at[2]:
                    model.stop_training = True

    hook = kf.Hook(policy, data=data, checkpoint=args.checkpoint,
                   checkpoint_every=args.checkpoint_every)
    if args.kill_while_lending >= 0 and not JOINING and args.kill_while_lending == kf.rank():
        binding = hook.membership.variables
        lend = binding.lend

        def lend_and_die(variables, names):
            lend(variables, names)
            fault(signal.SIGKILL)  # lent: the joiners are about to request them

        binding.lend = lend_and_die
    if args.kill_in_start >= 0 and not JOINING and args.kill_in_start == kf.rank():
        def connect_and_die():
            kf.init()
            fault(signal.SIGKILL)

        hook._start_equal = connect_and_die
    if args.kill_after_check_in >= 0 and not JOINING and args.kill_after_check_in == kf.rank():
        store = kf.elastic.context().store
        mark_alive = store.mark_alive

        def check_in_and_die(*a, **kw):
            mark_alive(*a, **kw)
            fault(signal.SIGKILL)  # the others saw it alive: its launcher now says it died

        store.mark_alive = check_in_and_die
    if args.kill_after_decision >= 0 and not JOINING and args.kill_after_decision == kf.rank():
        from kungfu import _peer

        def die_instead(*a, **kw):  # Elastic.recover swaps in the agreed cluster's peer here
            fault(signal.SIGKILL)

        _peer.replace = die_instead
    if args.custom_loop:
        custom_loop(model, opt, data, hook, Record(), my_faults, fault)
    else:
        model.fit(data.dataset(), epochs=1000, verbose=0, callbacks=[hook, Record()])
    out.write(json.dumps({"done": True, "step": hook.state.step, "size": kf.size(),
                          "recoveries": hook.recoveries}) + "\n")
    out.close()


if __name__ == "__main__":
    main()
