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

Decisions recorded by the policies (kungfu/policy/_actions.py) are agreed and applied on every
worker at the end of before_train, of every after_step, of after_epoch and of after_train, so a
decision takes effect from the next step; one taken in before_epoch or before_step takes effect
after that step. Per step:
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

Recovery (an elastic job with kungfu's data: model.fit, or a custom loop's step wrapped by
`guard`): the Hook commits the training state in memory at every step boundary (after the
step's decisions were applied) and at every epoch end:
the variables it syncs to joiners (model, optimizer, monitor; their current tensors, which
TensorFlow copies on the next write), its own state, the policies' state and the data position.
It wraps Keras's train function: when a collective fails because a peer died or hangs (in the
step, or in the Hook's own agreement), the survivors agree on who is left and on the commit to
roll back to (kungfu/_elastic.py, Elastic.recover), restore it, redo the commits this worker
had made since (at most one), and redo the failed step on the same samples, now split among
the survivors. Keras sees one step.

With `checkpoint="path"`, rank 0 also writes the commit to that file (every `checkpoint_every`
steps and at each epoch's end, atomically), and training that starts with the file there resumes
from it, at any cluster size (docs/elastic.md, "The loss of the whole job").
"""
from __future__ import annotations

import collections
import copy
import dataclasses
import os
import pickle
import sys
import time
import warnings
from typing import List, Optional

import keras
import numpy as np
import tensorflow as tf

from kungfu import _elastic, _env, _peer, errors
from kungfu.policy import HOOKS, BasePolicy, TrainingState, _actions, call_hook
from kungfu.store import ClusterConfig, StoreError
from kungfu.tensorflow import _monitor


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


def _describe(variables: list) -> list:
    """[(name, shape, dtype name)] of variables, to compare them across workers."""
    return [(getattr(v, "path", None) or v.name, tuple(int(d) for d in v.shape),
             tf.as_dtype(v.dtype).name) for v in variables]


def _mismatch(ours: list, theirs: list, here: str = "this joiner",
              there: str = "rank 0") -> str:
    """Why `here`'s variables cannot take those of `there` (described by _describe); "" if
    they can (the same model and optimizer, built the same way)."""
    mine = _describe(ours)
    if len(mine) != len(theirs):
        return (f"kungfu: {here} has {len(mine)} variables to sync, {there} has "
                f"{len(theirs)}: build the same model and optimizer")
    for (name, shape, dtype), (rname, rshape, rdtype) in zip(mine, theirs):
        if (shape, dtype) != (rshape, rdtype):
            return (f"kungfu: variable {name} is {dtype}{list(shape)} in {here}, but "
                    f"{there}'s ({rname}) is {rdtype}{list(rshape)}")
    return ""


# Failures the survivors recover from: a peer died or stopped answering (in a TensorFlow op or in a
# collective of the Hook's own). Anything else (peers that disagree, bad input) is raised.
RECOVERABLE = (tf.errors.UnavailableError, tf.errors.DeadlineExceededError,
               errors.PeerFailedError, errors.OpTimeoutError)


@dataclasses.dataclass
class _Commit:
    """The training state at a step boundary ("start", "step": after a step's decisions, or
    "epoch": after an epoch's); `seq` numbers them the same on every worker."""

    seq: int
    kind: str
    variables: list  # what was kept (a custom loop's optimizer knows its own after a step)
    tensors: list
    state: TrainingState
    policies: list
    data: Optional[tuple]


def monitor_logs(optimizer) -> dict:
    """{log key: latest estimate} of the optimizer's gradient monitor ({} without one)."""
    monitor: Optional[_monitor.GradientMonitor] = getattr(optimizer, "kungfu_monitor", None)
    if monitor is None:
        return {}
    return {_monitor.LOG_KEYS[m]: monitor.value(m) for m in monitor.monitors}


def _first_line(e: Exception) -> str:
    """The runtime's message: a TensorFlow op error puts it after its traceback, before the
    "[[{{node ...}}]]" line."""
    lines = [ln.strip() for ln in getattr(e, "message", str(e)).splitlines()]
    lines = [ln for ln in lines if ln and not ln.startswith(("[[", "File ", "Graph execution",
                                                             "Detected at node"))]
    return lines[-1] if lines else type(e).__name__


def _numbers(logs) -> dict:
    """Keras's logs of a step as numbers ({} for what a custom loop's step returned)."""
    if not isinstance(logs, dict):
        return {}
    return {k: float(keras.ops.convert_to_numpy(v)) for k, v in logs.items()}


class Hook(keras.callbacks.Callback):
    """Runs policies (kf.BasePolicy) and applies their actions consistently on every worker;
    adds the monitored estimates to Keras's logs. `data`: a kungfu.tensorflow.data.ElasticData
    (needed for kf.set_batch_size in model.fit); `optimizer`: for custom loops (in model.fit the
    model's optimizer is used)."""

    def __init__(self, *policies: BasePolicy, data=None, optimizer=None, name: str = "kungfu/hook",
                 exit_on_detach: bool = True, checkpoint: Optional[str] = None,
                 checkpoint_every: int = 100):
        super().__init__()
        if checkpoint is not None and (isinstance(checkpoint_every, bool) or not isinstance(
                checkpoint_every, int) or checkpoint_every < 1):
            raise ValueError(f"checkpoint_every must be a positive number of steps, got "
                             f"{checkpoint_every!r}")
        # A file rank 0 keeps the last commit in (every `checkpoint_every` steps and at each
        # epoch's end); training that starts with it there resumes from it (see _resume).
        self.checkpoint = None if checkpoint is None else os.fspath(checkpoint)
        self.checkpoint_every = checkpoint_every
        for p in policies:
            if not isinstance(p, BasePolicy):
                raise TypeError(f"kf.Hook takes kf.BasePolicy instances, got {type(p).__name__}")
        self.policies = list(policies)
        self.data = data
        self._optimizer = optimizer
        self._name = name
        self.state = TrainingState()
        self._step_start: Optional[float] = None
        self.exit_on_detach = exit_on_detach
        self.detached = False
        self.rehearsed = False  # a joiner in model.fit: ran its step before reporting ready
        self._epochs_total: Optional[int] = None
        self._epoch_shift = 0  # a joiner's epoch minus its Keras epoch
        self._resumed = False  # a joiner whose first Keras epoch continues the others' epoch
        self._recovering = False  # commits and recovery on (an elastic job; see guard)
        self._commits: collections.deque = collections.deque(maxlen=2)
        self._commit_seq = 0
        self._train_fn = None  # Keras's own train function (the model's is wrapped)
        self.recoveries: List[dict] = []  # what this worker survived (see _recover)
        self._replace_to: Optional[int] = None  # the size to restore after a recovery

    # -- plumbing ---------------------------------------------------------------------------

    @property
    def optimizer(self):
        if self._optimizer is not None:
            return self._optimizer
        model = getattr(self, "model", None)
        return None if model is None else model.optimizer

    def _run(self, hook: str) -> None:
        assert hook in HOOKS
        if not _actions.in_round():
            _actions.open_round()
        for p in self.policies:
            call_hook(p, hook, self.state)

    def _agree_and_apply(self) -> None:
        self._check_pending_resize()
        self._request_replacement()
        decisions = _actions.close_round()
        # One name for every round: the k-th round of a worker meets the k-th of the others
        # (the runtime numbers successive uses of a name; a new cluster version starts over).
        winners = _actions.agree(decisions, f"{self._name}/agree")
        _actions.open_round()
        for kind in _actions.KINDS:
            if kind in winners:
                getattr(self, "_apply_" + kind)(winners[kind])

    def _apply_strategy(self, decision) -> None:
        _actions.apply_strategy(decision)

    def _apply_batch_size(self, b: int) -> None:
        if self.data is not None:
            self.data.set_batch_size(b)
        elif getattr(self, "model", None) is not None:
            raise RuntimeError("kf.set_batch_size needs kungfu's data in training: pass "
                               "data=kf.ElasticData(...) to kf.Hook and train on data.dataset()")
        self.state.local_batch_size = b
        monitor = getattr(self.optimizer, "kungfu_monitor", None)
        if monitor is not None:
            monitor.set_batch_size(b)
        self._refresh_sizes()

    def _apply_learning_rate(self, lr: float) -> None:
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

    # -- elasticity (kungfu/_elastic.py has the protocol) ----------------------------------

    def _check_pending_resize(self) -> None:
        """Rank 0, while a resize waits for its joiners: decide to switch or to give up."""
        import kungfu as kf

        ctx = _elastic.context()
        if ctx.pending is None or kf.rank() != 0:
            return
        if self.data is not None and self.state.samples_in_epoch >= len(self.data):
            return  # never after an epoch's last step: a joiner's first epoch would be empty
        try:
            failed = ctx.failed()
            ready = not failed and ctx.ready()
            if ready:
                failed = ctx.commit_switch()
                ready = not failed
        except StoreError as e:
            warnings.warn(f"kungfu: cannot read the config store: {e}")
            failed, ready = [], False
        if ready:
            _actions._record("elastic", {"switch": ctx.pending.version})
        elif failed:
            _actions._record("elastic", {"abandon": ctx.pending.version,
                                         "why": f"new worker {', '.join(failed)} failed"})
        elif ctx.overdue():
            _actions._record("elastic", {"abandon": ctx.pending.version})

    def _request_replacement(self) -> None:
        """Rank 0, after a recovery: asks for new workers in place of the lost ones (a resize
        back to the size before the failure; see kungfu/_elastic.py)."""
        import kungfu as kf

        n, self._replace_to = self._replace_to, None
        if n is None or kf.rank() != 0 or n <= kf.size():
            return
        _actions._record("resize", min(n, _elastic.context().max_size()))

    def _apply_resize(self, n: int) -> None:
        import kungfu as kf

        ctx = _elastic.context()
        if ctx.pending is not None:
            warnings.warn(f"kungfu: resize to {n} ignored: the resize to "
                          f"{len(ctx.pending.peers)} is still in progress")
            return
        if n == kf.size():
            return
        if self.model is not None and self.data is None and n > kf.size():
            raise RuntimeError("growing the cluster in model.fit needs kungfu's data: pass "
                               "data=kf.ElasticData(...) to kf.Hook (joiners continue from its "
                               "sample offset)")
        # Rank 0 broadcasts what it wrote, or why it wrote nothing ("!" and the reason).
        proposal = ""
        if kf.rank() == 0:
            try:
                new = ctx.propose(n)
                proposal = new.to_json() if new is not None else "!the stored configuration changed"
            except StoreError as e:  # the others wait in the broadcast: tell them, go on
                proposal = f"!{e}"
        proposal = self._broadcast_blob(proposal.encode(), "kungfu/elastic/propose").decode()
        if proposal.startswith("!"):
            warnings.warn(f"kungfu: resize to {n} failed: {proposal[1:]}; training goes on with "
                          f"{kf.size()}")
            return
        new = ClusterConfig.from_json(proposal)
        if ctx.joiners(new):
            ctx.pending, ctx.pending_since = new, time.monotonic()
        else:
            self._switch(new)

    def _apply_elastic(self, decision: dict) -> None:
        import kungfu as kf

        ctx = _elastic.context()
        if ctx.pending is None:
            return
        if "switch" in decision:
            self._switch(ctx.pending)
        else:
            ctx.abandon(kf.rank(), decision.get("why"))

    def _switch(self, new: ClusterConfig) -> None:
        ctx = _elastic.context()
        joiners = ctx.joiners(new)
        if not ctx.switch(new):
            self.detached = True
            _lower_priority()
            if getattr(self, "model", None) is not None:
                self.model.stop_training = True
            return
        if joiners:
            self._sync(joining=False)
        self._refresh_sizes()

    def _broadcast_blob(self, blob: bytes, name: str) -> bytes:
        """rank 0's bytes on every worker."""
        import kungfu as kf

        n = int(kf.broadcast(np.array([len(blob)], np.int64), name=f"{name}/length")[0])
        data = np.frombuffer(blob, np.uint8) if kf.rank() == 0 else np.zeros(n, np.uint8)
        return kf.broadcast(data, name=f"{name}/bytes").tobytes()

    def _synced_variables(self) -> list:
        from kungfu.tensorflow.initializer import _optimizer_variables

        opt = self.optimizer
        variables = []
        if getattr(self, "model", None) is not None:
            variables = list(self.model.weights) + _optimizer_variables(self.model)
        elif opt is not None:
            variables = list(opt.variables)
        monitor = getattr(opt, "kungfu_monitor", None)
        if monitor is not None:
            variables += [monitor.batch_size, monitor.stats, monitor.gns_state,
                          monitor.variance_state]
            variables += [monitor.values[m] for m in monitor.monitors]
        return variables

    def _state_variables(self) -> list:
        """What a commit holds: the synced variables, and in a custom loop (no Keras model) also
        the variables the optimizer trains (it knows them once it has applied a step)."""
        variables = self._synced_variables()
        if getattr(self, "model", None) is None and self.optimizer is not None:
            mine = {id(v) for v in variables}
            variables += [v for v in getattr(self.optimizer, "_trainable_variables", [])
                          if id(v) not in mine]
        return variables

    def _sync(self, joining: bool) -> None:
        """After a switch with joiners: rank 0's training state on the joiners. The variables
        (model, optimizer, monitor) go straight from rank 0 to each joiner: rank 0 lends them to
        its store, each joiner requests them (peer-to-peer; the joiners in parallel). The
        workers that stay keep their own and take no part in that (synchronous training keeps
        the trainable ones and the optimizer's equal to rank 0's; non-trainable state such as
        BatchNorm statistics stays each worker's own, as between resizes). Every worker also
        takes rank 0's Hook state, data position and policy state (small, broadcast first: it
        tells the joiners that the variables are published, and what they are, so that a
        joiner whose variables differ fails, and everyone with it, before any transfer)."""
        import kungfu as kf
        from kungfu import _collective
        from kungfu.tensorflow import ops

        prefix = f"kungfu/elastic/{_elastic.context().current.version}"
        variables = self._synced_variables()
        names = [f"{prefix}/var/{i}" for i in range(len(variables))]
        mine = b""
        try:
            if kf.rank() == 0:
                for name, v in zip(names, variables):  # lent, not copied
                    ops.save_variable(tf.convert_to_tensor(v), name=name)
                state = dataclasses.replace(self.state, logs={})
                mine = pickle.dumps({
                    "state": state,
                    "epochs_total": self._epochs_total,
                    "batch_size": None if self.data is None else self.data.batch_size,
                    "policies": [p.state_dict() for p in self.policies],
                    "variables": _describe(variables),
                    "commit_seq": self._commit_seq,  # the others commit next: the joiners too
                })
            # After rank 0 published: a joiner that has this may request the variables.
            got = pickle.loads(self._broadcast_blob(mine, f"{prefix}/state"))
            problem = _mismatch(variables, got["variables"]) if joining else ""
            # Everyone learns whether a joiner cannot take them, and fails: none waits.
            if kf.allreduce(int(bool(problem)), "max", name=f"{prefix}/check"):
                raise RuntimeError(problem or "kungfu: a joiner's variables do not match rank "
                                   "0's (its log names the first that differs): the resize "
                                   "cannot complete")
            if joining:
                for name, v in zip(names, variables):
                    v.assign(ops.request_variable(0, v.shape, v.dtype, name=name))
            _collective.barrier(f"{prefix}/synced")  # every joiner holds its copy
        finally:
            if kf.rank() == 0:
                for name in names:
                    _collective.drop(name)
        if kf.rank() == 0:
            return
        self._epochs_total = got["epochs_total"]
        self._commit_seq = got["commit_seq"]
        self._take(got["state"], got["policies"], None if self.data is None else (
            got["state"].epoch, got["state"].samples_in_epoch, got["batch_size"],
            self.data.last_length))

    def _take(self, state: TrainingState, policies: list, position: Optional[tuple]) -> None:
        """Takes a training state: the Hook's, the policies', and the data position (epoch,
        offset, batch size, last length; None: leave it)."""
        self.state = copy.deepcopy(state)
        for p, st in zip(self.policies, policies):
            p.load_state_dict(st)
        if self.data is not None and position is not None:
            d = self.data
            d.epoch, d.offset, d.batch_size, d.last_length = position

    def _join(self) -> None:
        """A worker joining a running elastic job: connect, then take the others' state."""
        if self.data is None and getattr(self, "model", None) is not None:
            raise RuntimeError("a worker joining an elastic job continues from the others' "
                               "sample offset: pass data=kf.ElasticData(...) to kf.Hook")
        _elastic.context().join()
        self._sync(joining=True)
        self._resumed = True
        self._epoch_shift = self.state.epoch
        self._refresh_sizes()

    def _rehearse(self) -> None:
        """A joiner in model.fit, before it reports ready: runs one training step alone (a
        cluster of one, on a batch of weight 0), so that tracing the step function and its
        first run happen while the others keep training, not in the pause after the switch.
        What the step changed is then replaced by rank 0's state (_sync)."""
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

    def _refresh_sizes(self) -> None:
        import kungfu as kf

        s = self.state
        s.rank, s.cluster_size = kf.rank(), kf.size()
        if self.data is not None:
            s.local_batch_size = self.data.batch_size
        if s.local_batch_size is not None:
            s.global_batch_size = s.local_batch_size * s.cluster_size
        opt = self.optimizer
        if opt is not None:
            try:
                s.learning_rate = float(keras.ops.convert_to_numpy(opt.learning_rate))
            except Exception:  # noqa: BLE001 - a schedule or no learning rate: leave it
                pass

    # -- recovery (kungfu/_elastic.py has the protocol) ------------------------------------------

    def _commit(self, kind: str, durable: bool = True) -> None:
        """Keeps the training state at this step boundary (and the one before); rank 0 also
        writes it to the checkpoint file, when there is one, every checkpoint_every steps and
        at each epoch's end."""
        if not self._recovering and self.checkpoint is None:
            return
        self._commit_seq += 1
        data = None
        if self.data is not None:
            d = self.data
            data = (d.epoch, d.offset, d.batch_size, d.last_length, len(d.served))
        variables = self._state_variables()
        self._commits.append(_Commit(
            self._commit_seq, kind, variables, [tf.identity(v) for v in variables],
            copy.deepcopy(dataclasses.replace(self.state, logs={})),
            [p.state_dict() for p in self.policies], data))
        if self.state.rank == 0 and self._checkpoint_due(kind, durable):
            self._save_checkpoint(self._commits[-1])

    def _checkpoint_due(self, kind: str, durable: bool) -> bool:
        if self.checkpoint is None or not durable:
            return False
        if kind == "epoch":
            return True
        # Not at an epoch's last step: the epoch's own commit follows at once.
        at_end = self.data is not None and self.data.offset >= len(self.data)
        return kind == "step" and self.state.step % self.checkpoint_every == 0 and not at_end

    def _save_checkpoint(self, c: _Commit) -> None:
        """Writes commit `c` to the checkpoint file atomically (a temporary file, flushed to
        disk, renamed over the old one): a crash leaves the previous checkpoint whole."""
        payload = pickle.dumps({
            "format": 1, "arrays": [t.numpy() for t in c.tensors],
            "variables": _describe(c.variables), "state": c.state,
            "policies": c.policies, "data": None if c.data is None else c.data[:4],
            "epochs_total": self._epochs_total})
        tmp = f"{self.checkpoint}.tmp{os.getpid()}"
        with open(tmp, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.checkpoint)

    def _resume(self) -> bool:
        """At the start of training, when the checkpoint file exists: rank 0 reads it and every
        worker takes its state (variables, Hook and policy state, data position), whatever the
        cluster size was when it was written. Returns whether it did."""
        import kungfu as kf

        blob = b""
        if kf.rank() == 0 and os.path.exists(self.checkpoint):
            with open(self.checkpoint, "rb") as f:
                blob = f.read()
        if kf.size() > 1:
            blob = self._broadcast_blob(blob, "kungfu/checkpoint")
        if not blob:
            return False
        got = pickle.loads(blob)
        variables = self._state_variables()
        problem = _mismatch(variables, got["variables"], "this model",
                            f"the checkpoint {self.checkpoint}")
        if problem:
            raise ValueError(problem)
        for v, a in zip(variables, got["arrays"]):
            v.assign(a)
        self._take(got["state"], got["policies"], got["data"])
        # Keras counts epochs from 0 again: its first is the checkpoint's epoch, continued
        # (mid-epoch) or begun (written at an epoch's end).
        self._resumed = self.state.step_in_epoch > 0
        self._epoch_shift = self.state.epoch
        if self._epochs_total is None:
            self._epochs_total = got["epochs_total"]
        print(f"kungfu: resumed from {self.checkpoint} at step {self.state.step} (epoch "
              f"{self.state.epoch}, {self.state.samples_in_epoch} samples into it)",
              file=sys.stderr, flush=True)
        return True

    def _restore(self, c: _Commit) -> None:
        for v, t in zip(c.variables, c.tensors):
            v.assign(t)
        self._take(c.state, c.policies, None if c.data is None else c.data[:4])
        if c.data is not None:
            del self.data.served[c.data[4]:]
        self._commit_seq = c.seq
        self._commits = collections.deque([c], maxlen=2)

    def _recover(self, error: Exception) -> None:
        """A collective failed: with the other survivors, leave the lost peers behind and roll
        back to the commit every survivor holds; then redo this worker's commits since. Raises
        `error` itself when recovery is off or not possible."""
        if not self._recovering or not self._commits:
            raise error
        failed_at = time.time()
        kinds = [c.kind for c in self._commits]
        try:
            rec = _elastic.context().recover(self._commits[-1].seq, _first_line(error))
        except _elastic.ExpelledError as e:
            self.detached = True
            raise e from error
        target = next((c for c in self._commits if c.seq == rec.commit), None)
        if target is None:
            raise RuntimeError(f"kungfu: the survivors roll back to commit {rec.commit}, but this "
                               f"worker holds {[c.seq for c in self._commits]}") from error
        redo = kinds[[c.seq for c in self._commits].index(rec.commit) + 1:]
        self._restore(target)
        self._refresh_sizes()
        # Times (time.time()) for benchmarks/recovery_latency.py; "step_done_at" is added when
        # a step was first trained again (_train_again).
        record = {"version": rec.failed, "lost": rec.lost, "size": len(rec.config.peers),
                  "step": self.state.step, "cause": _first_line(error),
                  "failed_at": failed_at, "agreed_at": rec.agreed_at,
                  "rebuilt_at": rec.rebuilt_at, "restored_at": time.time()}
        self.recoveries.append(record)
        if _env.REPLACE.get():
            self._replace_to = len(rec.config.peers) + len(rec.lost)
        print(f"kungfu: rank {self.state.rank}: lost {', '.join(rec.lost) or 'no peer'} "
              f"({record['cause']}); {len(rec.config.peers)} "
              f"{'worker goes' if len(rec.config.peers) == 1 else 'workers go'} on from step "
              f"{self.state.step} (recovered in {record['restored_at'] - failed_at:.2f}s)",
              file=sys.stderr, flush=True)
        for kind in redo:  # at most one: a commit this worker made that another had not
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
        self._recovering = True
        return self._guard(train_step)

    # -- the hooks, for custom loops ----------------------------------------------------------

    def before_train(self) -> None:
        self._epochs_begun = 0
        if _peer.joining():
            self._join()
            self._commit("start")
            return  # the others are in the middle of training: join them at their next step
        resumed = self.checkpoint is not None and self._resume()
        self._refresh_sizes()
        if not resumed:
            self._run("before_train")
        self._agree_and_apply()
        self._commit("start")

    def before_epoch(self, epoch: Optional[int] = None) -> None:
        self._epochs_begun += 1
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
        if self.data is not None:
            # Keras's batch index counts the batches of this iteration over the data, as the
            # data's own counter does (a joiner's first iteration starts mid-epoch).
            self.data.release(self._epochs_begun - 1,
                              self.state.step_in_epoch if batch is None else batch)
        self._step_start = time.perf_counter()

    def after_step(self, logs: Optional[dict] = None) -> None:
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
        estimates = monitor_logs(self.optimizer)
        s.metrics.update(estimates)
        if logs is not None:
            logs.update(estimates)
            s.logs = logs
        self._run("after_step")
        try:
            self._agree_and_apply()
        except RECOVERABLE as e:
            # Rolled back to before this step: train it again, then come back here.
            self._recover(e)
            redone = self._train_again()
            if logs is not None:
                logs.update(_numbers(redone))
            self.after_step(logs)
            return
        self._commit("step")

    def after_epoch(self, logs: Optional[dict] = None) -> None:
        if logs is not None:
            logs.update(monitor_logs(self.optimizer))
            self.state.logs = logs
        self._end_epoch()
        if (self._epochs_total is not None and self.state.epoch >= self._epochs_total
                and getattr(self, "model", None) is not None):
            self.model.stop_training = True  # a joiner's Keras counts its epochs from 0

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
        at_end = d is not None and d.offset >= len(d)
        whole = d is None or at_end or (not d.attached and d.offset == 0)
        self.state.epoch += 1
        self.state.step_in_epoch = self.state.samples_in_epoch = 0
        if d is not None and (d.attached or at_end):
            d.next_epoch()
        self._commit("epoch", durable=whole)

    def after_train(self) -> None:
        self._run("after_train")
        try:
            self._agree_and_apply()
        except RECOVERABLE as e:
            self._recover(e)  # rolled back to the last commit: end training again
            self.after_train()
            return
        _actions.close_round()
        ctx = _elastic.context()
        if ctx.enabled and not self.detached:
            import kungfu as kf

            if ctx.pending is not None:
                ctx.abandon(kf.rank(), "training ended before its new workers were ready")
            if kf.rank() == 0:
                ctx.finish()

    # -- Keras ----------------------------------------------------------------------------------

    _epochs_begun = 0

    def on_train_begin(self, logs=None):
        spe = getattr(self.model, "steps_per_execution", 1)
        if self.data is not None and int(keras.ops.convert_to_numpy(spe)) != 1:
            raise ValueError("kf.Hook with kungfu data needs steps_per_execution=1")
        self._epochs_total = (self.params or {}).get("epochs")
        fn = getattr(self.model, "train_function", None)
        if _elastic.context().enabled and self.data is not None and fn is not None:
            fn = getattr(fn, "kungfu_guarded", fn)  # a second fit: wrap Keras's own again
            self.model.train_function = self._guard(fn)
            self._recovering = True
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
        self.before_train()
        if self._resumed and self.data is not None:
            self.data.attach()  # counts epochs from the checkpoint's position

    def on_epoch_begin(self, epoch, logs=None):
        self.before_epoch(epoch)

    def on_train_batch_begin(self, batch, logs=None):
        self.before_step(batch)

    def on_train_batch_end(self, batch, logs=None):
        self.after_step(logs)

    def on_epoch_end(self, epoch, logs=None):
        self.after_epoch(logs)

    def on_train_end(self, logs=None):
        try:
            self.after_train()
        finally:
            if self.data is not None:
                self.data.detach()
        if self.detached and self.exit_on_detach:
            # A resize removed this worker: it leaves the job with exit code 0, now (an
            # interpreter shutdown could wait on tf.data's threads).
            import sys

            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
