"""Keras training throughput: kungfu's synchronous SGD against MultiWorkerMirroredStrategy.

One command runs everything (it starts the workers itself):

    python benchmarks/keras_throughput.py --np 1,2,4

For every worker count N it trains the same small ResNet-style CNN (three stages of residual
blocks, 32x32x3 synthetic images, 10 classes) with model.fit and SGD, batch --batch-size per
worker (64 by default, so N x 64 samples per step), in two ways, one after the other:

  kungfu  N workers under kungfu-run (`python -m kungfu.cmd -np N`), the optimizer wrapped in
          `kungfu.tensorflow.Optimizer(opt, algorithm="sync-sgd")` (gradients averaged over
          the workers each step), rank 0's initial weights broadcast by
          `BroadcastGlobalVariablesCallback`.
  mwms    N worker processes with TF_CONFIG describing a cluster of loopback ports, running
          `tf.distribute.MultiWorkerMirroredStrategy` (collective implementation --mwms-comm,
          RING by default; AUTO picks RING on CPU too), each worker fed its own 64-sample
          batch: model.fit gets unsharded batches of N x 64 and splits them.

At N = 1 the kungfu worker also trains a second copy of the model with the plain (unwrapped)
optimizer, alternating the two round by round in the same process, and reports the wrapper's
overhead: 1 - (kungfu samples/s) / (plain samples/s), from the median of the paired rounds
(--np1-rounds of them); overhead_best compares the fastest round of each (other load on the
machine only ever slows a round down, so the best rounds are the least disturbed). Then the two
models take turns step by step (train_on_batch on one fixed batch, --overhead-steps pairs):
overhead_interleaved = 1 - median(plain step time / kungfu step time) over the pairs, the figure
least disturbed by load that comes and goes. The table shows overhead (fit rounds) and
overhead_interleaved (per step).

Each measurement: a warm-up fit of --warmup-steps steps (tracing, the broadcast), then --rounds
timed rounds. A round is one epoch of 2 + --steps steps (at np=1, where plain and kungfu
alternate, one fit() call per round); the clock runs from the end of its 2nd step to the end of
its last one (on_train_batch_end), so per-call and per-epoch costs (creating the distributed
iterator, first-step hand-shakes, epoch-end logs) stay out. A round's time is the slowest worker's,
and samples/s = N x batch x steps / that time; the reported value is the median over the rounds
(min and max also given). Both implementations use the same model, data, optimizer, XLA off,
and the same TensorFlow thread settings (--threads).

Output: one JSON line per measurement on stdout (also written to --json PATH), then a table.
Keys: impl, np, batch_per_worker, global_batch, steps, rounds, samples_per_s (median),
samples_per_s_min, samples_per_s_max, step_s (median seconds per step), params, threads,
loadavg_before, loadavg_after (1-minute load average of this machine around the measurement),
wall_s (the whole measurement, process start-up included; MWMS workers still running 5 s
after all of them wrote their results are stopped), rank0_phases_s (seconds since rank
0's process started when its model was built, warm and done), plus kungfu_vs_mwms on kungfu
rows (ratio of medians at the same N) and overhead, overhead_best, overhead_interleaved,
interleaved_pairs, interleaved_step_s (median per step of each) on the np=1 kungfu row.

Numbers from a machine with few cores are bounded by CPU: N workers share the cores, so the
samples/s of both implementations fall as N grows past the core count, and what remains is how
much each adds per step on top of the compute. Other load on the machine shows up directly;
run the benchmark more than once.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional

_T0 = time.time()
HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
if REPO not in sys.path:  # run from a checkout: this repository's kungfu
    sys.path.insert(0, REPO)

from kungfu._ports import free_port_block  # noqa: E402

from _common import JsonLines  # noqa: E402


# ---------------------------------------------------------------------------------------------
# Arguments


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description="Keras model.fit samples/s: kungfu sync-SGD vs MultiWorkerMirroredStrategy",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--np", default="1,2,4", help="worker counts, comma separated (default 1,2,4)")
    p.add_argument("--impl", default="kungfu,mwms",
                   help="implementations to run: kungfu, mwms or both (default kungfu,mwms)")
    p.add_argument("--batch-size", type=int, default=64, help="samples per step per worker (64)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per round (10)")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds per measurement (5)")
    p.add_argument("--np1-rounds", type=int, default=10,
                   help="timed rounds at np=1, where plain and kungfu alternate for the "
                        "overhead figure (10)")
    p.add_argument("--overhead-steps", type=int, default=60,
                   help="at np=1, also time this many pairs of single steps (train_on_batch), "
                        "plain and kungfu taking turns (60; 0 skips)")
    p.add_argument("--warmup-steps", type=int, default=5, help="untimed steps after tracing (5)")
    p.add_argument("--threads", type=int, default=0,
                   help="TensorFlow intra- and inter-op threads per worker; 0 leaves TensorFlow's "
                        "defaults (default 0)")
    p.add_argument("--mwms-comm", choices=("RING", "AUTO"), default="RING",
                   help="MultiWorkerMirroredStrategy collective implementation (default RING)")
    p.add_argument("--strategy", default=None,
                   help="kungfu allreduce strategy (kungfu-run -strategy; default: the launcher's)")
    p.add_argument("--timeout", type=float, default=600,
                   help="seconds one measurement may take before it is stopped (600)")
    p.add_argument("--json", default=None, help="also write the JSON lines to this file")
    p.add_argument("--keep", default=None,
                   help="keep the workers' result files and logs in this directory")
    # Internal: the worker side.
    p.add_argument("--worker", choices=("kungfu", "mwms"), default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    p.add_argument("--with-plain", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ---------------------------------------------------------------------------------------------
# Worker side (imports TensorFlow)


def _configure_tf(threads: int):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import tensorflow as tf

    if threads > 0:
        tf.config.threading.set_intra_op_parallelism_threads(threads)
        tf.config.threading.set_inter_op_parallelism_threads(threads)
    return tf


def build_model(keras):
    """A ResNet-style CNN for 32x32x3 inputs: a stem, then three stages (16, 32, 64 channels) of
    one residual block each (two 3x3 convolutions with batch normalisation, a projection on the
    shortcut where the shape changes), global pooling and a 10-way classifier."""
    L = keras.layers

    def block(x, channels, stride):
        y = L.Conv2D(channels, 3, strides=stride, padding="same", use_bias=False)(x)
        y = L.BatchNormalization()(y)
        y = L.ReLU()(y)
        y = L.Conv2D(channels, 3, padding="same", use_bias=False)(y)
        y = L.BatchNormalization()(y)
        if stride != 1 or x.shape[-1] != channels:
            x = L.Conv2D(channels, 1, strides=stride, use_bias=False)(x)
            x = L.BatchNormalization()(x)
        return L.ReLU()(L.Add()([x, y]))

    inputs = keras.Input(shape=(32, 32, 3))
    x = L.Conv2D(16, 3, padding="same", use_bias=False)(inputs)
    x = L.BatchNormalization()(x)
    x = L.ReLU()(x)
    for channels, stride in ((16, 1), (32, 2), (64, 2)):
        x = block(x, channels, stride)
    x = L.GlobalAveragePooling2D()(x)
    outputs = L.Dense(10)(x)
    return keras.Model(inputs, outputs, name="small_resnet")


def synthetic_dataset(tf, batch: int, seed: int):
    """One fixed batch of random images and labels, repeated forever (no input-pipeline cost)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    x = rng.random((batch, 32, 32, 3), dtype=np.float32)
    y = rng.integers(0, 10, size=(batch,), dtype=np.int64)
    return tf.data.Dataset.from_tensors((x, y)).repeat().prefetch(2)


