"""Keras callbacks that agree across workers.

Each worker trains (and evaluates) on its own shard, so its metrics are its own: callbacks that
decide from them (EarlyStopping, ReduceLROnPlateau, ModelCheckpoint(save_best_only=True)) would
decide differently on each worker, and the job would split. kungfu combines the metrics of all
workers exactly before any callback sees them:

- the model's metric states (Keras's loss tracker and compiled metrics keep sums and counts)
  are summed over the workers, and the result is computed from the sums: the mean loss over
  every sample of every worker, the accuracy over all of them, not a mean of means;
- this happens where Keras reads the metrics of an epoch (after training, and after validation)
  and at the end of `model.evaluate`, so every callback sees the combined values whatever its
  place in the list.

`kf.Hook` turns this on for its model while model.fit runs; without a Hook,
`kf.MetricAverageCallback()` (Horovod's name) does. After training, `model.evaluate` stays each
worker's own (one worker may evaluate alone) unless `kf.combine_metrics(model)` was called:
then every worker evaluates its shard together and each gets the result over all of them. Metrics whose states are not sums (a custom metric that
keeps a maximum, say) are combined as if they were: give such a metric sum-like states.

While it trains, kf.Hook also keeps output to one worker (`RankZeroOutput`): Keras's progress
bars and messages print on rank 0 only, and `model.save` / `model.save_weights` (what
ModelCheckpoint and BackupAndRestore call) write on rank 0 only, atomically (a temporary file
renamed over the target), so a reader never sees half a file. The callbacks that write files
(CSVLogger, TensorBoard, BackupAndRestore: `_WRITERS`) run on rank 0 only when every worker
names the same file or folder (`RankZeroOutput.arrange`); BackupAndRestore still restores every
worker from rank 0's backup. `kf.Hook(rank_zero_output=False)` leaves every worker's output
alone.
"""
from __future__ import annotations

import os
import warnings

import keras
import numpy as np
import tensorflow as tf

from kungfu import _collective, _peer, errors
from kungfu.elastic import check_learning_rate
from kungfu.tensorflow import _internals

# Failures the survivors recover from: a peer died or stopped answering (in a TensorFlow op or in a
# collective of kf.Hook's own). Anything else (peers that disagree, bad input) is raised.
RECOVERABLE = (tf.errors.UnavailableError, tf.errors.DeadlineExceededError,
               errors.PeerFailedError, errors.OpTimeoutError)


def _combined(model, read):
    """`read()` (Keras's metric results) with the model's metric states summed over the
    workers; the local states are put back after."""
    if _peer.identity().size == 1:
        return read()
    variables = [v for m in model.metrics for v in m.variables]
    if not variables:
        return read()
    local = [keras.ops.convert_to_numpy(v) for v in variables]
    flat = np.concatenate([np.asarray(a, np.float64).ravel() for a in local])
    try:
        total = _collective.allreduce(flat, "sum", name="kungfu/metrics")
    except RECOVERABLE as e:
        recover = getattr(model, "kungfu_recover", None)
        if recover is None:  # no recovery: kf.Hook fails at its next agreement
            warnings.warn(f"kungfu: metrics not combined over the workers (a peer failed: {e})")
            return read()
        # A peer died after the epoch's last step (kf.Hook under kungfu-run -w): recover now,
        # so that the callbacks decide from the survivors' combined metrics, not each from its
        # own (ReduceLROnPlateau would lower one worker's rate only).
        recover(e)
        return _combined(model, read)
    offset = 0
    for v, a in zip(variables, local):
        v.assign(total[offset:offset + a.size].reshape(a.shape).astype(a.dtype))
        offset += a.size
    try:
        return read()
    finally:
        for v, a in zip(variables, local):
            v.assign(a)


def _step_results(model, logs: dict) -> dict:
    """A custom step's logs with each entry named after one of the model's metrics that the
    step updated replaced by that metric's result: a step written as Keras's guide writes it
    returns `{m.name: m.result() for m in self.metrics}` (the compiled metrics' entry a dict),
    so its epoch metrics are combined as Keras's own step's are. An entry of a metric the step
    left alone (all its states zero: it returns its own loss, say) stays the step's."""
    updated = {m.name: m for m in model.metrics
               if any(np.any(keras.ops.convert_to_numpy(v)) for v in m.variables)}
    return {k: updated[k].result() if k in updated else v for k, v in logs.items()}


