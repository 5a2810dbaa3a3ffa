"""The worker's membership state machine: resize and recovery in one place, for any framework.

A trainer (kf.Hook in TensorFlow) drives it at its step boundaries and gives it two things:
- a `Variables` binding that captures and restores the framework's variables (the only
  framework-specific part; kungfu/tensorflow/_variables.py is TensorFlow's);
- itself, as the `Trainer` below: its state (TrainingState), its policies and its data.

States and the events that move between them (kungfu/elastic/_protocol.py has the store side):

    JOINING --join()--> TRAINING                 (a worker started for a later version)
    TRAINING --resize agreed, rank 0 writes--> PROPOSING
    PROPOSING --joiners in the new version--> WAITING --all ready, "switch" agreed--> SWITCHING
    PROPOSING --no joiners (a shrink)--> SWITCHING
    PROPOSING --nothing written--> TRAINING,  WAITING --"abandon" agreed--> TRAINING
    SWITCHING --member of the new version--> TRAINING,  --left out--> DETACHED
    TRAINING | WAITING --a collective failed--> RECOVERING --agreed--> TRAINING
    RECOVERING --left out (too late)--> DETACHED

Commits: at every step boundary and epoch end the trainer calls `commit`; the machine keeps the
last two (variables as the binding's snapshots, the trainer's state, its policies' state and the
data position), numbered the same on every worker. `recover` rolls back to the one the
survivors agreed on and returns the kinds of the commits this worker had made since, for the
trainer to redo. With a checkpoint path, rank 0 also writes commits to that file.
"""
from __future__ import annotations

import abc
import collections
import copy
import dataclasses
import enum
import pickle
import sys
import time
import warnings
from typing import List, Optional, Sequence

import numpy as np

from kungfu import _collective, _env, _peer, timeline
from kungfu.elastic import _checkpoint, _checkpoint_content
from kungfu.elastic._checkpoint import CheckpointError
from kungfu.elastic._data import data_mismatch, describe_data
from kungfu.elastic._protocol import ExpelledError, broadcast_blob, context
from kungfu.elastic._state import TrainingState
from kungfu.store import ClusterConfig, StoreError


REQUEST_POLL = 0.5  # seconds between rank 0's reads of a cluster asked for from outside


class State(enum.Enum):
    JOINING = "joining"
    TRAINING = "training"
    PROPOSING = "proposing"
    WAITING = "waiting for joiners"
    SWITCHING = "switching"
    RECOVERING = "recovering"
    DETACHED = "detached"


_MOVES = {
    State.JOINING: {State.TRAINING},
    State.TRAINING: {State.PROPOSING, State.RECOVERING},
    State.PROPOSING: {State.WAITING, State.SWITCHING, State.TRAINING, State.RECOVERING},
    State.WAITING: {State.SWITCHING, State.TRAINING, State.RECOVERING},
    State.SWITCHING: {State.TRAINING, State.DETACHED, State.RECOVERING},
    State.RECOVERING: {State.TRAINING, State.DETACHED},
    State.DETACHED: set(),
}


class Variables(abc.ABC):
    """What a framework binding provides: its variables, captured and restored. `synced()`
    are those a joiner takes from rank 0 (model, optimizer, monitor); `committed()` those a
    commit holds (the synced ones, and whatever else training changes)."""

    @abc.abstractmethod
    def synced(self) -> list: ...

    def committed(self) -> list:
        return self.synced()

    @abc.abstractmethod
    def snapshot(self, variables: list) -> list:
        """The variables' values now, unaffected by later writes (cheap where it can be)."""

    @abc.abstractmethod
    def restore(self, variables: list, snapshot: list) -> None: ...

    @abc.abstractmethod
    def arrays(self, snapshot: list) -> List[np.ndarray]: ...

    @abc.abstractmethod
    def load(self, variables: list, arrays: Sequence[np.ndarray]) -> None: ...

    @abc.abstractmethod
    def describe(self, variables: list) -> list:
        """[(name, shape tuple, dtype name)], to compare variables across workers."""

    @abc.abstractmethod
    def lend(self, variables: list, names: List[str]) -> None:
        """Rank 0: makes the variables' values available to peers under these names."""

    @abc.abstractmethod
    def borrow(self, variables: list, names: List[str]) -> None:
        """A joiner: takes rank 0's lent values into its variables."""

    @abc.abstractmethod
    def unlend(self, names: List[str]) -> None: ...