def compile_model(keras, model, optimizer):
    model.compile(optimizer=optimizer,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  jit_compile=False)


# Steps at the start of every timed fit() that are run but not timed: creating the (distributed)
# iterator and the first step's hand-shakes are per-call costs, not per-step ones.
LEAD_IN_STEPS = 2


class _RoundTimer:
    """A Keras callback timing one fit() call from the end of its LEAD_IN_STEPS-th step to the
    end of its last step."""

    def __init__(self, keras, last_step: int):
        outer = self
        self.times: List[float] = []

        class CB(keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                if batch == LEAD_IN_STEPS - 1:
                    outer._t0 = time.perf_counter()
                elif batch == last_step:
                    outer.times.append(time.perf_counter() - outer._t0)

        self.callback = CB()


def run_rounds(keras, entries, data, args, phases: dict,
               rotate: bool = False) -> Dict[str, List[float]]:
    """entries: [(label, model, warmup_callbacks)]. Warm every model up (the first fit traces
    the step), then time --rounds rounds of LEAD_IN_STEPS + --steps steps, of which the last
    --steps are timed: one epoch each of a single fit() for one model, or, for several models,
    one fit() each, alternating between the models round by round (with rotate, round r starts
    at entry r mod len(entries), so that no model always follows the same one).
    Returns {label: [seconds per round]}."""
    phases["built_s"] = round(time.time() - _T0, 2)
    for _, model, callbacks in entries:
        model.fit(data, epochs=1, steps_per_epoch=args.warmup_steps, verbose=0, shuffle=False,
                  callbacks=callbacks)
    phases["warm_s"] = round(time.time() - _T0, 2)
    total = LEAD_IN_STEPS + args.steps
    timers = {label: _RoundTimer(keras, total - 1) for label, _, _ in entries}
    if len(entries) == 1:
        # One fit() with a round per epoch: a fit() call costs seconds under MWMS.
        label, model, _ = entries[0]
        model.fit(data, epochs=args.rounds, steps_per_epoch=total, verbose=0, shuffle=False,
                  callbacks=[timers[label].callback])
    else:
        for r in range(args.rounds):
            first = r % len(entries) if rotate else 0
            for label, model, _ in entries[first:] + entries[:first]:
                model.fit(data, epochs=1, steps_per_epoch=total, verbose=0, shuffle=False,
                          callbacks=[timers[label].callback])
    phases["done_s"] = round(time.time() - _T0, 2)
    return {label: t.times for label, t in timers.items()}


def worker_kungfu(args) -> None:
    tf = _configure_tf(args.threads)
    import keras

    import kungfu as kf
    from kungfu.tensorflow import BroadcastGlobalVariablesCallback, Optimizer

    rank, size = kf.rank(), kf.size()
    keras.utils.set_random_seed(1234 + rank)
    data = synthetic_dataset(tf, args.batch_size, seed=rank)

    model = build_model(keras)
    opt = Optimizer(keras.optimizers.SGD(learning_rate=0.01 * size, momentum=0.9),
                    algorithm="sync-sgd")
    compile_model(keras, model, opt)
    entries = [("kungfu", model, [BroadcastGlobalVariablesCallback()])]
    if args.with_plain:
        plain = build_model(keras)
        compile_model(keras, plain, keras.optimizers.SGD(learning_rate=0.01, momentum=0.9))
        entries.insert(0, ("plain", plain, []))
    phases: dict = {}
    times = run_rounds(keras, entries, data, args, phases)
    result = {"rank": rank, "np": size, "times": times, "params": model.count_params(),
              "phases": phases}
    if args.with_plain and args.overhead_steps > 0:
        result["interleaved"] = interleaved_steps([("plain", plain), ("kungfu", model)],
                                                  args.overhead_steps, args.batch_size, seed=rank)
        phases["interleaved_done_s"] = round(time.time() - _T0, 2)
    result["digest"] = trainable_digest(model)
    _write_result(args.out, f"kungfu-np{size}-rank{rank}", result)


def interleaved_steps(entries, steps: int, batch: int, seed: int) -> Dict[str, List[float]]:
    """Seconds per train_on_batch step of each model in entries ([(label, model)]), `steps`
    rounds of one step per model, the models taking turns step by step (round i starts at entry
    i mod len(entries): with two models, plain first in even rounds, wrapped first in odd ones),
    so that load on the machine falls on all alike."""
    import numpy as np

    rng = np.random.default_rng(seed)
    x = rng.random((batch, 32, 32, 3), dtype=np.float32)
    y = rng.integers(0, 10, size=(batch,), dtype=np.int64)
    for _, m in entries:
        for _ in range(2):
            m.train_on_batch(x, y)
    out: Dict[str, List[float]] = {label: [] for label, _ in entries}
    for i in range(steps):
        first = i % len(entries)
        for label, m in entries[first:] + entries[:first]:
            t0 = time.perf_counter()
            m.train_on_batch(x, y)
            out[label].append(time.perf_counter() - t0)
    return out


def trainable_digest(model) -> str:
    """A digest of the trainable weights (batch-norm statistics are per worker, so left out)."""
    import hashlib

    import numpy as np

    h = hashlib.sha256()
    for v in model.trainable_variables:
        h.update(np.ascontiguousarray(v.numpy()).tobytes())
    return h.hexdigest()[:16]


def worker_mwms(args) -> None:
    tf = _configure_tf(args.threads)
    impl = getattr(tf.distribute.experimental.CommunicationImplementation, args.mwms_comm)
    strategy = tf.distribute.MultiWorkerMirroredStrategy(
        communication_options=tf.distribute.experimental.CommunicationOptions(implementation=impl))
    import keras

    task = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    size = strategy.num_replicas_in_sync
    _keras_mwms_workarounds(size)
    keras.utils.set_random_seed(1234)
    # Batches of size x --batch-size, not sharded across the workers (the data is synthetic):
    # Keras splits each into size per-worker batches of --batch-size.
    data = synthetic_dataset(tf, size * args.batch_size, seed=task)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    data = data.with_options(options)
    with strategy.scope():
        model = build_model(keras)
        compile_model(keras, model, keras.optimizers.SGD(learning_rate=0.01 * size, momentum=0.9))
        if size > 1:
            # Build the loss and optimizer state now, from a batch of the per-worker shape; see
            # _keras_mwms_workarounds.
            model._symbolic_build(data_batch=(tf.zeros([args.batch_size, 32, 32, 3]),
                                              tf.zeros([args.batch_size], tf.int64)))
            model._maybe_symbolic_build = lambda iterator=None, data_batch=None: None
    phases: dict = {}
    times = run_rounds(keras, [("mwms", model, [])], data, args, phases)
    _write_result(args.out, f"mwms-np{size}-rank{task}", {
        "rank": task, "np": size, "times": times, "params": model.count_params(),
        "digest": trainable_digest(model), "phases": phases})


def _keras_mwms_workarounds(size: int) -> None:
    """Lets Keras 3's model.fit run under MultiWorkerMirroredStrategy with several workers.

    Keras 3 (checked with 3.15) fails there in two places that do not touch the training step
    itself (keras-team/keras issue 20585):
      * before training, fit() calls strategy.reduce("MEAN", batch) on the first input batch to
        build the model symbolically; MWMS cannot reduce that nested per-replica batch
        ("Attempt to convert a value (PerReplica...) to a Tensor"). worker_mwms builds the
        model itself and turns that call into a no-op on its model.
      * after every step, the logs (a scalar loss) are reduced with reduce("MEAN", v, axis=0),
        which fails on a scalar ("Invalid reduction dimension 0 for input with 0 dimensions").
        With the multi-worker branch off, each worker reports its own replica's loss instead
        of the mean over the workers.
    The gradients are still summed over all workers by the optimizer inside strategy.run (the
    result files carry a digest of the trainable weights, which the driver checks is the same
    on every worker).
    """
    if size <= 1:
        return
    from keras.src.backend.tensorflow import trainer

    trainer._collective_all_reduce_multi_worker = lambda strategy: False


def _write_result(out_dir: str, name: str, payload: dict) -> None:
    path = os.path.join(out_dir, name + ".json")
    with open(path + ".tmp", "w") as f:
        json.dump(payload, f)
    os.replace(path + ".tmp", path)


# ---------------------------------------------------------------------------------------------
# Driver side (never imports TensorFlow)


def _loadavg() -> Optional[float]:
    try:
        with open("/proc/loadavg") as f:
            return float(f.read().split()[0])
    except OSError:
        return None


def _worker_env() -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("KUNGFU_") and k != "TF_CONFIG"}
    env["PYTHONPATH"] = os.pathsep.join([REPO] + [p for p in [env.get("PYTHONPATH")] if p])
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _common_worker_args(args, out_dir: str, np_: int) -> List[str]:
    rounds = args.np1_rounds if np_ == 1 else args.rounds
    return ["--batch-size", str(args.batch_size), "--steps", str(args.steps),
            "--overhead-steps", str(args.overhead_steps),
            "--rounds", str(rounds), "--warmup-steps", str(args.warmup_steps),
            "--threads", str(args.threads), "--mwms-comm", args.mwms_comm, "--out", out_dir]


