"""`Loop`: a training loop's driver of adaptation and elasticity, for any framework. kf.Hook
(kungfu/tensorflow/_hook.py, Keras's model.fit and custom loops) and kungfu.torch's
ElasticTrainer are Loops; a Loop is the trainer (kungfu.elastic.Trainer) of the decision round
and of the membership machine.

    loop.before_train()
    for epoch in range(E):
        loop.before_epoch()
        for x, y, w in data.epoch_batches():   # this worker's part of each step (ElasticData)
            loop.before_step(); out = step(x, y, w); loop.after_step({"loss": loss})
        loop.after_epoch()
    loop.after_train()

Decisions recorded by the policies are agreed and applied by the decision round
(kungfu/elastic/_round.py) on every worker at the end of before_train, of every after_step, of
after_epoch and of after_train, so a decision takes effect from the next step; one taken in
before_epoch or before_step takes effect after that step. Every worker runs the same hooks at
the same steps, so policies may call collectives in them.

Recovery (an elastic job, a step wrapped by `guard` on batches of ElasticData): the Loop
commits the training state in memory at every step boundary (after the step's decisions were
applied) and at every epoch end: the variables its binding names (kungfu.elastic.Variables),
its own state, the policies' state and the data position. When a collective fails because a
peer died or hangs (in the step, or in the Loop's own agreement), the survivors agree on who is
left and on the commit to roll back to (Membership.recover), restore it, redo the commits this
worker had made since (at most one), and redo the failed step on the same samples, now split
among the survivors. With `checkpoint="path"`, rank 0 also writes the commit to that file
(every `checkpoint_every` steps and at each epoch's end, atomically), and training that starts
with the file there resumes from it, at any cluster size (docs/elastic.md).

A framework's Loop supplies its variables' binding (`_binding`), its optimizer's learning rate
(`_learning_rate`, `_set_learning_rate`), and the errors of a lost peer its steps raise
(`recoverable`).
"""
from __future__ import annotations

import math
import os
import sys
import time
from typing import List, Optional, Union

from kungfu import _env, _peer, elastic as _elastic, errors, timeline
from kungfu.elastic import Membership, Round, TrainingState, Variables
from kungfu.policy import BasePolicy


def lower_priority() -> None:
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