class Trainer(abc.ABC):
    """What the machine and the decision round (kungfu/elastic/_round.py) read and replace in
    the trainer that drives them: `state` (TrainingState), `policies`, `data` (ElasticData or
    None), `epochs_total`; and what they ask of it (the framework's side of the actions)."""

    state: TrainingState
    policies: list
    data: object
    epochs_total: Optional[int]

    @abc.abstractmethod
    def refresh_sizes(self) -> None:
        """The cluster or the data changed: update the state's sizes."""

    @abc.abstractmethod
    def on_detached(self) -> None:
        """This worker is no longer a member: stop training."""

    # The framework's side of the actions a trainer can apply (kungfu/elastic/_round.py); a
    # trainer that cannot refuses, and the agreement fails the same way on every worker.

    def set_batch_size(self, b: int) -> None:
        """An agreed kf.set_batch_size: this worker's batch from the next step on."""
        raise RuntimeError(f"{type(self).__name__} cannot apply kf.set_batch_size")

    def set_batch_sizes(self, sizes: List[int]) -> None:
        """An agreed kf.set_batch_sizes: every worker's part of the global batch."""
        raise RuntimeError(f"{type(self).__name__} cannot apply kf.set_batch_sizes")

    def set_learning_rate(self, lr: float) -> None:
        """An agreed kf.set_learning_rate."""
        raise RuntimeError(f"{type(self).__name__} cannot apply kf.set_learning_rate")

    def check_resize(self, n: int, leave: Sequence[str]) -> None:
        """Raises if this trainer cannot go on in a cluster of n workers without `leave`."""

    def shared_state(self) -> object:
        """The framework's state every worker must hold alike that no variable carries (Keras
        callbacks' counters): rank 0's is given to joiners (picklable; None: nothing)."""
        return None

    def load_shared_state(self, state: object) -> None:
        """Takes rank 0's shared_state()."""

    def step_follows(self) -> bool:
        """Whether a training step follows the decision round being agreed. Joiners are switched
        in only then: one switched in when training ends would wait in its first step for
        workers that have left."""
        return True


def mismatch(ours: list, theirs: list, here: str = "this joiner", there: str = "rank 0") -> str:
    """Why `here`'s variables (described) cannot take those of `there`; "" if they can (the same
    model and optimizer, built the same way)."""
    if len(ours) != len(theirs):
        return (f"kungfu: {here} has {len(ours)} variables to sync, {there} has "
                f"{len(theirs)}: build the same model and optimizer")
    for (name, shape, dtype), (rname, rshape, rdtype) in zip(ours, theirs):
        if (tuple(shape), dtype) != (tuple(rshape), rdtype):
            return (f"kungfu: variable {name} is {dtype}{list(shape)} in {here}, but "
                    f"{there}'s ({rname}) is {rdtype}{list(rshape)}")
    return ""


def runtime_message(e: BaseException) -> str:
    """The runtime's message: a TensorFlow op error puts it after its traceback, before the
    "[[{{node ...}}]]" line."""
    lines = [ln.strip() for ln in getattr(e, "message", str(e)).splitlines()]
    lines = [ln for ln in lines if ln and not ln.startswith(("[[", "File ", "Graph execution",
                                                             "Detected at node"))]
    return lines[-1] if lines else type(e).__name__