# MultiWorkerMirroredStrategy workers can take a minute or more to exit after their work is
# done (tearing down the cluster); once every result file is written they get this long, then
# they are stopped.
EXIT_GRACE_S = 5.0


def _stop(procs) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, 15)
            except ProcessLookupError:
                pass
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, 9)
            p.wait()


def _wait_all(procs, logs, timeout: float, what: str, results=()) -> None:
    """Waits for every process to exit 0; or, when `results` are given, until every result file
    exists and EXIT_GRACE_S has passed (then stops the processes still running)."""
    deadline = time.monotonic() + timeout
    failed = None
    results_at = None
    while True:
        codes = [p.poll() for p in procs]
        if failed is None:
            bad = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
            if bad:
                failed = bad[0]
                break
        if all(c is not None for c in codes):
            break
        if results and results_at is None and all(os.path.exists(r) for r in results):
            results_at = time.monotonic()
        if results_at is not None and time.monotonic() - results_at > EXIT_GRACE_S:
            _stop(procs)
            return
        if time.monotonic() > deadline:
            failed = (None, "timeout")
            break
        time.sleep(0.1)
    if failed is None:
        return
    _stop(procs)
    tails = []
    for path in logs:
        with open(path, errors="replace") as f:
            tails.append(f"--- {os.path.basename(path)} (tail) ---\n" + f.read()[-3000:])
    who = "timed out" if failed[0] is None else f"process {failed[0]} exited with {failed[1]}"
    raise RuntimeError(f"{what}: {who}\n" + "\n".join(tails))


