"""`kf.Hook`: runs adaptation policies in `model.fit` (as a Keras callback) or in a custom loop.

    model.fit(data.dataset(), callbacks=[kf.Hook(MyPolicy(), data=data)])

    hook = kf.Hook(MyPolicy(), optimizer=opt, data=data)       # a custom loop
    step = hook.guard(train_step)              # survives a lost peer in an elastic job
    hook.before_train()
    for epoch in range(E):
        hook.before_epoch()
        for x, y, w in data.epoch_batches():   # or any loop; state.local_batch_size is the size
            hook.before_step(); loss = step(x, y, w); hook.after_step({"loss": loss})
        hook.after_epoch()
    hook.after_train()

Decisions recorded by the policies are agreed and applied by the Hook's decision round
(kungfu/elastic/_round.py; the Hook is its trainer and applies batch size and learning rate) on
every worker at the end of before_train, of every after_step, of after_epoch and of
after_train, so a decision takes effect from the next step; one taken in before_epoch or
before_step takes effect after that step. Per step:
1. before the step the policies' `before_step` run; in model.fit the data (if given) is then
   released to make this step's batch (tf.data reads ahead; this keeps it from making a batch
   before the decisions that shape it were applied);
2. after the step the training state is updated (step, samples, step time, throughput, the
   monitored `gns` / `grad_variance`, which also go into Keras's logs), `after_step` runs, and
   the decisions are agreed and applied.

Over a dataset of unknown length Keras calls on_train_batch_begin once more at the end of each
epoch, so `before_step` runs once more there without a step following.

Every worker runs the same hooks at the same steps, so policies may call collectives
(`kf.allreduce(kf.grad_noise_scale(), "avg")`) in them.

Resize and recovery are the membership state machine's (kungfu/elastic); the Hook drives it
and is its trainer: `self.membership`, with TensorFlow's variables bound by
kungfu/tensorflow/_variables.py.

Recovery (an elastic job with kungfu's data: model.fit, or a custom loop's step wrapped by
`guard`): the Hook commits the training state in memory at every step boundary (after the
step's decisions were applied) and at every epoch end:
the variables it syncs to joiners (model, optimizer, monitor; their current tensors, which
TensorFlow copies on the next write), its own state, the policies' state and the data position.
It wraps Keras's train function: when a collective fails because a peer died or hangs (in the
step, or in the Hook's own agreement), the survivors agree on who is left and on the commit to
roll back to (Membership.recover), restore it, redo the commits this worker had made since
(at most one), and redo the failed step on the same samples, now split among the survivors.
Keras sees one step.

With `checkpoint="path"`, rank 0 also writes the commit to that file (every `checkpoint_every`
steps and at each epoch's end, atomically), and training that starts with the file there resumes
from it, at any cluster size (docs/elastic.md, "The loss of the whole job").
"""
from __future__ import annotations

import math
import os
import sys
import time
import warnings
from typing import List, Optional

import keras

from kungfu import _peer, elastic as _elastic, timeline
from kungfu.elastic import Membership, Round, TrainingState
from kungfu.policy import BasePolicy
from kungfu.tensorflow._cluster_logs import ClusterLogs
from kungfu.tensorflow._monitor import monitor_logs, monitor_metrics
from kungfu.tensorflow._schedule import learning_rate
from kungfu.tensorflow._variables import KerasVariables
from kungfu.tensorflow.callbacks import (RECOVERABLE, CallbackStates, RankZeroOutput,
                                         combine_while_training, let_hooks_arrange_callbacks)
from kungfu.tensorflow.initializer import broadcast_variables, model_built, prepare_fit


def _lower_priority() -> None:
    """All that is left to a worker a shrink left out is to leave: its threads give the cores
    to the workers that stay (on a shared host its teardown would slow their next step down).
    Linux keeps a priority per thread, so each thread is set. Best effort."""
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tids = [0]
    for tid in tids:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, 19)
        except OSError:
            pass


def _samples_counted(model) -> float:
    """The samples Keras's loss tracker counted in this epoch (0 without one)."""
    tracker = getattr(model, "_loss_tracker", None)
    count = getattr(tracker, "count", None)
    return 0.0 if count is None else float(keras.ops.convert_to_numpy(count))