def combine_metrics(model) -> None:
    """From now on, the metrics Keras reports for `model` at the end of an epoch (training and
    validation) and of `model.evaluate` are over all workers (see the module's doc), also after
    training: every worker must then call model.evaluate together (each on its shard). kf.Hook
    and MetricAverageCallback combine during model.fit only, so that an evaluation on one
    worker after training (`if kf.rank() == 0: model.evaluate(...)`) stays its own."""
    _install(model)
    model.kungfu_combine = "always"


# What kf.Hook adds to Keras's logs besides the monitored estimates (gns, grad_variance): the
# cluster's numbers, for TensorBoard and the progress bar (kf.Hook(cluster_logs=False): none).
CLUSTER_LOG_KEYS = ("cluster_size", "global_batch_size", "step_time", "samples_per_sec",
                    "allreduce_bytes_per_sec")


def _hook_log_keys() -> frozenset:
    from kungfu.tensorflow._monitor import LOG_KEYS

    return frozenset(LOG_KEYS.values()) | frozenset(CLUSTER_LOG_KEYS)


HOOK_LOG_KEYS = _hook_log_keys()


def combine_while_training(model, on: bool) -> None:
    """kf.Hook and MetricAverageCallback: combine while model.fit runs."""
    _install(model)
    if getattr(model, "kungfu_combine", None) != "always":
        model.kungfu_combine = "fit" if on else None


def install_epoch_end(model) -> None:
    """From now on, `model.kungfu_steps_ended()` (kf.JoinCallback's join), when set, runs where
    Keras reads a training epoch's metrics: the first thing after the epoch's last step, before
    validation and every callback's on_epoch_end."""
    _install(model)


def _install(model) -> None:
    def wrap(own):  # own: Keras's one place for "the metrics of an epoch"
        def combined(logs):
            steps_ended = getattr(model, "kungfu_steps_ended", None)
            if steps_ended is not None:
                steps_ended()
            # kf.Hook adds its own values (the monitored estimates, the cluster's numbers) to
            # each step's logs; Keras takes the metrics only from logs that hold nothing else.
            if isinstance(logs, dict):
                logs = {k: v for k, v in logs.items() if k not in HOOK_LOG_KEYS}

            def read():
                out = own(logs)
                # Keras passes on a custom train_step's logs as its last step left them (their
                # keys are not its metrics'): read them again from the metrics, summed or not.
                return _step_results(model, out) if out is logs else out

            out = _combined(model, read) if getattr(model, "kungfu_combine", None) else read()
            if getattr(model, "kungfu_trained", False):  # a training epoch under kf.Hook ended
                model.kungfu_trained = False
                epoch_logs = getattr(model, "kungfu_epoch_logs", None)
                out = {**out, **(epoch_logs() if epoch_logs else {})}
            return out

        return combined

    _internals.wrap_epoch_metrics(model, wrap)


class MetricAverageCallback(keras.callbacks.Callback):
    """Epoch metrics combined over all workers before any callback sees them, while model.fit
    runs (validation included); kf.Hook does the same by itself. For model.evaluate after
    training on every worker's shard, call kf.combine_metrics(model)."""

    def on_train_begin(self, logs=None):
        combine_while_training(self.model, True)

    def on_train_end(self, logs=None):
        combine_while_training(self.model, False)


# Keras's callbacks that write files, the attribute naming what each writes to, and the hooks of
# it that run on every worker: under kf.Hook, when every worker names the same file or folder,
# the other workers run only those (BackupAndRestore restores every worker that starts with the
# job from rank 0's backup; a joiner runs none: kf.Hook gives it rank 0's state); a file or
# folder per worker stays each worker's.
_WRITERS = ((keras.callbacks.CSVLogger, "filename", ()),
            (keras.callbacks.TensorBoard, "log_dir", ()),
            (keras.callbacks.BackupAndRestore, "backup_dir", ("set_model", "on_train_begin")))