def _clear_results(out_dir: str, prefix: str, np_: int) -> None:
    """Removes result files an earlier run may have left in a --keep directory."""
    for r in range(np_):
        path = os.path.join(out_dir, f"{prefix}-np{np_}-rank{r}.json")
        if os.path.exists(path):
            os.remove(path)


def launch_kungfu(np_: int, worker_cmd: List[str], log: str, strategy: Optional[str],
                  timeout: float, what: str) -> None:
    """Runs worker_cmd in np_ workers under kungfu-run (free loopback ports, output to log) and
    waits for all of them to exit 0."""
    base = free_port_block(np_)
    cmd = [sys.executable, "-m", "kungfu.cmd", "-np", str(np_), "-q",
           "-port-range", f"{base}-{base + np_ - 1}"]
    if strategy:
        cmd += ["-strategy", strategy]
    cmd += worker_cmd
    with open(log, "w") as f:
        p = subprocess.Popen(cmd, env=_worker_env(), cwd=REPO, stdout=f, stderr=subprocess.STDOUT,
                             stdin=subprocess.DEVNULL, start_new_session=True)
    _wait_all([p], [log], timeout, what)


def run_kungfu(args, np_: int, out_dir: str) -> None:
    _clear_results(out_dir, "kungfu", np_)
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "kungfu"]
    cmd += _common_worker_args(args, out_dir, np_)
    if np_ == 1:
        cmd.append("--with-plain")
    launch_kungfu(np_, cmd, os.path.join(out_dir, f"kungfu-np{np_}.log"), args.strategy,
                  args.timeout, f"kungfu at np={np_}")


