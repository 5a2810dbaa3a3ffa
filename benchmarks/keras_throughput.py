"""Keras training throughput: kungfu's synchronous SGD against MultiWorkerMirroredStrategy.

One command runs everything (it starts the workers itself):

    python benchmarks/keras_throughput.py --np 1,2,4

For every model of --model and every worker count N it trains the model with model.fit and SGD
on synthetic data, batch --batch-size per worker (the model's default unless given), in two
ways:

  cnn       a small ResNet-style CNN (three stages of residual blocks, 32x32x3 images, 10
            classes; 78,714 parameters, batch 64): compute-bound, its gradients are 0.3 MB.
  resnet50  keras.applications.ResNet50 at 32x32x3, 10 classes (23.6M parameters, 90 MB of
            gradients in 214 tensors, batch 32).
  dense     an MLP 1024-4096-4096-1024-10 (25.2M parameters, 96 MB of gradients in 8 tensors,
            batch 64).

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

--repeats R measures each implementation R times at every N, the implementations taking turns
(repeat r starts with implementation r mod 2), so that load that comes and goes falls on both.

Each measurement: a warm-up fit of --warmup-steps steps (tracing, the broadcast), then --rounds
timed rounds. A round is one epoch of 2 + --steps steps (at np=1, where plain and kungfu
alternate, one fit() call per round); the clock runs from the end of its 2nd step to the end of
its last one (on_train_batch_end), so per-call and per-epoch costs (creating the distributed
iterator, first-step hand-shakes, epoch-end logs) stay out. A round's time is the slowest worker's,
and samples/s = N x batch x steps / that time; the reported value is the median over the rounds
of all repeats (min and max also given, and each repeat's median). Both implementations use the same model, data, optimizer, XLA off,
and the same TensorFlow thread settings (--threads).

Output: one JSON line per measurement on stdout (also written to --json PATH), then a table.
Keys: model, impl, np, batch_per_worker, global_batch, steps, rounds, samples_per_s (median),
samples_per_s_min, samples_per_s_max, repeat_samples_per_s (each repeat's median), step_s
(median seconds per step), params, threads, loadavg_min, loadavg_max (the lowest and highest
1-minute load average of this machine seen before and after each run at this N), busy
(--busy: busy-looping processes running meanwhile), wall_s (the whole measurement, process start-up included; MWMS workers still running 5 s
after all of them wrote their results are stopped), rank0_phases_s (seconds since rank
0's process started when its model was built, warm and done), plus kungfu_vs_mwms on kungfu
rows (ratio of medians at the same N) and overhead, overhead_best, overhead_interleaved,
interleaved_pairs, interleaved_step_s (median per step of each) on the np=1 kungfu row.

Numbers from a machine with few cores are bounded by CPU: N workers share the cores, so the
samples/s of both implementations fall as N grows past the core count, and what remains is how
much each adds per step on top of the compute. Other load on the machine shows up directly;
run the benchmark more than once. --plot PNG draws samples/s per implementation and N, one panel
per model, whiskers from the slowest to the fastest round (needs matplotlib).
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

from _common import JsonLines, read_json_lines  # noqa: E402
from _plot import pyplot, save  # noqa: E402


# ---------------------------------------------------------------------------------------------
# Arguments


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description="Keras model.fit samples/s: kungfu sync-SGD vs MultiWorkerMirroredStrategy",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--np", default="1,2,4", help="worker counts, comma separated (default 1,2,4)")
    p.add_argument("--impl", default="kungfu,mwms",
                   help="implementations to run: kungfu, mwms or both (default kungfu,mwms)")
    p.add_argument("--model", default="cnn",
                   help="models, comma separated: " + "; ".join(
                       f"{k} ({v[2]}, batch {v[1]})" for k, v in MODELS.items())
                   + " (default cnn)")
    p.add_argument("--batch-size", type=int, default=None,
                   help="samples per step per worker (default: the model's, see --model)")
    p.add_argument("--repeats", type=int, default=1,
                   help="measure every implementation this many times at each worker count, "
                        "taking turns (1)")
    p.add_argument("--plot", default=None, metavar="PNG",
                   help="also draw samples/s per implementation and worker count into this PNG "
                        "(needs matplotlib)")
    p.add_argument("--from-json", default=None, metavar="PATH",
                   help="measure nothing: print the table (and --plot) of the JSON lines an "
                        "earlier run wrote with --json")
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
    p.add_argument("--busy", type=int, default=0, metavar="K",
                   help="run K busy-looping processes for the whole run, to measure on a loaded "
                        "machine on purpose (0)")
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


# The models: name -> (input shape, batch per worker by default, what it is). `cnn` is
# compute-bound (its gradients are 0.3 MB); `resnet50` and `dense` carry about 100 MB of
# gradients per step, where the data plane decides the step time.
MODELS = {
    "cnn": ((32, 32, 3), 64, "small ResNet-style CNN, 78,714 parameters"),
    "resnet50": ((32, 32, 3), 32, "keras.applications.ResNet50 at 32x32, 10 classes, "
                                  "23.6M parameters"),
    "dense": ((1024,), 64, "4-layer MLP 1024-4096-4096-1024-10, 25.2M parameters"),
}


def build_model(keras, name: str = "cnn"):
    """The model `name` of MODELS, with 10 output logits."""
    if name == "resnet50":
        return keras.applications.ResNet50(weights=None, input_shape=MODELS[name][0],
                                           classes=10, classifier_activation=None)
    if name == "dense":
        L = keras.layers
        inputs = keras.Input(shape=MODELS[name][0])
        x = inputs
        for width in (4096, 4096, 1024):
            x = L.Dense(width, activation="relu")(x)
        return keras.Model(inputs, L.Dense(10)(x), name="dense")
    return build_cnn(keras)


def build_cnn(keras):
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


def synthetic_batch(batch: int, seed: int, shape=MODELS["cnn"][0]):
    """A batch of random inputs of `shape` and labels of 10 classes."""
    import numpy as np

    rng = np.random.default_rng(seed)
    x = rng.random((batch,) + tuple(shape), dtype=np.float32)
    y = rng.integers(0, 10, size=(batch,), dtype=np.int64)
    return x, y


def synthetic_dataset(tf, batch: int, seed: int, shape=MODELS["cnn"][0]):
    """One fixed batch of random inputs and labels, repeated forever (no input-pipeline cost)."""
    return tf.data.Dataset.from_tensors(synthetic_batch(batch, seed, shape)).repeat().prefetch(2)


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
    shape = MODELS[args.model][0]
    data = synthetic_dataset(tf, args.batch_size, seed=rank, shape=shape)

    model = build_model(keras, args.model)
    opt = Optimizer(keras.optimizers.SGD(learning_rate=0.01 * size, momentum=0.9),
                    algorithm="sync-sgd")
    compile_model(keras, model, opt)
    entries = [("kungfu", model, [BroadcastGlobalVariablesCallback()])]
    if args.with_plain:
        plain = build_model(keras, args.model)
        compile_model(keras, plain, keras.optimizers.SGD(learning_rate=0.01, momentum=0.9))
        entries.insert(0, ("plain", plain, []))
    phases: dict = {}
    times = run_rounds(keras, entries, data, args, phases)
    result = {"rank": rank, "np": size, "times": times, "params": model.count_params(),
              "phases": phases}
    if args.with_plain and args.overhead_steps > 0:
        result["interleaved"] = interleaved_steps([("plain", plain), ("kungfu", model)],
                                                  args.overhead_steps, args.batch_size, seed=rank,
                                                  shape=shape)
        phases["interleaved_done_s"] = round(time.time() - _T0, 2)
    result["digest"] = trainable_digest(model)
    _write_result(args.out, f"kungfu-np{size}-rank{rank}", result)


def interleaved_steps(entries, steps: int, batch: int, seed: int,
                      shape=MODELS["cnn"][0]) -> Dict[str, List[float]]:
    """Seconds per train_on_batch step of each model in entries ([(label, model)]), `steps`
    rounds of one step per model, the models taking turns step by step (round i starts at entry
    i mod len(entries): with two models, plain first in even rounds, wrapped first in odd ones),
    so that load on the machine falls on all alike."""
    x, y = synthetic_batch(batch, seed, shape)
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
    shape = MODELS[args.model][0]
    data = synthetic_dataset(tf, size * args.batch_size, seed=task, shape=shape)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    data = data.with_options(options)
    with strategy.scope():
        model = build_model(keras, args.model)
        compile_model(keras, model, keras.optimizers.SGD(learning_rate=0.01 * size, momentum=0.9))
        if size > 1:
            # Build the loss and optimizer state now, from a batch of the per-worker shape; see
            # _keras_mwms_workarounds.
            model._symbolic_build(data_batch=(tf.zeros([args.batch_size] + list(shape)),
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
    return ["--model", args.model, "--batch-size", str(args.batch_size), "--steps", str(args.steps),
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
                loads: List[Optional[float]], repeats: List[List[float]]) -> dict:
    """One row: samples/s from every timed round of every repeat (`repeats` holds each repeat's
    round times; `round_times` all of them)."""
    samples = np_ * args.batch_size * args.steps
    rates = [samples / t for t in round_times]
    known = [x for x in loads if x is not None]
    return {
        "model": args.model, "impl": impl, "np": np_, "batch_per_worker": args.batch_size,
        "global_batch": np_ * args.batch_size, "steps": args.steps, "rounds": len(round_times),
        "samples_per_s": round(statistics.median(rates), 2),
        "samples_per_s_min": round(min(rates), 2), "samples_per_s_max": round(max(rates), 2),
        "repeat_samples_per_s": [round(statistics.median([samples / t for t in ts]), 2)
                                 for ts in repeats],
        "step_s": round(statistics.median(round_times) / args.steps, 5),
        "params": params, "threads": args.threads or "default",
        "loadavg_min": min(known) if known else None,
        "loadavg_max": max(known) if known else None,
    }


def print_table(rows: List[dict]) -> None:
    by = {(r["model"], r["impl"], r["np"]): r for r in rows}
    for model in dict.fromkeys(r["model"] for r in rows):
        nps = sorted({r["np"] for r in rows if r["model"] == model})
        print()
        print(f"{model}: samples/s, median of all rounds (each repeat's median in brackets)")
        print(f"{'np':>3} | {'kungfu':>24} | {'mwms':>24} | {'kungfu/mwms':>11} | "
              f"{'plain':>8} | {'overhead fit / per step':>23} | load")
        print("-" * 116)

        def rate(row, width):
            if not row:
                return f"{'-':>{width}}"
            reps = ",".join(f"{x:.0f}" for x in row["repeat_samples_per_s"])
            return f"{row['samples_per_s']:.1f} [{reps}]".rjust(width)

        for n in nps:
            k, m, pl = (by.get((model, impl, n)) for impl in ("kungfu", "mwms", "plain"))
            loads = [x for r in (k, m, pl) if r for x in (r["loadavg_min"], r["loadavg_max"])
                     if x is not None]
            cells = [
                f"{n:>3}", rate(k, 24), rate(m, 24),
                f"{k['kungfu_vs_mwms']:>10.2f}x" if k and "kungfu_vs_mwms" in k else f"{'-':>11}",
                f"{pl['samples_per_s']:>8.1f}" if pl else f"{'-':>8}",
                (f"{100 * k['overhead']:>14.1f}% / "
                 + (f"{100 * k['overhead_interleaved']:.1f}%" if "overhead_interleaved" in k
                    else "-")
                 if k and "overhead" in k else f"{'-':>23}"),
                f"{min(loads):.1f}-{max(loads):.1f}" if loads else "-",
            ]
            print(" | ".join(cells))
    print()


def measure(args, n: int, impls: List[str], out_dir: str) -> Dict[str, dict]:
    """--repeats repeats of every implementation at n workers, the implementations taking turns
    (repeat r starts with implementation r mod len(impls)). Returns the rows by label."""
    times: Dict[str, List[List[float]]] = {}
    interleaved: Dict[str, List[float]] = {}
    loads: List[Optional[float]] = []
    walls: Dict[str, float] = {}
    params, phases = None, {}
    for r in range(args.repeats):
        first = r % len(impls)
        for impl in impls[first:] + impls[:first]:
            loads.append(_loadavg())
            t0 = time.monotonic()
            (run_kungfu if impl == "kungfu" else run_mwms)(args, n, out_dir)
            walls[impl] = walls.get(impl, 0.0) + time.monotonic() - t0
            loads.append(_loadavg())
            result = collect(out_dir, impl, n)
            params = result.pop("_params")
            phases[impl] = result.pop("_phases")
            for label, ts in (result.pop("_interleaved") or {}).items():
                interleaved.setdefault(label, []).extend(ts)
            for label, ts in result.items():
                times.setdefault(label, []).append(ts)
    found: Dict[str, dict] = {}
    for label, reps in times.items():
        impl = "kungfu" if label == "plain" else label
        row = measurement(label, n, [t for ts in reps for t in ts], args, params, loads, reps)
        row["wall_s"] = round(walls[impl], 1)
        row["rank0_phases_s"] = phases[impl]
        found[label] = row
    k = found.get("kungfu")
    if k is not None and "plain" in times:
        plain_t = [t for ts in times["plain"] for t in ts]
        kungfu_t = [t for ts in times["kungfu"] for t in ts]
        k["overhead"] = round(1 - statistics.median(p / q for p, q in zip(plain_t, kungfu_t)), 4)
        k["overhead_best"] = round(1 - min(plain_t) / min(kungfu_t), 4)
        if interleaved:
            ratios = [p / q for p, q in zip(interleaved["plain"], interleaved["kungfu"])]
            k.update({
                "overhead_interleaved": round(1 - statistics.median(ratios), 4),
                "interleaved_pairs": len(ratios),
                "interleaved_step_s": {label: round(statistics.median(v), 5)
                                       for label, v in interleaved.items()}})
    if k is not None and "mwms" in found:
        k["kungfu_vs_mwms"] = round(k["samples_per_s"] / found["mwms"]["samples_per_s"], 3)
    return found


def driver(args) -> int:
    if args.plot:
        pyplot()  # without matplotlib, stop before measuring
    if args.from_json:
        rows = read_json_lines(args.from_json)
        print_table(rows)
        if args.plot:
            plot(rows, args.plot)
        return 0
    nps = [int(x) for x in args.np.split(",") if x.strip()]
    impls = [x.strip().lower() for x in args.impl.split(",") if x.strip()]
    models = [x.strip().lower() for x in args.model.split(",") if x.strip()]
    for impl in impls:
        if impl not in ("kungfu", "mwms"):
            print(f"unknown --impl {impl!r} (kungfu, mwms)", file=sys.stderr)
            return 2
    for model in models:
        if model not in MODELS:
            print(f"unknown --model {model!r} ({', '.join(MODELS)})", file=sys.stderr)
            return 2
    if args.repeats < 1:
        print("--repeats must be at least 1", file=sys.stderr)
        return 2
    if args.busy < 0:
        print("--busy must be 0 or more", file=sys.stderr)
        return 2
    out_dir = args.keep or tempfile.mkdtemp(prefix="keras_throughput.")
    os.makedirs(out_dir, exist_ok=True)
    report = JsonLines(args.json)
    rows, emit = report.rows, report.emit
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
            for _ in range(args.busy)]
    try:
        for model in models:
            margs = argparse.Namespace(**vars(args))
            margs.model = model
            margs.batch_size = args.batch_size or MODELS[model][1]
            for n in nps:
                found = measure(margs, n, impls, out_dir)
                for label in ("plain", "kungfu", "mwms"):
                    if found.get(label):
                        emit(dict(found[label], busy=args.busy))
    finally:
        _stop(busy)
        report.close()
        if not args.keep:
            shutil.rmtree(out_dir, ignore_errors=True)
    print_table(rows)
    if args.plot:
        plot(rows, args.plot)
    return 0


def plot(rows: List[dict], path: str) -> None:
    """Bars of samples/s per implementation, grouped by worker count, one panel per model; the
    whiskers span the rounds' min and max."""
    plt = pyplot()
    models = list(dict.fromkeys(r["model"] for r in rows))
    impls = [i for i in ("kungfu", "mwms", "plain") if any(r["impl"] == i for r in rows)]
    fig, axes = plt.subplots(1, len(models), figsize=(4.2 * len(models), 3.6), squeeze=False)
    for ax, model in zip(axes[0], models):
        nps = sorted({r["np"] for r in rows if r["model"] == model})
        width = 0.8 / len(impls)
        for j, impl in enumerate(impls):
            got = {r["np"]: r for r in rows if r["model"] == model and r["impl"] == impl}
            xs = [i + (j - (len(impls) - 1) / 2) * width for i, n in enumerate(nps) if n in got]
            mid = [got[n]["samples_per_s"] for n in nps if n in got]
            lo = [got[n]["samples_per_s"] - got[n]["samples_per_s_min"] for n in nps if n in got]
            hi = [got[n]["samples_per_s_max"] - got[n]["samples_per_s"] for n in nps if n in got]
            ax.bar(xs, mid, width, yerr=[lo, hi], capsize=3, label=impl)
        ax.set_xticks(range(len(nps)), [f"np={n}" for n in nps])
        batch = next(r["batch_per_worker"] for r in rows if r["model"] == model)
        ax.set_title(f"{model} (batch {batch} per worker)")
        ax.set_ylabel("samples/s")
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].legend()
    save(fig, path)


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