class _Muted(keras.callbacks.Callback):
    """`callback` as a worker other than rank 0 runs it: only the hooks `everywhere`."""

    def __init__(self, callback, everywhere):
        super().__init__()
        self.callback = callback
        for hook in everywhere:
            setattr(self, hook, getattr(callback, hook))


def let_hooks_arrange_callbacks() -> None:
    """A kf.Hook in a model.fit's callbacks gets the list (its `kungfu_arrange`) before Keras
    sets any callback up, to arrange the others (RankZeroOutput.arrange). Once, by the first
    kf.Hook made."""
    _internals.let_hooks_arrange_callbacks()


class CallbackStates:
    """What a joiner takes of rank 0's other Keras callbacks (kf.Hook's shared_state): each
    one's class and its public attributes that hold a number or None (ReduceLROnPlateau's and
    EarlyStopping's best, wait and cooldown counters, ModelCheckpoint's best, ...). Without them
    a joiner's callbacks start over and decide differently: another learning rate, other
    weights. Paths and other strings stay each worker's own. A joiner connects in kf.Hook's
    on_train_begin and callbacks after it reset their counters in theirs: what it takes is set
    at its next epoch or batch begin (apply)."""

    _KINDS = (bool, int, float, np.number, type(None))

    def __init__(self):
        self.callbacks: list = []  # the model.fit's callbacks but kf.Hook
        self.pending = None

    def read(self) -> list:
        """Per callback: its class, its public numbers, and whether its lazy set-up ran."""
        return [(type(c).__qualname__, {k: v for k, v in vars(c).items()
                                         if not k.startswith("_") and isinstance(v, self._KINDS)},
                 _internals.monitor_op_chosen(c))
                for c in self.callbacks]

    def load(self, states: list) -> None:
        self.pending = states

    def apply(self) -> None:
        """Sets the states taken into the callbacks of the same class at the same place in the
        list (one that differs there is left as it is). A callback whose set-up ran on rank 0
        runs its own first: Keras's monitoring callbacks (ReduceLROnPlateau, EarlyStopping,
        ModelCheckpoint) choose their comparison at their first epoch end and turn min_delta's
        sign with it; rank 0's turned min_delta set before a set-up of the joiner's own would
        be turned back (a near-tie counted as an improvement: another learning rate)."""
        if self.pending is None:
            return
        for c, (kind, attrs, set_up) in zip(self.callbacks, self.pending):
            if type(c).__qualname__ == kind:
                if set_up and not _internals.monitor_op_chosen(c):
                    _internals.choose_monitor_op(c)
                for k, v in attrs.items():
                    setattr(c, k, v)
        self.pending = None