def run_mwms(args, np_: int, out_dir: str) -> None:
    _clear_results(out_dir, "mwms", np_)
    base = free_port_block(np_)
    cluster = {"worker": [f"127.0.0.1:{base + i}" for i in range(np_)]}
    procs, logs = [], []
    for i in range(np_):
        env = _worker_env()
        env["TF_CONFIG"] = json.dumps({"cluster": cluster, "task": {"type": "worker", "index": i}})
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", "mwms"]
        cmd += _common_worker_args(args, out_dir, np_)
        log = os.path.join(out_dir, f"mwms-np{np_}-rank{i}.log")
        with open(log, "w") as f:
            procs.append(subprocess.Popen(cmd, env=env, cwd=REPO, stdout=f,
                                          stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                          start_new_session=True))
        logs.append(log)
    results = [os.path.join(out_dir, f"mwms-np{np_}-rank{i}.json") for i in range(np_)]
    _wait_all(procs, logs, args.timeout, f"mwms at np={np_}", results=results)


def collect(out_dir: str, prefix: str, np_: int) -> Dict[str, List[float]]:
    """Per label, each round's time on the slowest worker."""
    per_rank = []
    for r in range(np_):
        with open(os.path.join(out_dir, f"{prefix}-np{np_}-rank{r}.json")) as f:
            per_rank.append(json.load(f))
    digests = {d["digest"] for d in per_rank}
    if len(digests) != 1:
        raise RuntimeError(f"{prefix} at np={np_}: the workers ended with different trainable "
                           f"weights ({sorted(digests)}): they did not train in step")
    labels = per_rank[0]["times"].keys()
    out = {label: [max(ts) for ts in zip(*(d["times"][label] for d in per_rank))]
           for label in labels}
    out["_params"] = per_rank[0]["params"]
    out["_phases"] = per_rank[0].get("phases", {})
    out["_interleaved"] = per_rank[0].get("interleaved")
    return out