def _batch_of(data) -> int:
    """The number of samples in a batch as Keras counts them for its loss tracker: the rows of
    the first input. Read from the data, not from the tracker: a train_step written as Keras's
    guide writes it counts one per step (`update_state(loss)`)."""
    first = next(t for t in keras.tree.flatten(data) if t is not None)
    return int(first.shape[0])


def _numbers(logs) -> dict:
    """Keras's logs of a step as numbers where they are numbers ({} for what a custom loop's
    step returned). A custom train_step's logs may nest (the compiled metrics' entry is a dict of
    them) or hold what is no number: those are kept as they are, a dict's numbers converted."""
    if not isinstance(logs, dict):
        return {}
    out = {}
    for k, v in logs.items():
        if isinstance(v, dict):
            out[k] = _numbers(v)
            continue
        try:
            out[k] = float(keras.ops.convert_to_numpy(v))
        except (TypeError, ValueError):
            out[k] = v
    return out


class Hook(keras.callbacks.Callback):
    """Runs policies (kf.BasePolicy) and applies their actions consistently on every worker;
    adds the monitored estimates and the cluster's numbers (`cluster_logs`: cluster_size,
    global_batch_size, step_time, samples_per_sec, allreduce_bytes_per_sec) to Keras's logs,
    where TensorBoard finds them. `data`: a kungfu.tensorflow.data.ElasticData
    (needed for kf.set_batch_size in model.fit); `optimizer`: for custom loops (in model.fit the
    model's optimizer is used)."""

    def __init__(self, *policies: BasePolicy, data=None, optimizer=None, name: str = "kungfu/hook",
                 exit_on_detach: bool = True, checkpoint: Optional[str] = None,
                 checkpoint_every: int = 100, rank_zero_output: bool = True,
                 cluster_logs: bool = True):
        super().__init__()
        if checkpoint is not None and (isinstance(checkpoint_every, bool) or not isinstance(
                checkpoint_every, int) or checkpoint_every < 1):
            raise ValueError(f"checkpoint_every must be a positive number of steps, got "
                             f"{checkpoint_every!r}")
        # A file rank 0 keeps the last commit in (every `checkpoint_every` steps and at each
        # epoch's end); training that starts with it there resumes from it (see _resume).
        checkpoint = None if checkpoint is None else os.fspath(checkpoint)
        if checkpoint is not None:
            # Every worker may become rank 0 (the writer) after a failure: each checks now,
            # rather than the job losing one rank 0 after the other to the same write error.
            _elastic.check_writable(checkpoint)
        for p in policies:
            if not isinstance(p, BasePolicy):
                raise TypeError(f"kf.Hook takes kf.BasePolicy instances, got {type(p).__name__}")
        self.policies = list(policies)
        self.data = data
        self._optimizer = optimizer
        self._name = name
        self.state = TrainingState()
        self._step_start: Optional[float] = None
        self._part: Optional[tuple] = None  # this worker's part of the step (ElasticData.part)
        self._report: Optional[dict] = None  # what this worker measured, for the agreement
        self.exit_on_detach = exit_on_detach
        self.rehearsed = False  # a joiner in model.fit: ran its step before reporting ready
        self.epochs_total: Optional[int] = None
        self._epoch_shift = 0  # a custom loop's: a joiner's or resumed job's epoch minus its own
        self._progbars: list = []  # Keras's progress bars in model.fit (kungfu_arrange)
        self._step_follows = False  # (step_follows)
        self._states = CallbackStates()  # the other callbacks' counters, for joiners
        self.shared_state, self.load_shared_state = self._states.read, self._states.load
        self._resumed = False  # a joiner whose first Keras epoch continues the others' epoch
        self._train_fn = None  # Keras's own train function (the model's is wrapped)
        self._equal_after_step = False  # the model was not built at the start (_start_equal)
        self.rank_zero_output = rank_zero_output  # model.fit: output on rank 0 (callbacks.py)
        self._cluster = ClusterLogs(cluster_logs)  # model.fit: the cluster's numbers in the logs
        self._output: Optional[RankZeroOutput] = None
        let_hooks_arrange_callbacks()  # kungfu_arrange sees each fit's callbacks first
        # Resize, recovery, commits and the checkpoint (kungfu/elastic).
        self.membership = Membership(self, KerasVariables(self))
        self.membership.checkpoint = checkpoint
        self.membership.checkpoint_every = checkpoint_every
        # The policies' decisions: recorded, agreed and applied (kungfu/elastic/_round.py).
        self.round = Round(self, self.membership, name)

    # -- plumbing ---------------------------------------------------------------------------

    @property
    def optimizer(self):
        if self._optimizer is not None:
            return self._optimizer
        model = getattr(self, "model", None)
        return None if model is None else model.optimizer

    def _run(self, hook: str) -> None:
        self.state.metrics.update(monitor_metrics(self.optimizer))
        self.round.run(hook)

    def _agree_and_apply(self, step_follows: bool = False) -> None:
        self._step_follows = step_follows  # (Trainer.step_follows: switch joiners in?)
        try:
            reports = self.round.agree(self._report)
        finally:
            self._step_follows = False
        self._report = None
        if all(r is not None for r in reports):  # every worker's, in rank order
            self.state.metrics["compute_times"] = [r["compute_time"] for r in reports]
            self.state.metrics["part_sizes"] = [r["part_size"] for r in reports]

    # What the decision round and the membership machine need of their trainer (kungfu.elastic.
    # Trainer; also shared_state and load_shared_state: the other callbacks', set in __init__).

    def step_follows(self) -> bool:
        return self._step_follows

    def _training_ends_here(self) -> bool:
        """At a step's end: whether it was the last (fit stops, or the last epoch ran out)."""
        model, s = getattr(self, "model", None), self.state
        steps = (getattr(self, "params", None) or {}).get("steps")
        return (model is not None and model.stop_training) or (
            None not in (self.epochs_total, steps)
            and s.epoch + 1 >= self.epochs_total and s.step_in_epoch >= steps)

    def set_batch_size(self, b: int) -> None:
        if self.data is not None:
            self.data.set_batch_size(b)
        elif getattr(self, "model", None) is not None:
            raise RuntimeError("kf.set_batch_size needs kungfu's data in training: pass "
                               "data=kf.ElasticData(...) to kf.Hook and train on data.dataset()")
        self.state.local_batch_size = b
        monitor = getattr(self.optimizer, "kungfu_monitor", None)
        if monitor is not None:
            monitor.set_batch_size(b)
        self.refresh_sizes()

    def set_batch_sizes(self, sizes: list) -> None:
        if self.data is None:
            raise RuntimeError("kf.set_batch_sizes needs kungfu's data: pass "
                               "data=kf.ElasticData(...) to kf.Hook and train on its batches")
        self.data.set_batch_sizes(sizes)
        self.refresh_sizes()

    def set_learning_rate(self, lr: float) -> None:
        opt = self.optimizer
        if opt is None:
            raise RuntimeError("kf.set_learning_rate needs an optimizer: pass optimizer= to "
                               "kf.Hook in a custom loop")
        try:
            opt.learning_rate = lr
        except (TypeError, ValueError) as e:
            raise RuntimeError(f"cannot set the learning rate of {type(opt).__name__} "
                               f"(a schedule?): {e}") from e
        self.state.learning_rate = lr

    def check_resize(self, n: int, leave) -> None:
        if (self.model is not None and self.data is None
                and n > _peer.identity().size - len(leave)
                and _elastic.context().pending is None):
            raise RuntimeError("growing the cluster in model.fit needs kungfu's data: pass "
                               "data=kf.ElasticData(...) to kf.Hook (joiners continue from its "
                               "sample offset)")

    def refresh_sizes(self) -> None:
        s = self.state
        me = _peer.identity()
        s.rank, s.cluster_size = me.rank, me.size
        d = self.data
        if d is not None:
            if d.batch_sizes is not None and len(d.batch_sizes) != s.cluster_size:
                d.batch_sizes = None  # a split is for the size it was made for
            s.batch_sizes = d.sizes(s.cluster_size)
            s.local_batch_size = s.batch_sizes[s.rank]
            s.global_batch_size = sum(s.batch_sizes)
        elif s.local_batch_size is not None:
            s.global_batch_size = s.local_batch_size * s.cluster_size
        lr = learning_rate(self.optimizer)
        s.learning_rate = s.learning_rate if lr is None else lr

    def on_detached(self) -> None:
        _lower_priority()
        if getattr(self, "model", None) is not None:
            self.model.stop_training = True

    @property
    def detached(self) -> bool:
        """Whether a resize (or the survivors of a failure) left this worker out."""
        return self.membership.detached

    @property
    def recoveries(self) -> List[dict]:
        """The failures this worker survived: who was lost, when, and the recovery's times."""
        return self.membership.recoveries

    def _join(self) -> None:
        """A worker joining a running elastic job: connect, then take the others' state."""
        if self.data is None and getattr(self, "model", None) is not None:
            raise RuntimeError("a worker joining an elastic job continues from the others' "
                               "sample offset: pass data=kf.ElasticData(...) to kf.Hook")
        self.membership.join()
        self._resumed = True
        self._continue_epochs()

    def _rehearse(self) -> None:
        """A joiner in model.fit, before it reports ready: runs one training step alone (a
        cluster of one, on a batch of weight 0), so that tracing the step function and its
        first run happen while the others keep training, not in the pause after the switch.
        What the step changed is then replaced by rank 0's state (Membership._sync)."""
        fn = getattr(getattr(self, "model", None), "train_function", None)
        if fn is None or self.data is None:
            return
        try:
            with _peer.solo():
                fn(iter(self.data.rehearsal_dataset()))
            self.rehearsed = True
        except Exception as e:  # noqa: BLE001 - the real first step then traces; say why
            warnings.warn(f"kungfu: this joiner could not rehearse its training step ({e}); "
                          "it is traced after the switch instead")

    # -- recovery (kungfu/elastic has the protocol and the commits) ------------------------------

    def _resume(self) -> bool:
        """At the start of training, when the checkpoint file exists: every worker takes its
        state (Membership.resume) and Keras's first epoch continues the checkpoint's."""
        if not self.membership.resume():
            return False
        # The first epoch is the checkpoint's, continued (mid-epoch) or begun (written at an
        # epoch's end).
        self._resumed = self.state.step_in_epoch > 0
        self._continue_epochs()
        if self.data is not None and self.data.attached:
            # model.fit: the data's epochs are counted from the checkpoint's position, whether
            # its epoch is continued or begun (else the first batch waits for a release of an
            # epoch the Hook never reaches).
            self.data.attach()
        return True

    def _continue_epochs(self) -> None:
        """A joiner or a resumed job goes on in the state's epoch. model.fit counts its epochs
        from there: Keras (3.x; checked with 3.15) reads the model's `_initial_epoch` after the
        callbacks' on_train_begin (BackupAndRestore sets it so too), so its "Epoch e/E" lines,
        its number of epochs and the epoch numbers the callbacks see are the job's. A custom
        loop's epochs given to before_epoch are shifted instead."""
        model = getattr(self, "model", None)
        if model is None:
            self._epoch_shift = self.state.epoch
        else:
            model._initial_epoch = self.state.epoch

    def _count_steps(self, batch: int) -> None:
        """Keras's progress bar takes an epoch's number of steps of kungfu's data (its length
        unknown to Keras) from the first epoch and keeps it; an epoch has as many as its samples
        left make at the cluster's batch sizes (fewer in a resumed or joined epoch, others after
        a resize). The bar's total is set at each step: Keras's batch index plus the steps
        left."""
        d = self.data
        try:
            left = len(d) - d.offset
        except TypeError:  # a stream whose length is known after its first epoch
            return
        total = batch + -(-left // sum(d.sizes(self.state.cluster_size)))
        for bar in self._progbars:
            bar.target = total
            if bar.progbar is not None:
                bar.progbar.target = total

    def _recover(self, error: Exception) -> None:
        """A collective failed: roll back with the other survivors (Membership.recover), then
        redo this worker's commits since. Raises `error` itself when recovery is off or not
        possible."""
        for kind in self.membership.recover(error):  # at most one
            if kind == "epoch":
                self._end_epoch()
            else:
                self._step_start = time.perf_counter()
                self._train_again()
                self.after_step(None)

    def _train_again(self):
        """Runs the training step at the data's position (the step a failure undid) again;
        returns what it returns. In model.fit on a dataset of that one batch (Keras's iterator
        is left where it is); in a custom loop on that batch, moving the position past it (as
        epoch_batches() does when it hands a batch out)."""
        while True:
            try:
                if self.model is not None:
                    logs = self._train_fn(iter(self.data.step_dataset()))
                else:
                    batch = self.data.step_batch()
                    self.data.commit()
                    logs = self._train_fn(*batch)
                self.recoveries[-1].setdefault("step_done_at", time.time())
                return logs
            except RECOVERABLE as e:
                self._recover(e)

    def _guard(self, train_fn):
        """`train_fn` made to survive a lost peer (see _recover)."""
        self._train_fn = train_fn

        def train_function(*args, **kwargs):
            try:
                return train_fn(*args, **kwargs)
            except RECOVERABLE as e:
                self._recover(e)
                return self._train_again()

        train_function.kungfu_guarded = train_fn
        return train_function

    def _keras_train_function(self, fn, recover: bool):
        """Keras's train function as model.fit calls it under the Hook: it survives a lost peer
        (`recover`: see _recover), and its logs carry the monitored estimates (gns,
        grad_variance), so every callback sees them whatever its place in the list (the epoch's
        logs get them in kungfu/tensorflow/callbacks.py)."""
        inner = self._guard(fn) if recover else fn
        model = self.model

        def train_function(*args, **kwargs):
            monitor = getattr(self.optimizer, "kungfu_monitor", None)
            learn_monitor = monitor is not None and not monitor.batch_known
            if learn_monitor or self.state.local_batch_size is None:
                # This worker's batch size, which the noise scale and policies need.
                logs, batch = self._measured_step(inner, args, kwargs)
                if batch > 0:
                    if learn_monitor:
                        monitor.set_batch_size(batch)
                    if self.state.local_batch_size is None:
                        self.state.local_batch_size = int(batch)
                        self.refresh_sizes()
            else:
                logs = inner(*args, **kwargs)
            model.kungfu_trained = True  # the next epoch logs are a training epoch's
            extra = {**monitor_logs(self.optimizer), **self._cluster.step(self.state)}
            if extra and isinstance(logs, dict):
                logs = {**logs, **extra}
            return logs

        train_function.kungfu_guarded = fn
        return train_function

    def _measured_step(self, train_fn, args, kwargs):
        """Runs Keras's train function once; returns its logs and the batch it trained on. With
        one step per call (Keras's default) the batch is taken from the iterator here and the
        function trains on it (Keras's functions take a list of batches as well); with more,
        from the samples its loss tracker counted over the call's steps."""
        model = self.model
        spe = int(keras.ops.convert_to_numpy(getattr(model, "steps_per_execution", 1)))
        if spe == 1 and len(args) == 1 and not kwargs:
            data = next(args[0])
            return train_fn([data]), _batch_of(data)
        before = _samples_counted(model)
        logs = train_fn(*args, **kwargs)
        return logs, (_samples_counted(model) - before) / spe

    def guard(self, train_step):
        """For a custom loop: `train_step` made to survive a lost peer. Call the result on the
        batches of `data.epoch_batches()` (train_step(x, y, sample_weight), or (x, w) without
        y) between before_step and after_step. In an elastic job, when a peer dies or hangs, it
        rolls back with the other survivors and runs train_step again on the same samples split
        among them (its return value is that run's). Outside an elastic job it changes
        nothing."""
        if self.data is None:
            raise ValueError("kf.Hook.guard needs kungfu's data: kf.Hook(..., data=kf.ElasticData"
                             "(...)), and batches from data.epoch_batches()")
        if not _elastic.context().enabled:
            return train_step
        self.membership.recovering = True
        return self._guard(train_step)

    # -- the hooks, for custom loops ----------------------------------------------------------

    def before_train(self) -> None:
        self._epochs_begun = 0
        self.membership.begin()
        if _peer.joining():
            self._join()
            self.membership.commit("start")
            return  # the others are in the middle of training: join them at their next step
        resumed = self.membership.checkpoint is not None and self._resume()
        if not resumed:
            self._start_equal()
        monitor = getattr(self.optimizer, "kungfu_monitor", None)
        if monitor is not None and not monitor.batch_known and self.data is not None:
            monitor.set_batch_size(self.data.batch_size)
        self.refresh_sizes()
        if not resumed:
            self._run("before_train")
        self._agree_and_apply()
        self.membership.commit("start")

    def _start_equal(self) -> None:
        """model.fit: every worker starts from rank 0's model and optimizer state (a custom
        loop's Hook does not know the model: call kf.broadcast_variables there). A model built
        by its first step takes rank 0's state after that step."""
        model = getattr(self, "model", None)
        self._equal_after_step = False
        if _peer.identity().size == 1 or model is None:
            return
        if not model_built(model):  # it creates its variables in its first step: after that
            self._equal_after_step = True
            return
        broadcast_variables(self.membership.variables.synced(), name=f"{self._name}/start")

    def before_epoch(self, epoch: Optional[int] = None) -> None:
        self._epochs_begun += 1
        self._cluster.begin_epoch()
        if self._resumed:  # a joiner's first epoch continues the others' current one
            self._resumed = False
            return
        if epoch is not None:
            self.state.epoch = epoch + self._epoch_shift
        self.state.step_in_epoch = 0
        self.state.samples_in_epoch = 0
        self._run("before_epoch")

    def before_step(self, batch: Optional[int] = None) -> None:
        self._run("before_step")
        d = self.data
        if d is not None:
            self._part = d.part(d.offset, self.state.rank, self.state.cluster_size)
            monitor = getattr(self.optimizer, "kungfu_monitor", None)
            if monitor is not None and len(self._part[0]):  # (empty: the epoch has ended)
                monitor.set_part(len(self._part[0]), self._part[1])
            # Keras's batch index counts the batches of this iteration over the data, as the
            # data's own counter does (a joiner's first iteration starts mid-epoch).
            self.data.release(self._epochs_begun - 1,
                              self.state.step_in_epoch if batch is None else batch)
        self._step_start = time.perf_counter()

    def after_step(self, logs: Optional[dict] = None) -> None:
        if self._equal_after_step:
            self._start_equal()
        s = self.state
        elapsed = time.perf_counter() - self._step_start if self._step_start else None
        if self.data is None:
            samples = s.global_batch_size or 0
        elif self.data.attached:
            samples = self.data.commit()  # with the size the step ran with (no switch yet)
        else:
            samples = self.data.last_length
        s.step += 1
        s.step_in_epoch += 1
        s.samples_seen += samples
        s.samples_in_epoch += samples
        if elapsed:
            s.metrics["step_time"] = elapsed
            if samples:
                s.metrics["throughput"] = samples / elapsed
            self._cluster.count(elapsed, samples)
            # This worker's compute: the step less its wait for the others in the gradients'
            # allreduce (kf.Optimizer's sync-sgd measures it). Every worker's rides on the
            # agreement below: policies see them as metrics["compute_times"] next step.
            wait = getattr(self.optimizer, "kungfu_allreduce_wait", math.nan)
            s.metrics["compute_time"] = elapsed - (wait if math.isfinite(wait) else 0.0)
            part = self._part
            self._report = {"compute_time": s.metrics["compute_time"],
                            "part_size": 0 if part is None else len(part[0]) * (part[1] > 0)}
            if s.step_in_epoch == 1:  # after the callbacks' epoch-end decisions: agreed?
                self._report["same"] = {"learning rates": str(learning_rate(self.optimizer, 32))}
        estimates = monitor_logs(self.optimizer)
        s.metrics.update(estimates)
        if logs is not None:
            logs.update(estimates)
            s.logs = logs
        self._run("after_step")
        try:
            self._agree_and_apply(step_follows=not self._training_ends_here())
        except RECOVERABLE as e:
            # Rolled back to before this step: train it again, then come back here.
            self._recover(e)
            redone = self._train_again()
            if logs is not None:
                logs.update(_numbers(redone))
            self.after_step(logs)
            return
        self.membership.commit("step")

    def after_epoch(self, logs: Optional[dict] = None) -> None:
        if logs is not None:
            logs.update(monitor_logs(self.optimizer))
            self.state.logs = logs
        self._end_epoch()
        if (self.epochs_total is not None and self.state.epoch >= self.epochs_total
                and getattr(self, "model", None) is not None):
            self.model.stop_training = True  # the job's last epoch ended (a joiner's too)

    def _end_epoch(self) -> None:
        self._run("after_epoch")
        try:
            self._agree_and_apply()
        except RECOVERABLE as e:
            self._recover(e)  # rolled back to this epoch's last step: end the epoch again
            self._end_epoch()
            return
        # An epoch that model.fit cut short (stop_training) still ends here; it is not written
        # to the checkpoint as ended.
        # In a custom loop epoch_batches() moves the data to the next epoch itself, when its
        # batches run out (offset 0 here); a rollback may have put it back at the end.
        d = self.data
        at_end = d is not None and d.epoch_done()
        whole = d is None or at_end or (not d.attached and d.offset == 0)
        self.state.epoch += 1
        self.state.step_in_epoch = self.state.samples_in_epoch = 0
        if d is not None and (d.attached or at_end):
            d.next_epoch()
        self.membership.commit("epoch", durable=whole)

    def after_train(self) -> None:
        self._run("after_train")
        try:
            self._agree_and_apply()
        except RECOVERABLE as e:
            self._recover(e)  # rolled back to the last commit: end training again
            self.after_train()
            return
        self.round.close()
        self.membership.finish()

    # -- Keras ----------------------------------------------------------------------------------

    _epochs_begun = 0

    def kungfu_arrange(self, callbacks: list) -> None:
        """Keras's callback list of a model.fit, before any callback's set_model: with
        rank_zero_output, the callbacks that write files write once (RankZeroOutput.arrange)."""
        self._progbars = [c for c in callbacks if isinstance(c, keras.callbacks.ProgbarLogger)]
        self._states.callbacks = [c for c in callbacks if c is not self]
        if self.rank_zero_output:
            RankZeroOutput.arrange(callbacks, f"{self._name}/writers")

    def on_train_begin(self, logs=None):
        spe = getattr(self.model, "steps_per_execution", 1)
        if self.data is not None and int(keras.ops.convert_to_numpy(spe)) != 1:
            raise ValueError("kf.Hook with kungfu data needs steps_per_execution=1")
        # Before the train function is wrapped below.
        prepare_fit(self.model, (self.params or {}).get("steps"))
        # Epoch metrics (validation too) over all workers while fit runs, so callbacks that
        # decide from them (EarlyStopping, ReduceLROnPlateau, ...) decide the same everywhere.
        combine_while_training(self.model, True)
        opt = self.optimizer
        self.model.kungfu_epoch_logs = lambda: {**monitor_logs(opt),
                                                **self._cluster.epoch(self.state)}
        if self.rank_zero_output and self._output is None:
            self._output = RankZeroOutput(self.model)
            self._output.start()
        self.epochs_total = (self.params or {}).get("epochs")
        fn = getattr(self.model, "train_function", None)
        if fn is not None:
            fn = getattr(fn, "kungfu_guarded", fn)  # a second fit: wrap Keras's own again
            recover = _elastic.context().enabled and self.data is not None
            self.model.train_function = self._keras_train_function(fn, recover)
            self.membership.recovering = recover
            # A peer lost while the epoch's metrics are combined (callbacks.py) recovers too.
            self.model.kungfu_recover = self._recover if recover else None
        if _peer.joining():
            self._rehearse()
            if self.data is not None:
                self.data.attach()  # before tf.data starts reading ahead
            self.before_train()  # connects and takes the others' state first
            if self.data is not None:
                self.data.attach()  # counts epochs from the position taken
            return
        if self.data is not None:
            self.data.attach()  # tf.data reads ahead: make each batch wait for its step
        self.before_train()  # a resume re-attaches the data at the checkpoint's position

    def on_epoch_begin(self, epoch, logs=None):
        self._states.apply()
        if self._output is not None:
            self._output.refresh()  # rank 0 may be another worker after a failure
        self.before_epoch(epoch)

    def on_train_batch_begin(self, batch, logs=None):
        self._states.apply()
        self.before_step(batch)
        if self.data is not None:
            self._count_steps(batch)

    def on_train_batch_end(self, batch, logs=None):
        self.after_step(logs)
        self._states.apply()  # rank 0's, taken at a switch here: before the epoch end, if any

    def on_epoch_end(self, epoch, logs=None):
        self.after_epoch(logs)

    def on_train_end(self, logs=None):
        try:
            self.after_train()
        finally:
            if self.data is not None:
                self.data.detach()
            if self._output is not None:
                self._output.stop()
                self._output = None
            combine_while_training(self.model, False)
            self.model.kungfu_recover = None
            self.model._initial_epoch = None  # a later fit counts from its own initial_epoch
        if self.detached and self.exit_on_detach:
            # A resize removed this worker: it leaves the job with exit code 0, now (an
            # interpreter shutdown could wait on tf.data's threads).
            timeline.close()  # no exit handlers run: its trace file ends here
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