@dataclasses.dataclass
class Commit:
    """The training state at a step boundary ("init": before the first collective, "start":
    after the start of training, "step": after a step's decisions, or "epoch": after an
    epoch's); `seq` numbers them the same on every worker."""

    seq: int
    kind: str
    variables: list  # what was kept (a custom loop's optimizer knows its own after a step)
    snapshot: list
    state: TrainingState
    policies: list
    data: Optional[tuple]  # (epoch, offset, batch size, last length, batches served)


class Membership:
    """This worker's membership of an elastic job, driven by a trainer (see the module doc)."""

    def __init__(self, trainer: Trainer, variables: Variables):
        self.trainer = trainer
        self.variables = variables
        self.state = State.JOINING if _peer.joining() else State.TRAINING
        timeline.phase("elastic", self.state.value)
        self.recovering = False  # commits and recovery on (an elastic job)
        self.commits: collections.deque = collections.deque(maxlen=2)
        self.commit_seq = 0
        self.recoveries: List[dict] = []  # what this worker survived (see recover)
        self.replace_to: Optional[int] = None  # the size to restore after a recovery
        self._replace_check = 0.0  # time.monotonic() of the next check for free slots
        self._request_check = 0.0  # ... and for a cluster asked for from outside
        self.checkpoint: Optional[str] = None
        self.checkpoint_every = 100
        self.checkpoint_key: _checkpoint.Key = None  # an HMAC key the files are signed with
        self._checkpoint_failing: Optional[int] = None  # the step whose write failed first

    def _enter(self, state: State) -> None:
        if state is not self.state and state not in _MOVES[self.state]:
            raise RuntimeError(f"kungfu: internal error: membership cannot go from "
                               f"{self.state.value} to {state.value}")
        if state is not self.state:
            timeline.phase("elastic", state.value)  # ends the last state's span
        self.state = state

    @property
    def detached(self) -> bool:
        return self.state is State.DETACHED

    # -- resize: the decisions of a round --------------------------------------------------

    def before_agree(self, decisions: dict) -> None:
        """In a decision round (kungfu/elastic/_round.py), before the agreement: rank 0 records
        in the round's `decisions` what the protocol needs decided (switch to or abandon a
        pending resize; a replacement after a recovery; a cluster asked for from outside)."""
        if _peer.identity().rank != 0:
            return
        self._check_pending(decisions)
        self._request_replacement(decisions)
        self._take_request(decisions)

    def _take_request(self, decisions: dict) -> None:
        """Rank 0, no resize in progress and none decided this round: the cluster asked for
        from outside the job, if any, becomes this round's resize (checked at most every
        REQUEST_POLL seconds: a store read)."""
        ctx, now = context(), time.monotonic()
        if (not ctx.enabled or ctx.pending is not None or "resize" in decisions
                or now < self._request_check):
            return
        self._request_check = now + REQUEST_POLL
        try:
            new = ctx.take_request()
        except StoreError as e:
            warnings.warn(f"kungfu: cannot read the config store: {e}")
            return
        if new is not None:
            decisions["resize"] = {"size": len(new.peers), "leave": [],
                                   "request": new.to_json()}

    def _request_replacement(self, decisions: dict) -> None:
        """Rank 0, after a recovery with replacement on: asks for a resize back to the size
        before the failure, once slots are free for it (the hosts of the lost workers may cool
        down; checked at most once a second), unless a policy asks for a resize itself."""
        n, size, ctx = self.replace_to, _peer.identity().size, context()
        if n is None or size >= n:
            self.replace_to = None
            return
        now = time.monotonic()
        if ctx.pending is not None or "resize" in decisions or now < self._replace_check:
            return
        self._replace_check = now + 1.0
        try:
            grows = len(ctx.plan(n)) > size
        except StoreError:
            grows = False
        if grows:
            decisions["resize"] = n

    def _check_pending(self, decisions: dict) -> None:
        ctx = context()
        if ctx.pending is None:
            return
        data = self.trainer.data
        if data is not None and data.epoch_done(self.trainer.state.samples_in_epoch):
            return  # never after an epoch's last step: a joiner's first epoch would be empty
        if not self.trainer.step_follows():
            return  # nor where training ends (Trainer.step_follows); finish() abandons it
        decision = ctx.pending_decision()
        if decision is not None:
            decisions["elastic"] = decision

    def apply_resize(self, n: int, leave: Sequence[str] = (),
                     request: Optional[str] = None) -> None:
        """An agreed resize to n workers, without the peers in `leave` (or to the cluster
        `request` asked for from outside): rank 0 writes the new version and broadcasts it; with
        joiners every worker waits for them (WAITING), else switches at once."""
        ctx = context()
        if self.replace_to is not None and n != self.replace_to:
            self.replace_to = None  # a policy's size wins over the replacement's
        if ctx.pending is not None:
            warnings.warn(f"kungfu: resize to {n} ignored: the resize to "
                          f"{len(ctx.pending.peers)} is still in progress")
            return
        peer = _peer.identity()
        if n == peer.size and not leave and request is None:
            return
        self._enter(State.PROPOSING)
        new = ctx.agree_proposal(n, leave, request)
        if isinstance(new, str):
            self._enter(State.TRAINING)
            warnings.warn(f"kungfu: resize to {n} failed: {new}; training goes on with "
                          f"{peer.size}")
            return
        if ctx.joiners(new):
            ctx.pending, ctx.pending_since = new, time.monotonic()
            self._enter(State.WAITING)
        else:
            self._switch(new)

    def apply_elastic(self, decision: dict) -> None:
        """An agreed "switch" to, or "abandon" of, the pending resize."""
        ctx = context()
        if ctx.pending is None:
            return
        if "switch" in decision:
            self._switch(ctx.pending)
        else:
            ctx.abandon(_peer.identity().rank, decision.get("why"))
            self.replace_to = None  # a replacement that could not start is not tried again
            self._enter(State.TRAINING)

    def _switch(self, new: ClusterConfig) -> None:
        self._enter(State.SWITCHING)
        ctx = context()
        joiners = ctx.joiners(new)
        if not ctx.switch(new):
            self._enter(State.DETACHED)
            self.trainer.on_detached()
            return
        if joiners:
            self._sync(joining=False)
        self._enter(State.TRAINING)
        self.trainer.refresh_sizes()

    def join(self) -> None:
        """A worker joining a running job: connect, then take the others' state."""
        _peer.get()  # reports ready, then connects (Elastic.report_ready)
        self._sync(joining=True)
        self._enter(State.TRAINING)
        self.trainer.refresh_sizes()

    def _sync(self, joining: bool) -> None:
        """After a switch with joiners: rank 0's training state on the joiners. The variables
        go straight from rank 0 to each joiner: rank 0 lends them, each joiner requests them
        (peer-to-peer; the joiners in parallel). The workers that stay keep their own and take
        no part in that (synchronous training keeps the trainable ones and the optimizer's
        equal to rank 0's; non-trainable state such as BatchNorm statistics stays each worker's
        own, as between resizes). Every worker also takes rank 0's trainer state, data position
        and policy state (small, broadcast first: it tells the joiners that the variables are
        published, and what they are, so that a joiner whose variables differ fails, and
        everyone with it, before any transfer)."""
        t, binding = self.trainer, self.variables
        rank = _peer.identity().rank
        prefix = f"kungfu/elastic/{context().current.version}"
        variables = binding.synced()
        names = [f"{prefix}/var/{i}" for i in range(len(variables))]
        mine = b""
        try:
            if rank == 0:
                binding.lend(variables, names)
                mine = pickle.dumps({
                    "state": dataclasses.replace(t.state, logs={}),
                    "epochs_total": t.epochs_total,
                    "batch_size": None if t.data is None else t.data.batch_size,
                    "policies": [p.state_dict() for p in t.policies],
                    "trainer": t.shared_state(),
                    "variables": binding.describe(variables),
                    "commit_seq": self.commit_seq,  # the others commit next: the joiners too
                })
            # After rank 0 published: a joiner that has this may request the variables.
            got = pickle.loads(broadcast_blob(mine, f"{prefix}/state"))
            problem = mismatch(binding.describe(variables), got["variables"]) if joining else ""
            # Everyone learns whether a joiner cannot take them, and fails: none waits.
            flag = np.array([int(bool(problem))], np.int32)
            if _collective.allreduce(flag, "max", name=f"{prefix}/check")[0]:
                raise RuntimeError(problem or "kungfu: a joiner's variables do not match rank "
                                   "0's (its log names the first that differs): the resize "
                                   "cannot complete")
            if joining:
                binding.borrow(variables, names)
            _collective.barrier(f"{prefix}/synced")  # every joiner holds its copy
        finally:
            if rank == 0:
                binding.unlend(names)
        if rank == 0:
            return
        t.epochs_total = got["epochs_total"]
        t.load_shared_state(got["trainer"])
        self.commit_seq = got["commit_seq"]
        self.take(got["state"], got["policies"], None if t.data is None else (
            got["state"].epoch, got["state"].samples_in_epoch, got["batch_size"],
            t.data.last_length))

    def take(self, state: TrainingState, policies: list, position: Optional[tuple]) -> None:
        """Takes a training state: the trainer's, the policies', and the data position (epoch,
        offset, batch size, last length; None: leave it)."""
        t = self.trainer
        t.state = copy.deepcopy(state)
        for p, st in zip(t.policies, policies):
            p.load_state_dict(st)
        if t.data is not None and position is not None:
            d = t.data
            d.epoch, d.offset, d.batch_size, d.last_length = position

    def begin(self) -> None:
        """Training begins: from now on resizes go through this machine (kf.resize outside a
        policy hook is refused instead of running one of its own)."""
        context().driver = self

    def finish(self) -> None:
        """Training ended: a resize still waiting is given up; rank 0 tells the launchers."""
        ctx = context()
        ctx.driver = None
        if not ctx.enabled or self.detached:
            return
        rank = _peer.identity().rank
        if ctx.pending is not None:
            ctx.abandon(rank, "training ended before its new workers were ready")
            self._enter(State.TRAINING)
        if rank == 0:
            ctx.finish()

    # -- commits and recovery ------------------------------------------------------------------

    def commit(self, kind: str, durable: bool = True) -> None:
        """Keeps the training state at this step boundary (and the one before); rank 0 also
        writes it to the checkpoint file, when there is one, every checkpoint_every steps and
        at each epoch's end."""
        if not self.recovering and self.checkpoint is None:
            return
        t = self.trainer
        self.commit_seq += 1
        data = None
        if t.data is not None:
            d = t.data
            data = (d.epoch, d.offset, d.batch_size, d.last_length, len(d.served))
        variables = self.variables.committed()
        self.commits.append(Commit(
            self.commit_seq, kind, variables, self.variables.snapshot(variables),
            copy.deepcopy(dataclasses.replace(t.state, logs={})),
            [p.state_dict() for p in t.policies], data))
        if t.state.rank == 0 and self._checkpoint_due(kind, durable):
            self._save_checkpoint(self.commits[-1])

    def restore(self, c: Commit) -> None:
        self.variables.restore(c.variables, c.snapshot)
        self.take(c.state, c.policies, None if c.data is None else c.data[:4])
        if c.data is not None:
            del self.trainer.data.served[c.data[4]:]
        self.commit_seq = c.seq
        self.commits = collections.deque([c], maxlen=2)

    def recover(self, error: BaseException) -> List[str]:
        """A collective failed: with the other survivors, leave the lost peers behind and roll
        back to the commit every survivor holds. Returns the kinds of the commits this worker had
        made since (at most one), for the trainer to redo. Raises `error` itself when recovery
        is off or not possible; ExpelledError when the others went on without this worker."""
        if not self.recovering or not self.commits:
            raise error
        failed_at = time.time()
        kinds = [c.kind for c in self.commits]
        self._enter(State.RECOVERING)
        try:
            # Before training started, a peer that has not checked in may still be starting
            # (importing its framework): it is waited for as long as a connect waits for it.
            rec = context().recover(self.commits[-1].seq, runtime_message(error),
                                    starting=self.commits[-1].kind == "init")
        except ExpelledError as e:
            self._enter(State.DETACHED)
            raise e from error
        target = next((c for c in self.commits if c.seq == rec.commit), None)
        if target is None:
            raise RuntimeError(f"kungfu: the survivors roll back to commit {rec.commit}, but this "
                               f"worker holds {[c.seq for c in self.commits]}") from error
        redo = kinds[[c.seq for c in self.commits].index(rec.commit) + 1:]
        self.restore(target)
        self._enter(State.TRAINING)
        self.trainer.refresh_sizes()
        # Times (time.time()) for benchmarks/recovery_latency.py; the trainer adds
        # "step_done_at" when a step was first trained again.
        record = {"version": rec.failed, "lost": rec.lost, "size": len(rec.config.peers),
                  "step": self.trainer.state.step, "cause": runtime_message(error),
                  "failed_at": failed_at, "agreed_at": rec.agreed_at,
                  "rebuilt_at": rec.rebuilt_at, "restored_at": time.time()}
        self.recoveries.append(record)
        if _env.REPLACE.get():
            self.replace_to = min(len(rec.config.peers) + len(rec.lost), context().max_size())
        n = len(rec.config.peers)
        print(f"kungfu: rank {self.trainer.state.rank}: lost {', '.join(rec.lost) or 'no peer'} "
              f"({record['cause']}); {n} {'worker goes' if n == 1 else 'workers go'} on from "
              f"step {self.trainer.state.step} (recovered in "
              f"{record['restored_at'] - failed_at:.2f}s)", file=sys.stderr, flush=True)
        return redo

    # -- the durable checkpoint ----------------------------------------------------------------

    def _checkpoint_due(self, kind: str, durable: bool) -> bool:
        if self.checkpoint is None or not durable:
            return False
        if kind == "epoch":
            return True
        # Not at an epoch's last step: the epoch's own commit follows at once.
        data = self.trainer.data
        at_end = data is not None and data.epoch_done()
        return (kind == "step" and self.trainer.state.step % self.checkpoint_every == 0
                and not at_end)

    def _save_checkpoint(self, c: Commit) -> None:
        """Writes commit `c` to the checkpoint file (kungfu/elastic/_checkpoint.py: checked
        format, atomic, mode 0600, signed with checkpoint_key if set; its content runs no code
        when loaded: _checkpoint_content.py). A write that fails (a full disk, a folder gone, a
        policy state that cannot be stored) is this worker's own trouble, not a lost peer: it
        is reported once, with the path, and training goes on; the next checkpoint tries again
        (and says when one is written again)."""
        step = self.trainer.state.step
        try:
            data = self.trainer.data
            content = _checkpoint_content.pack_commit(
                self.variables.arrays(c.snapshot), self.variables.describe(c.variables),
                c.state, c.policies, None if c.data is None else c.data[:4],
                None if data is None else data.describe(), self.trainer.epochs_total)
            _checkpoint.write(self.checkpoint, content, self.checkpoint_key)
        except (OSError, CheckpointError) as e:
            if self._checkpoint_failing is None:
                print(f"kungfu: cannot write the checkpoint {self.checkpoint} at step {step} "
                      f"({e}); training goes on and the next checkpoint tries again (further "
                      "failures are not reported until one is written)", file=sys.stderr,
                      flush=True)
                self._checkpoint_failing = step
            return
        if self._checkpoint_failing is not None:
            print(f"kungfu: the checkpoint {self.checkpoint} is written again at step {step} "
                  f"(the writes failed since step {self._checkpoint_failing})", file=sys.stderr,
                  flush=True)
            self._checkpoint_failing = None

    def resume(self, unbuilt: str = "") -> bool:
        """At the start of training, when the checkpoint file exists: rank 0 reads it and every
        worker takes its state (variables, trainer and policy state, data position and batch
        size), whatever the cluster size was when it was written. Returns whether it did (False:
        no file). A file that is empty, truncated, corrupted, forged, not a kungfu checkpoint
        or written for other data raises CheckpointError on every worker, naming it: it is
        never taken for "no checkpoint" (and so never overwritten by this training). `unbuilt`:
        why this trainer may have fewer variables than it will have (added to the message)."""
        peer = _peer.identity()
        # Rank 0 reads and checks the file; every worker learns the outcome from its broadcast
        # (b"": no checkpoint, b"+" and the content, b"!" and why the file cannot be used), so
        # a bad file stops every worker with the same error instead of leaving them waiting.
        blob = b""
        if peer.rank == 0:
            try:
                blob = b"+" + _checkpoint.read(self.checkpoint, self.checkpoint_key)
            except FileNotFoundError:
                pass
            except CheckpointError as e:
                blob = b"!" + str(e).encode()
            except OSError as e:
                blob = b"!" + f"kungfu: cannot read the checkpoint {self.checkpoint}: {e}".encode()
        if peer.size > 1:
            blob = broadcast_blob(blob, "kungfu/checkpoint")
        if not blob:
            return False
        if blob[:1] == b"!":
            raise CheckpointError(blob[1:].decode())
        got = self._content(blob[1:])
        self._check_data(got)
        variables = self.variables.committed()
        problem = mismatch(self.variables.describe(variables), got["variables"], "this model",
                           f"the checkpoint {self.checkpoint}")
        if problem:
            short = len(self.variables.describe(variables)) < len(got["variables"])
            raise ValueError(problem + (f" ({unbuilt})" if unbuilt and short else ""))
        t = self.trainer
        script_batch = None if t.data is None else t.data.batch_size
        self.variables.load(variables, got["arrays"])
        self.take(got["state"], got["policies"], got["data"])
        if t.epochs_total is None:
            t.epochs_total = got["epochs_total"]
        s = t.state
        batch = ""
        if t.data is not None and got["data"] is not None:
            b = t.data.batch_size
            batch = (f"; batch size {b} per worker, the checkpoint's" +
                     (f" (the script's {script_batch} is not used: a resumed job goes on as it "
                      "was, batch size changes of its policies included; kf.set_batch_size "
                      "changes it)" if b != script_batch else ""))
        print(f"kungfu: resumed from {self.checkpoint} at step {s.step} (epoch {s.epoch}, "
              f"{s.samples_in_epoch} samples into it){batch}", file=sys.stderr, flush=True)
        return True

    def _content(self, content: bytes) -> dict:
        """A checkpoint's content (checked bytes) as the commit it holds."""
        try:
            return _checkpoint_content.unpack_commit(content)
        except CheckpointError as e:
            raise CheckpointError(f"kungfu: the checkpoint {self.checkpoint} holds no training "
                                  f"state kungfu can load ({e}); it is not loaded") from None

    def _check_data(self, got: dict) -> None:
        """A data position is a place in the data it was taken in: other data (another number
        of samples, source, sample shape or order) is refused, naming both."""
        data, spec = self.trainer.data, got["data_spec"]
        if data is None or spec is None or got["data"] is None:
            return
        ours = data.describe()
        if data_mismatch(spec, ours):
            epoch, offset = got["data"][:2]
            raise CheckpointError(
                f"kungfu: the checkpoint {self.checkpoint} was written for other data: "
                f"{describe_data(spec)}; this job's data is {describe_data(ours)}. Its position "
                f"(epoch {epoch}, {offset} samples into it) is not one of this data's: give "
                "the data it was written for, or delete or move the checkpoint to start training "
                "from scratch")