def measurement(impl: str, np_: int, round_times: List[float], args, params: int,
                load_before, load_after) -> dict:
    samples = np_ * args.batch_size * args.steps
    rates = [samples / t for t in round_times]
    return {
        "impl": impl, "np": np_, "batch_per_worker": args.batch_size,
        "global_batch": np_ * args.batch_size, "steps": args.steps, "rounds": len(round_times),
        "samples_per_s": round(statistics.median(rates), 2),
        "samples_per_s_min": round(min(rates), 2), "samples_per_s_max": round(max(rates), 2),
        "step_s": round(statistics.median(round_times) / args.steps, 5),
        "params": params, "threads": args.threads or "default",
        "loadavg_before": load_before, "loadavg_after": load_after,
    }


def print_table(rows: List[dict]) -> None:
    by = {(r["impl"], r["np"]): r for r in rows}
    nps = sorted({r["np"] for r in rows})
    print()
    print(f"{'np':>3} | {'kungfu samples/s':>17} | {'mwms samples/s':>15} | {'kungfu/mwms':>11} | "
          f"{'plain samples/s':>15} | {'overhead fit / per step':>23}")
    print("-" * 98)
    for n in nps:
        k, m, pl = by.get(("kungfu", n)), by.get(("mwms", n)), by.get(("plain", n))
        cells = [
            f"{n:>3}",
            f"{k['samples_per_s']:>17.1f}" if k else f"{'-':>17}",
            f"{m['samples_per_s']:>15.1f}" if m else f"{'-':>15}",
            f"{k['kungfu_vs_mwms']:>10.2f}x" if k and "kungfu_vs_mwms" in k else f"{'-':>11}",
            f"{pl['samples_per_s']:>15.1f}" if pl else f"{'-':>15}",
            (f"{100 * k['overhead']:>14.1f}% / "
             + (f"{100 * k['overhead_interleaved']:.1f}%" if "overhead_interleaved" in k
                else "-")
             if k and "overhead" in k else f"{'-':>23}"),
        ]
        print(" | ".join(cells))
    print()


def driver(args) -> int:
    nps = [int(x) for x in args.np.split(",") if x.strip()]
    impls = [x.strip().lower() for x in args.impl.split(",") if x.strip()]
    for impl in impls:
        if impl not in ("kungfu", "mwms"):
            print(f"unknown --impl {impl!r} (kungfu, mwms)", file=sys.stderr)
            return 2
    out_dir = args.keep or tempfile.mkdtemp(prefix="keras_throughput.")
    os.makedirs(out_dir, exist_ok=True)
    report = JsonLines(args.json)
    rows, emit = report.rows, report.emit
    try:
        for n in nps:
            found: Dict[str, dict] = {}
            for impl in impls:
                before = _loadavg()
                t0 = time.monotonic()
                (run_kungfu if impl == "kungfu" else run_mwms)(args, n, out_dir)
                wall = time.monotonic() - t0
                after = _loadavg()
                result = collect(out_dir, impl, n)
                params = result.pop("_params")
                phases = result.pop("_phases")
                interleaved = result.pop("_interleaved")
                for label, times in result.items():
                    row = measurement(label, n, times, args, params, before, after)
                    row["wall_s"] = round(wall, 1)
                    row["rank0_phases_s"] = phases
                    found[label] = row
                    if label == "plain":
                        paired = [p / k for p, k in zip(times, result["kungfu"])]
                        found["_overhead"] = {
                            "overhead": round(1 - statistics.median(paired), 4),
                            "overhead_best": round(1 - min(times) / min(result["kungfu"]), 4)}
                        if interleaved:
                            ratios = [p / k for p, k in zip(interleaved["plain"],
                                                            interleaved["kungfu"])]
                            found["_overhead"].update({
                                "overhead_interleaved": round(1 - statistics.median(ratios), 4),
                                "interleaved_pairs": len(ratios),
                                "interleaved_step_s": {
                                    k: round(statistics.median(v), 5)
                                    for k, v in interleaved.items()}})
            k = found.get("kungfu")
            if k is not None:
                if "_overhead" in found:
                    k.update(found["_overhead"])
                if "mwms" in found:
                    k["kungfu_vs_mwms"] = round(
                        k["samples_per_s"] / found["mwms"]["samples_per_s"], 3)
            for label in ("plain", "kungfu", "mwms"):
                if found.get(label):
                    emit(found[label])
    finally:
        report.close()
        if not args.keep:
            shutil.rmtree(out_dir, ignore_errors=True)
    print_table(rows)
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker == "kungfu":
        worker_kungfu(args)
        return 0
    if args.worker == "mwms":
        worker_mwms(args)
        return 0
    return driver(args)


if __name__ == "__main__":
    sys.exit(main())