class RankZeroOutput:
    """Between start() and stop(): progress output, model.save and model.save_weights on rank 0
    only (see the module's doc). The rank is read at each use: after a failure rank 0 may be
    another worker."""

    def __init__(self, model):
        self.model = model
        self._interactive = None  # Keras's setting before start(), to put back
        self._own = {}

    def start(self) -> None:
        self._interactive = _internals.interactive_logging()
        self.refresh()
        for method in ("save", "save_weights"):
            own = getattr(self.model, method)
            self._own[method] = own
            setattr(self.model, method, self._on_rank_zero(own))

    def refresh(self) -> None:
        """Progress output on if this worker is rank 0 (and it was on before start())."""
        # A joiner is never rank 0 (joiners take rank 0's state), and a warm spare that has no
        # place yet must not wait for one here (kungfu/_spare.py).
        if self._interactive and not _peer.joining() and _peer.identity().rank == 0:
            _internals.set_interactive_logging(True)
        else:
            _internals.set_interactive_logging(False)

    def stop(self) -> None:
        for method, own in self._own.items():
            setattr(self.model, method, own)
        self._own = {}
        if self._interactive is not None:
            _internals.set_interactive_logging(self._interactive)

    @staticmethod
    def arrange(callbacks: list, name: str) -> None:
        """Before model.fit sets its callbacks up: on every worker but rank 0, each of _WRITERS
        that writes where every worker writes is replaced (in the list) by the hooks of it that
        run everywhere; one that writes where some worker does not (a folder per worker, or a
        callback given to rank 0 only) stays. Every worker takes part (a collective of the
        paths, whether it has such callbacks or not), once per fit, with the ranks then: a
        worker that joins later runs none of them. (If rank 0 is lost, these files end there.)"""
        found = [(i, everywhere, os.path.abspath(os.fspath(getattr(c, attr))))
                 for i, c in enumerate(callbacks)
                 for kind, attr, everywhere in _WRITERS if isinstance(c, kind)]
        everyone = None  # every worker's paths; a joiner does not know them
        if not _peer.joining():
            me = _peer.identity()
            if me.size == 1:
                return
            everyone = _collective.allgather_object([p for _, _, p in found], name=name)
            if me.rank == 0:
                return
        for i, everywhere, path in found:
            if everyone is None:  # a joiner: kf.Hook gives it rank 0's state (no restore)
                callbacks[i] = _Muted(callbacks[i], ())
            elif all(path in theirs for theirs in everyone):
                callbacks[i] = _Muted(callbacks[i], everywhere)

    @staticmethod
    def _on_rank_zero(write):
        def on_rank_zero(filepath, *args, overwrite=True, **kwargs):
            if _peer.identity().rank != 0:
                return None
            if not isinstance(filepath, (str, os.PathLike)) or (
                    not overwrite and os.path.exists(filepath)):
                return write(filepath, *args, overwrite=overwrite, **kwargs)
            path = os.fspath(filepath)
            folder, name = os.path.split(path)
            # The same name after a prefix: Keras checks the suffix (.keras, .weights.h5).
            tmp = os.path.join(folder, f".tmp{os.getpid()}-{name}")
            try:
                result = write(tmp, *args, overwrite=True, **kwargs)
                os.replace(tmp, path)
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
            return result

        on_rank_zero.__wrapped__ = write
        return on_rank_zero


class LearningRateWarmupCallback(keras.callbacks.Callback):
    """Gradual warmup (Goyal et al.), as Horovod's callback of this name: over the first
    `warmup_epochs` epochs the learning rate grows linearly, step by step, from about
    initial_lr / size to initial_lr (the rate for the whole cluster's batch), reached on the last
    warmup batch (batch b of epoch e trains at the fraction (e + (b + 1) / steps) / warmup_epochs
    of the way, as Horovod's callback does), then stays there
    for other callbacks and policies to change. `steps_per_epoch`: Keras's count when None (an
    input of unknown length then warms up per epoch). The size is the cluster's at each step, so
    an elastic job's warmup follows its resizes. Every worker computes the same rate."""

    def __init__(self, initial_lr: float, warmup_epochs: float = 5, steps_per_epoch=None,
                 verbose: int = 0):
        super().__init__()
        self.initial_lr = check_learning_rate(initial_lr)
        if (isinstance(warmup_epochs, bool) or not isinstance(warmup_epochs, (int, float))
                or not warmup_epochs > 0):
            raise ValueError(f"warmup_epochs must be a positive number, got {warmup_epochs!r}")
        self.warmup_epochs = warmup_epochs
        self.steps_per_epoch = steps_per_epoch
        self.verbose = verbose
        self._epoch = 0
        self._done = False

    def rate(self, epoch: int, batch: int, size: int) -> float:
        # Horovod's schedule: batch b trains at the progress reached after it, so the last batch
        # of the warmup trains at the full rate (with batch / steps it came one batch late).
        steps = self.steps_per_epoch or (self.params or {}).get("steps") or 0
        done = epoch + ((batch + 1) / steps if steps else 1.0)
        progress = min(1.0, done / self.warmup_epochs)
        return self.initial_lr * (1.0 / size + (1.0 - 1.0 / size) * progress)

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        if self._done:
            return
        if self._epoch >= self.warmup_epochs:
            self._done = True
            self.model.optimizer.learning_rate = self.initial_lr
            if self.verbose and _peer.identity().rank == 0:
                print(f"Epoch {self._epoch + 1}: warmup done, learning rate {self.initial_lr:g}")
            return
        self.model.optimizer.learning_rate = self.rate(self._epoch, batch,
                                                       _peer.identity().size)