class ClusterLogs:
    """The cluster's numbers a Loop adds to a step's and an epoch's logs (cluster_logs=False:
    none), where TensorBoard and progress bars find them: per step (the last step's) and per
    epoch (the epoch's mean step time, samples/s and allreduce bandwidth)."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.epoch_totals = [0.0, 0, 0.0, 0]  # seconds, samples, allreduce bytes, steps
        self.traffic = 0  # bytes the runtime allreduced so far
        self.last_bytes = 0  # ... in the last step

    def begin_epoch(self) -> None:
        self.epoch_totals = [0.0, 0, 0.0, 0]

    def count(self, elapsed: float, samples: int) -> None:
        """Adds a step to the epoch's totals; reads the runtime's allreduce byte counter."""
        nbytes = sum(c[2] for c in _peer.get().strategy_counters()) if _peer.started() else 0
        self.last_bytes = max(nbytes - self.traffic, 0)  # a new native peer starts at 0
        self.traffic = nbytes
        t = self.epoch_totals
        t[0] += elapsed
        t[1] += samples
        t[2] += self.last_bytes
        t[3] += 1

    def step(self, s: TrainingState) -> dict:
        """For a step's logs: size, global batch, and the last step's time, samples/s and
        allreduce bandwidth (bytes/s over the step)."""
        if not self.enabled:
            return {}
        m = s.metrics
        out = {"cluster_size": s.cluster_size}
        if s.global_batch_size is not None:
            out["global_batch_size"] = s.global_batch_size
        if "step_time" in m:
            out["step_time"] = m["step_time"]
            out["samples_per_sec"] = m.get("throughput", 0.0)
            out["allreduce_bytes_per_sec"] = self.last_bytes / m["step_time"]
        return out

    def epoch(self, s: TrainingState) -> dict:
        """The same over the epoch that ended: mean step time, samples/s, bandwidth."""
        if not self.enabled:
            return {}
        out = self.step(s)
        seconds, samples, traffic, steps = self.epoch_totals
        if seconds > 0:
            out.update(step_time=seconds / steps, samples_per_sec=samples / seconds,
                       allreduce_bytes_per_sec=traffic / seconds)
        return out


def _checkpoint_key(key: Union[str, bytes, None]) -> Union[str, bytes, None]:
    """The key a checkpoint is signed with: `key`, else KUNGFU_CHECKPOINT_KEY, else None (the
    file is only checksummed). A string key must be as strong as a job token (kungfu/_env.py);
    bytes at least 16."""
    if key is None:
        return _env.CHECKPOINT_KEY.get()
    if isinstance(key, str):
        return _env.check_checkpoint_key(key)
    if not isinstance(key, bytes) or len(key) < 16:
        raise ValueError("checkpoint_key must be a str as strong as a job token, or at least 16 "
                         f"random bytes; make one with: {_env.MAKE_TOKEN}")
    return key


class Loop(_elastic.Trainer):
    """Runs policies (kf.BasePolicy) at a training loop's step boundaries and applies their
    actions consistently on every worker; drives resize and recovery (module doc). `data`: an
    ElasticData (needed for kf.set_batch_size and for recovery); `optimizer`: the framework's.
    """

    # The errors of a collective that failed because a peer died or hangs: recovered from.
    recoverable: tuple = (errors.PeerFailedError, errors.OpTimeoutError)
    face = "the training loop"  # how messages name it (kf.Hook, kf.ElasticTrainer)

    def __init__(self, *policies: BasePolicy, data=None, optimizer=None, name: str,
                 exit_on_detach: bool = True, checkpoint: Optional[str] = None,
                 checkpoint_every: int = 100, cluster_logs: bool = True,
                 checkpoint_key: Union[str, bytes, None] = None):
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
                raise TypeError(f"{self.face} takes kf.BasePolicy instances, got "
                                f"{type(p).__name__}")
        self.policies = list(policies)
        self.data = data
        self._optimizer = optimizer
        self._name = name
        self.state = TrainingState()
        self._step_start: Optional[float] = None
        self._part: Optional[tuple] = None  # this worker's part of the step (ElasticData.part)
        self._report: Optional[dict] = None  # what this worker measured, for the agreement
        self.exit_on_detach = exit_on_detach
        self.epochs_total: Optional[int] = None
        self._epoch_shift = 0  # a joiner's or resumed job's epoch minus the loop's own
        self._epochs_begun = 0
        self._step_follows = False  # (step_follows)
        self._resumed = False  # a joiner whose first epoch continues the others' epoch
        self._train_fn = None  # the guarded step (guard)
        self._equal_after_step = False  # make the workers' variables equal after a step
        self._cluster = ClusterLogs(cluster_logs)
        # Resize, recovery, commits and the checkpoint (kungfu/elastic).
        self.membership = Membership(self, self._binding())
        self.membership.checkpoint = checkpoint
        self.membership.checkpoint_every = checkpoint_every
        self.membership.checkpoint_key = _checkpoint_key(checkpoint_key)
        # The policies' decisions: recorded, agreed and applied (kungfu/elastic/_round.py).
        self.round = Round(self, self.membership, name)

    # -- what a framework's Loop supplies -------------------------------------------------------

    def _binding(self) -> Variables:
        """The variables a commit holds and a joiner takes (called once, by __init__)."""
        raise NotImplementedError

    def _learning_rate(self, bits: int = 64) -> Optional[float]:
        """The optimizer's learning rate now (as a float of `bits`), None if it has none."""
        return None

    def _set_learning_rate(self, lr: float) -> None:
        raise RuntimeError(f"{self.face} cannot set a learning rate")

    def _monitor_logs(self) -> dict:
        """The monitored estimates (gns, grad_variance) for the logs and the policies."""
        return {}

    def _monitor_metrics(self) -> dict:
        return {}

    def _start_equal(self) -> None:
        """Training begins (not resumed, not joining): make the workers' variables equal."""

    def _step_logs(self, out) -> dict:
        """What a step that was run again returned, as logs."""
        return dict(out) if isinstance(out, dict) else {}

    def _step_again(self):
        """Runs the training step at the data's position once more (see _train_again)."""
        batch = self.data.step_batch()
        self.data.commit()
        return self._train_fn(*batch)

    # -- plumbing ---------------------------------------------------------------------------

    @property
    def optimizer(self):
        return self._optimizer

    def _run(self, hook: str) -> None:
        self.state.metrics.update(self._monitor_metrics())
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
    # Trainer).

    def step_follows(self) -> bool:
        return self._step_follows

    def _training_ends_here(self) -> bool:
        """At a step's end: whether it was the last (a loop does not say: no)."""
        return False

    def set_batch_size(self, b: int) -> None:
        if self.data is not None:
            self.data.set_batch_size(b)
        self.state.local_batch_size = b
        monitor = getattr(self.optimizer, "kungfu_monitor", None)
        if monitor is not None:
            monitor.set_batch_size(b)
        self.refresh_sizes()

    def set_batch_sizes(self, sizes: list) -> None:
        if self.data is None:
            raise RuntimeError(f"kf.set_batch_sizes needs kungfu's data: pass "
                               f"data=kf.ElasticData(...) to {self.face} and train on "
                               "its batches")
        self.data.set_batch_sizes(sizes)
        self.refresh_sizes()

    def set_learning_rate(self, lr: float) -> None:
        if self.optimizer is None:
            raise RuntimeError(f"kf.set_learning_rate needs an optimizer: pass optimizer= to "
                               f"{self.face}")
        self._set_learning_rate(lr)
        self.state.learning_rate = lr

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
        lr = self._learning_rate()
        s.learning_rate = s.learning_rate if lr is None else lr

    def on_detached(self) -> None:
        lower_priority()

    @property
    def detached(self) -> bool:
        """Whether a resize (or the survivors of a failure) left this worker out."""
        return self.membership.detached

    def _exit_if_detached(self) -> None:
        """At the end of training, with exit_on_detach: a worker a resize (or the survivors of a
        failure) left out leaves the job with exit code 0, now (an interpreter shutdown could
        wait on the framework's threads, tf.data's for one)."""
        if not (self.detached and self.exit_on_detach):
            return
        timeline.close()  # no exit handlers run: its trace file ends here
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)

    @property
    def recoveries(self) -> List[dict]:
        """The failures this worker survived: who was lost, when, and the recovery's times."""
        return self.membership.recoveries

    def _join(self) -> None:
        """A worker joining a running elastic job: connect, then take the others' state."""
        self.membership.join()
        self._resumed = True
        self._continue_epochs()

    # -- recovery (kungfu/elastic has the protocol and the commits) ------------------------------

    def _unbuilt(self) -> str:
        """Why this loop's variables may be fewer than they will be (a model or optimizer that
        creates its variables in its first step), for a checkpoint's message; "" if not."""
        return ""

    def _resume(self) -> bool:
        """At the start of training, when the checkpoint file exists: every worker takes its
        state (Membership.resume) and the first epoch continues the checkpoint's."""
        if not self.membership.resume(self._unbuilt()):
            return False
        # The first epoch is the checkpoint's, continued (mid-epoch) or begun (written at an
        # epoch's end).
        self._resumed = self.state.step_in_epoch > 0
        self._continue_epochs()
        return True

    def _continue_epochs(self) -> None:
        """A joiner or a resumed job goes on in the state's epoch: the epochs a loop gives to
        before_epoch are shifted."""
        self._epoch_shift = self.state.epoch

    def _recover(self, error: Exception) -> None:
        """A collective failed: roll back with the other survivors (Membership.recover), then
        redo this worker's commits since. Raises `error` itself when recovery is off or not
        possible."""
        for kind in self.membership.recover(error):  # at most one
            if kind == "epoch":
                self._end_epoch()
            elif kind == "start":  # a survivor that had not started when the peer was lost
                self._start()
            else:
                self._step_start = time.perf_counter()
                self._train_again()
                self.after_step(None)

    def _train_again(self):
        """Runs the training step at the data's position (the step a failure undid) again
        (_step_again); returns what it returns."""
        while True:
            try:
                out = self._step_again()
                self.recoveries[-1].setdefault("step_done_at", time.time())
                return out
            except self.recoverable as e:
                self._recover(e)

    def _guard(self, train_fn):
        """`train_fn` made to survive a lost peer (see _recover)."""
        self._train_fn = train_fn

        def train_function(*args, **kwargs):
            try:
                return train_fn(*args, **kwargs)
            except self.recoverable as e:
                self._recover(e)
                return self._train_again()

        train_function.kungfu_guarded = train_fn
        return train_function

    def guard(self, train_step):
        """`train_step` made to survive a lost peer. Call the result on the batches of
        `data.epoch_batches()` (train_step(x, y, sample_weight), or (x, w) without y) between
        before_step and after_step. In an elastic job, when a peer dies or hangs, it rolls back
        with the other survivors and runs train_step again on the same samples split among them
        (its return value is that run's). Outside an elastic job it changes nothing."""
        if self.data is None:
            raise ValueError(f"{self.face}.guard needs kungfu's data: "
                             f"{self.face}(..., data=kf.ElasticData(...)), and batches "
                             "from data.epoch_batches()")
        if not _elastic.context().enabled:
            return train_step
        self.membership.recovering = True
        return self._guard(train_step)

    # -- the hooks of a loop ------------------------------------------------------------------

    def before_train(self) -> None:
        self._epochs_begun = 0
        self.membership.begin()
        if _peer.joining():
            self._join()
            self.membership.commit("start")
            return  # the others are in the middle of training: join them at their next step
        self._say_if_unrecoverable()
        # The state before the first collective: a peer lost while the job starts (before it
        # connected, in the broadcast of rank 0's state, in the first agreement) is recovered
        # from like any later loss, by starting again from here with the survivors.
        self.membership.commit("init")
        self._start()

    def _why_no_recovery(self) -> Optional[str]:
        """Why this loop cannot recover from a lost worker in an elastic job (None: it can)."""
        if self.membership.recovering:
            return None
        return (f"its training step is not wrapped by {self.face}.guard (before "
                "before_train), which needs data=kf.ElasticData(...)")

    def _say_if_unrecoverable(self) -> None:
        """In an elastic job whose training cannot recover from a lost worker, rank 0 says so as
        training starts, and tells the launchers (which then say that a failure ends the job,
        not that the others go on)."""
        why = self._why_no_recovery() if _elastic.context().enabled else None
        if why is not None and _peer.identity().rank == 0:
            _elastic.context().mark_no_recovery(why)

    def _start(self) -> None:
        """The start of training (a checkpoint resumed, or rank 0's variables on every worker;
        the policies' before_train and its agreement), run again with the survivors when a peer
        is lost meanwhile; then the "start" commit."""
        while True:
            try:
                self._start_once()
                break
            except self.recoverable as e:
                self.membership.recover(e)  # back to the "init" commit: nothing to redo
        self.membership.commit("start")

    def _start_once(self) -> None:
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
            # A batch index counts the batches of this iteration over the data, as the data's
            # own counter does (a joiner's first iteration starts mid-epoch).
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
            # allreduce (the optimizers measure it). Every worker's rides on the agreement
            # below: policies see them as metrics["compute_times"] next step.
            wait = getattr(self.optimizer, "kungfu_allreduce_wait", math.nan)
            s.metrics["compute_time"] = elapsed - (wait if math.isfinite(wait) else 0.0)
            part = self._part
            self._report = {"compute_time": s.metrics["compute_time"],
                            "part_size": 0 if part is None else len(part[0]) * (part[1] > 0)}
            if s.step_in_epoch == 1:  # after the epoch-end decisions: agreed?
                self._report["same"] = {"learning rates": str(self._learning_rate(32))}
        estimates = self._monitor_logs()
        s.metrics.update(estimates)
        if logs is not None:
            logs.update(estimates)
            s.logs = logs
        self._run("after_step")
        try:
            self._agree_and_apply(step_follows=not self._training_ends_here())
        except self.recoverable as e:
            # Rolled back to before this step: train it again, then come back here.
            self._recover(e)
            redone = self._train_again()
            if logs is not None:
                logs.update(self._step_logs(redone))
            self.after_step(logs)
            return
        self.membership.commit("step")

    def after_epoch(self, logs: Optional[dict] = None) -> None:
        if logs is not None:
            logs.update(self._monitor_logs())
            self.state.logs = logs
        self._end_epoch()

    def _end_epoch(self) -> None:
        self._run("after_epoch")
        try:
            self._agree_and_apply()
        except self.recoverable as e:
            self._recover(e)  # rolled back to this epoch's last step: end the epoch again
            self._end_epoch()
            return
        # An epoch cut short (model.fit's stop_training) still ends here; it is not written
        # to the checkpoint as ended.
        # In a loop epoch_batches() moves the data to the next epoch itself, when its
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
        except self.recoverable as e:
            self._recover(e)  # rolled back to the last commit: end training again
            self.after_train()
            return
        self.round.close()
        self.membership.finish()
