"""Resize and recovery, the worker's side in the store: the steps of the protocol. The membership
state machine (kungfu/elastic/_membership.py) runs them; see docs/elastic.md.

Protocol (cluster version v -> v+1), steps as in DESIGN.md:
1. A policy calls kf.resize(n) on some workers; the decisions are agreed like every action
   (lowest deciding rank wins). Rank 0 writes v+1 (Elastic.plan) to the store (compare-and-swap
   on v) and broadcasts what it wrote. The new peer list keeps the old peers in their order
   (growing appends free slots of the job's hosts, shrinking drops the highest ranks), so rank 0
   stays.
2. Launchers see v+1 and start the joiners; the existing workers keep training in v.
3. A joiner imports, builds its model, enters model.fit; its Hook rehearses the training step
   alone (tracing it now, not after the switch), marks it ready in the store and connects
   (waiting until the others switch).
4. At each step boundary rank 0 checks the store; once every joiner is ready it decides
   "switch" (agreed like any action) and all existing workers swap in a v+1 native peer together.
   Workers not in v+1 are detached. A resize whose joiners are not all ready within
   KUNGFU_RESIZE_TIMEOUT is abandoned: rank 0 writes v+2 = the old peers and training goes on.
5. With joiners, the joiners take rank 0's training state (Membership._sync: variables
   peer-to-peer from rank 0 through the framework binding, the trainer's state broadcast).

Without a trainer (a custom loop with no kf.Hook), kf.resize(n) runs steps 1-4 at once, as a
collective that every worker calls with the same n (resize_now); a joiner reports ready when it
first connects (report_ready, run by kungfu._peer.get through _peer.on_join), and the
program syncs its own state.

Recovery (a peer of version v died or hangs; Elastic.recover, driven by Membership.recover):
1. Every worker commits its training state in memory at each step boundary (Membership.commit) and
   numbers the commits; synchronous training keeps the survivors at most one commit apart.
2. A collective fails (the runtime names the dead peer, or a deadline passes). Each survivor
   writes alive/<v>/<itself> = its last commit; a launcher that sees its worker exit non-zero
   writes dead/<peer>.
3. Once every peer of v is alive or dead (at once for a killed worker), or KUNGFU_RECOVERY_WINDOW
   after the survivor checked in (a hung peer), the survivor proposes: the peers alive and not
   dead (one that checked in and then died is dead), in their old order, and the lowest commit
   among them. The first proposal stored under recovered/<v>
   wins (compare-and-swap; no leader is needed, so losing rank 0 is like losing any other), and
   is written as the next cluster version.
4. A worker the decision leaves out (it checked in too late, or wakes up from a hang) exits with
   ExpelledError. The others swap in the new native peer, roll back to the agreed commit and redo
   the steps since (the trainer): no sample of the epoch is lost or repeated.
5. Replacement: at the next step boundary the new rank 0 asks for a resize back to the size
   before the failure, through the resize protocol above (the plan appends free slots, so the
   freed ones are filled again, unless their host cools down after repeated failures; their
   launchers start the joiners).
   Each failure counts against KUNGFU_MAX_RESTARTS (kungfu-run -max-restarts); one beyond it,
   or fewer survivors than KUNGFU_MIN_SIZE, ends the job with an error naming the limit.
"""
from __future__ import annotations

import json
import math
import time
import warnings
from dataclasses import dataclass
from typing import List, Optional, Sequence, Union

import numpy as np

from kungfu import _collective, _env, _peer, errors
from kungfu._hosts import parse_hosts, parse_port_range, plan_workers
from kungfu.store import DONE_KEY, ClusterConfig, Store, StoreError, connect


class ResizeError(ValueError):
    """A resize request that cannot be satisfied (size out of range, not an elastic job)."""


class ExpelledError(RuntimeError):
    """The survivors of a failure left this worker out (it did not check in in time)."""


@dataclass(frozen=True)
class Recovery:
    """What the survivors of a failure in version `failed` agreed on."""

    failed: int
    config: ClusterConfig  # the survivors, as the next cluster version
    commit: int  # the commit every survivor rolls back to
    lost: List[str]  # the peers left out
    agreed_at: float  # time.time() when this worker had the decision
    rebuilt_at: float  # ... and its native peer of the new version


class Elastic:
    """This worker's view of the elastic job: the store, the job's slots, the current and
    pending configurations."""

    def __init__(self):
        url = _env.CONFIG_SERVER.get()
        self.store: Optional[Store] = connect(url) if url else None
        self.hosts = _env.ELASTIC_HOSTS.get()
        self.port_range = _env.PORT_RANGE.get()
        self.timeout = _env.RESIZE_TIMEOUT.get()
        # This worker's address and cluster, read at first use: a warm spare has neither until
        # it is given its place (kungfu/_spare.py), and it makes its context before that.
        self._self_spec: Optional[str] = None
        self._current: Optional[ClusterConfig] = None
        self._identified = False
        self.pending: Optional[ClusterConfig] = None
        self.pending_since = 0.0
        self.driver = None  # the Membership whose trainer runs resizes at its step boundaries

    def _identify(self) -> None:
        if not self._identified:
            ident = _peer.identity_from_env()
            self._self_spec = ident.self_spec
            self._current = ClusterConfig(ident.version, ident.peers) if ident.peers else None
            self._identified = True

    @property
    def self_spec(self) -> Optional[str]:
        self._identify()
        return self._self_spec

    @property
    def current(self) -> Optional[ClusterConfig]:
        """The cluster this worker is a member of (None outside a cluster)."""
        self._identify()
        return self._current

    @current.setter
    def current(self, config: Optional[ClusterConfig]) -> None:
        self._identify()
        self._current = config

    @property
    def enabled(self) -> bool:
        return self.store is not None and self.hosts is not None

    def max_size(self) -> int:
        return sum(h.slots for h in parse_hosts(self.hosts))

    def plan(self, n: int, leave: Sequence[str] = ()) -> List[str]:
        """The peers of a cluster of n workers: the current ones in their order (the first n
        when shrinking) but those in `leave`, then free slots in -H order (host-major), skipping
        the hosts that cool down after repeated failures; fewer than n when no other slot is
        free. A slot of a worker that leaves is not free yet (it runs until the switch). Rank 0
        is always a current member: the joiners take its state (a new worker in a lower slot
        than the members, after a failure, must not become rank 0)."""
        current = list(self.current.peers) if self.current is not None else []
        staying = [p for p in current if p not in leave]
        if n <= len(staying):
            return staying[:n]
        ports = parse_port_range(self.port_range)
        slots = [w.spec for w in plan_workers(self.max_size(), parse_hosts(self.hosts), ports)]
        cooling = self.store.cooling_hosts(time.time()) if self.store is not None else {}
        free = [p for p in slots if p not in current and p.rpartition(":")[0] not in cooling]
        return staying + free[:n - len(staying)]

    def cooling(self) -> str:
        """The hosts that cool down now, for messages."""
        hosts = self.store.cooling_hosts(time.time())
        return ", ".join(f"{h} for {until - time.time():.0f}s more" if until != math.inf else
                         f"{h} for good (its launcher is gone)" for h, until in hosts.items())

    def check_size(self, n) -> int:
        if not self.enabled:
            raise ResizeError("kf.resize needs an elastic job: start it with kungfu-run -w")
        if isinstance(n, bool) or not isinstance(n, int):
            raise ResizeError(f"the new cluster size must be an integer, got {n!r}")
        if not 1 <= n <= self.max_size():
            raise ResizeError(f"cannot resize to {n} workers: the job has 1 to {self.max_size()} "
                              f"slots (kungfu-run -H {self.hosts})")
        return n

    def unavailable(self, n: int) -> str:
        """Why the job cannot have n (>= 1) workers ("" if it can): not an elastic job, or more
        workers than it has slots (check_size's message)."""
        try:
            self.check_size(n)
        except ResizeError as e:
            return str(e)
        return ""

    # -- steps of the protocol ----------------------------------------------------------------

    def check_leave(self, leave) -> List[str]:
        """The peers of these ranks (kf.resize's leave=), or ResizeError naming the problem."""
        peers = list(self.current.peers) if self.current is not None else []
        ranks = []
        for r in leave:
            if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < len(peers):
                raise ResizeError(f"leave: {r!r} is not a rank of this cluster of {len(peers)}")
            if r in ranks:
                raise ResizeError(f"leave: rank {r} is named twice")
            ranks.append(r)
        return [peers[r] for r in ranks]

    def propose(self, n: int, leave: Sequence[str] = ()) -> Optional[ClusterConfig]:
        """Rank 0: writes the configuration of n workers (fewer if only that many slots are
        free: see plan), without the peers in `leave`, as the next version; None if another
        write came first."""
        stored, _ = self.store.config()
        peers = self.plan(n, leave)
        staying = len(self.current.peers) - len(leave)
        if n > staying and len(peers) == staying:
            raise ResizeError(f"no free slot for a new worker: the hosts with free slots cool "
                              f"down after repeated failures ({self.cooling()})")
        new = ClusterConfig(stored.version + 1, peers)
        return new if self.store.propose(new) else None

    # -- a cluster asked for from outside the job (Store.request_cluster) -----------------------
    #
    # 1. Someone PUTs a cluster to the store (KungFu's PUT /config on the builtin server); the
    #    store checks it as kf.resize checks a size and keeps it as the pending request.
    # 2. Rank 0, at a step boundary with no resize in progress (kf.Hook; at most every
    #    REQUEST_POLL seconds) or in kungfu.python.resize() (a custom loop), takes it
    #    (take_request) and the workers agree on it like a resize a policy asked for.
    # 3. Rank 0 writes it as the next version (propose_request: compare-and-swap, so a resize
    #    of the job's own that came first makes it stale) and marks it accepted or refused.
    # 4. From there it is the resize protocol: joiners start, report ready, everyone switches;
    #    workers the request leaves out are detached.

    def take_request(self) -> Optional[ClusterConfig]:
        """Rank 0: the pending request, checked again against this worker's view (slots, rank
        0 a current worker, the next version); one that cannot be taken is marked refused with
        why (and warned about), and None returned."""
        got = self.store.cluster_request()
        if got is None or got.get("state") != "pending":
            return None
        version = got.get("version")
        try:
            new = ClusterConfig(version, got.get("peers") or ())
            stored, _ = self.store.config()
            why = ""
            if new.version != stored.version + 1:
                why = (f"the cluster moved on to version {stored.version} since it was asked "
                       f"for as version {new.version}")
            elif len(new.peers) > self.max_size():
                why = f"{len(new.peers)} workers, more than the job's {self.max_size()} slots"
            elif new.peers[0] not in self.current.peers:
                why = f"its first worker {new.peers[0]} is not a current worker"
        except ValueError as e:
            why = str(e)
        if not why:
            return new
        self.store.settle_request(version, "refused", why)
        warnings.warn(f"kungfu: the cluster asked for from outside (version {version}) is "
                      f"refused: {why}")
        return None

    def propose_request(self, new: ClusterConfig) -> Optional[ClusterConfig]:
        """Rank 0: writes the requested configuration as the next version; None (and the
        request refused) if another write came first."""
        if self.store.propose(new):
            self.store.settle_request(new.version, "accepted")
            return new
        self.store.settle_request(new.version, "refused", "the stored configuration changed "
                                  "before the job could take it")
        return None

    def joiners(self, new: ClusterConfig) -> List[str]:
        return [p for p in new.peers if p not in self.current.peers]

    def agree_proposal(self, n: int, leave: Sequence[str] = (),
                       request: Optional[str] = None) -> Union[ClusterConfig, str]:
        """Every worker, once a resize to n (without the peers in `leave`) is agreed: rank 0
        writes the configuration (propose) and broadcasts what it wrote; returns it, or why
        nothing was written (a str) on every worker. `request`: the configuration asked for
        from outside (take_request, as JSON), written as it is instead."""
        proposal = ""
        if _peer.identity().rank == 0:
            try:
                if request is not None:
                    new = self.propose_request(ClusterConfig.from_json(request))
                else:
                    new = self.propose(n, leave)
                proposal = new.to_json() if new is not None else "!the stored configuration changed"
            except (StoreError, ResizeError) as e:  # the others wait in the broadcast: go on
                proposal = f"!{e}"
        proposal = broadcast_blob(proposal.encode(), f"kungfu/elastic/{self.current.version}/"
                                  "propose").decode()
        return proposal[1:] if proposal.startswith("!") else ClusterConfig.from_json(proposal)

    def pending_decision(self) -> Optional[dict]:
        """Rank 0, while a resize waits for its joiners: {"switch": v} once every joiner is
        ready, {"abandon": v, ...} when one failed or the wait is overdue; None: wait on."""
        try:
            failed = self.failed()
            ready = not failed and self.ready()
            if ready:
                failed = self.commit_switch()
                ready = not failed
        except StoreError as e:
            warnings.warn(f"kungfu: cannot read the config store: {e}")
            failed, ready = [], False
        if ready:
            return {"switch": self.pending.version}
        if failed:
            return {"abandon": self.pending.version, "why": f"new worker {', '.join(failed)} failed"}
        if self.overdue():
            return {"abandon": self.pending.version}
        return None

    def ready(self) -> bool:
        """Rank 0: whether every joiner of the pending configuration reported ready."""
        done = set(self.store.ready_peers(self.pending.version))
        return all(p in done for p in self.joiners(self.pending))

    def failed(self) -> List[str]:
        """Rank 0: joiners of the pending configuration that their launcher saw die."""
        joiners = self.joiners(self.pending)
        return [p for p in self.store.failed_peers(self.pending.version) if p in joiners]

    def commit_switch(self) -> List[str]:
        """Rank 0, once every joiner is ready: says in the store that the workers switch, then
        reads the joiners' failures once more (a launcher writes a failure before it reads this
        word, so one of the two sees the other); the switch goes ahead only if none failed."""
        self.store.mark_switched(self.pending.version)
        return self.failed()

    def overdue(self) -> bool:
        return time.monotonic() - self.pending_since > self.timeout

    def abandon(self, rank: int, why: Optional[str] = None) -> None:
        """Gives up the pending resize; rank 0 stores the old peers as the next version."""
        pending, self.pending = self.pending, None
        why = why or f"its new workers were not ready within {self.timeout:g}s"
        warnings.warn(f"kungfu: resize to {len(pending.peers)} workers abandoned: {why}; "
                      f"training goes on with {len(self.current.peers)}")
        if rank == 0:
            self.store.propose(ClusterConfig(pending.version + 1, self.current.peers))

    def switch(self, new: ClusterConfig) -> bool:
        """Swaps in the native peer of `new`; True if this worker is still a member."""
        _peer.replace(self.self_spec, list(new.peers), new.version)
        self.current, self.pending = new, None
        return not _peer.detached()

    # -- recovery -------------------------------------------------------------------------------

    def recover(self, commit: int, cause: str, starting: bool = False) -> Recovery:
        """After a collective of the current version failed: agrees with the other survivors
        on who is left and on the commit to roll back to (steps 2-4 in the module's doc), and
        swaps in the native peer of that cluster. `commit`: this worker's last commit.

        A member of the agreed cluster may have died after the decision was stored (its
        launcher's word came too late for it): then no survivor can connect to it (within
        KUNGFU_CONNECT_TIMEOUT), and they recover from that version in the same way, without
        it (now reported dead), rolling back to the same commit.

        `starting`: the failure came before training started (this worker's last commit is the
        one before its first collective); a peer that has not checked in then may still be
        starting, and is waited for up to KUNGFU_CONNECT_TIMEOUT, as its connect would have
        been, instead of KUNGFU_RECOVERY_WINDOW."""
        first = self.current
        window = _env.RECOVERY_WINDOW.get()
        if starting:
            window = max(window, _env.CONNECT_TIMEOUT.get())
        while True:
            got, new, agreed_at = self._recover_once(commit, cause, first, window)
            try:
                _peer.replace(self.self_spec, list(new.peers), new.version)
            except (errors.PeerFailedError, errors.OpTimeoutError) as e:
                self.current = new
                commit, cause = int(got["commit"]), str(e).splitlines()[0]
                continue
            self.current = new
            lost = [p for p in first.peers if p not in new.peers]
            return Recovery(first.version, new, int(got["commit"]), lost, agreed_at, time.time())

    def _recover_once(self, commit: int, cause: str, first: ClusterConfig, window: float):
        """One round of recover for the current version: (the decision, its cluster, when).
        `window`: how long after this worker checked in it waits for peers neither alive nor
        dead."""
        v = self.current.version
        deadline = time.monotonic() + max(window, self.timeout)  # the store may be down a while
        self._retry(lambda: self.store.mark_alive(v, self.self_spec, commit), deadline,
                    "report this worker alive")
        decide_at = time.monotonic() + window
        while True:
            decision = self._retry(lambda: self._decision(v, decide_at), deadline,
                                   "agree on the survivors")
            if decision is not None:
                break
            time.sleep(0.05)
        agreed_at = time.time()
        got = json.loads(decision)
        new = ClusterConfig(got["version"], got["peers"])
        lost = [p for p in first.peers if p not in new.peers]
        if self.self_spec not in new.peers:
            raise ExpelledError(
                f"kungfu: the other workers recovered from a failure in cluster version {v} "
                f"without this one ({self.self_spec}): it did not report back in time "
                f"(KUNGFU_RECOVERY_WINDOW, or KUNGFU_CONNECT_TIMEOUT before training started: "
                f"{window:g}s here); it leaves the job")
        minimum = _env.MIN_SIZE.get()
        if len(new.peers) < minimum:
            raise RuntimeError(
                f"kungfu: {len(new.peers)} of {len(first.peers)} workers are left after "
                f"{', '.join(lost)} failed ({cause}); the job needs at least {minimum} "
                "(kungfu-run -min-np)")
        budget = _env.MAX_RESTARTS.get()
        failures = self._retry(self.store.recoveries, deadline, "count the failures")
        if failures > budget:
            raise RuntimeError(
                f"kungfu: {', '.join(lost)} failed ({cause}): that is failure {failures} of this "
                f"job, and it survives at most {budget} (kungfu-run -max-restarts)")
        self._retry(lambda: self._store_config(new), deadline, "store the new configuration")
        self.pending = None  # a resize in progress is given up: its joiners are not in `new`
        return got, new, agreed_at

    def _decision(self, v: int, decide_at: float) -> Optional[str]:
        """The stored decision for version v, or this worker's proposal once it can make one;
        None while it waits for peers that are neither alive nor dead."""
        decided = self.store.recovery(v)
        if decided is not None:
            return decided
        alive = self.store.alive_peers(v)
        dead = {p for p, started in self.store.dead_peers().items() if started <= v}
        waiting = [p for p in self.current.peers if p not in alive and p not in dead]
        if waiting and time.monotonic() < decide_at:
            return None
        # A peer its launcher saw die is no member, even if it checked in alive before it died
        # (a worker killed inside the window of a hung one): the others would wait for it.
        # This worker is alive whatever the store says (a mark about an earlier process here).
        members = [p for p in self.current.peers
                   if p in alive and (p not in dead or p == self.self_spec)]
        stored, _ = self.store.config()
        proposal = json.dumps({"version": stored.version + 1, "peers": members,
                               "commit": min(alive[p] for p in members)})
        return self.store.decide_recovery(v, proposal)

    def _store_config(self, new: ClusterConfig) -> None:
        """Makes `new` the stored configuration (any survivor may; the first one does)."""
        stored, _ = self.store.config()
        if stored.version < new.version and not self.store.propose(new):
            stored, _ = self.store.config()
            if stored.version < new.version:
                raise StoreError(f"version {new.version} could not be stored over "
                                 f"{stored.version}")

    @staticmethod
    def _retry(call, deadline: float, what: str):
        delay = 0.1
        while True:
            try:
                return call()
            except StoreError as e:
                if time.monotonic() + delay > deadline:
                    raise StoreError(f"kungfu: cannot {what}: the config store did not answer "
                                     f"in time: {e}") from None
                time.sleep(delay)
                delay = min(delay * 2, 1.0)

    def mark_no_recovery(self, why: str) -> None:
        """Rank 0, as training starts: warns that this job cannot survive the loss of a worker,
        and why, and tells the launchers."""
        warnings.warn(f"kungfu: this elastic job cannot survive the loss of a worker: {why}; "
                      "a worker lost ends the job")
        try:
            self.store.mark_no_recovery(why)
        except StoreError as e:
            warnings.warn(f"kungfu: cannot tell the config store that training cannot recover: "
                          f"{e}")

    def finish(self) -> None:
        """Rank 0, when training ends: tells the launchers that the job is over."""
        try:
            self.store.put(DONE_KEY, str(self.current.version))
        except StoreError as e:
            warnings.warn(f"kungfu: cannot tell the config store that training ended: {e}")

    def report_ready(self) -> None:
        """A joiner, before it first connects: says in the store that it is ready for its
        version (the others switch to that version once every joiner is). A store that cannot
        be reached is retried for as long as the resize may wait (the others abandon it after
        that)."""
        deadline = time.monotonic() + self.timeout
        delay = 0.1
        while True:
            try:
                self.store.mark_ready(self.current.version, self.self_spec)
                return
            except StoreError as e:
                if time.monotonic() + delay > deadline:
                    raise StoreError(f"this joiner could not report ready to the config store "
                                     f"within {self.timeout:g}s (KUNGFU_RESIZE_TIMEOUT): {e}") from None
                warnings.warn(f"kungfu: cannot reach the config store to report ready, retrying: {e}")
                time.sleep(delay)
                delay = min(delay * 2, 2.0)

    def gone(self, peers: Sequence[str], version: int) -> Optional[str]:
        """While this worker connects to `peers` at `version`: why waiting is pointless (a peer
        whose launcher saw its worker exit, with no new one started there since), or None."""
        if not self.enabled:
            return None
        dead = self.store.dead_peers()
        lost = [p for p in peers if p != self.self_spec and dead.get(p, version + 1) <= version]
        return (f"{', '.join(lost)} exited before this worker connected to it (its launcher "
                "saw it go)") if lost else None


# A joiner reports ready just before it first connects, whoever connects it: the trainer
# (Membership.join) or a program's first collective. Any worker that connects gives up at once
# when a peer it waits for is known to have exited.
_peer.on_join(lambda: context().report_ready())
_peer.on_connect_wait(lambda peers, version: context().gone(peers, version))


def broadcast_blob(blob: bytes, name: str, timeout: Optional[float] = None) -> bytes:
    """rank 0's bytes on every worker (timeout: of the wait for rank 0; default
    KUNGFU_OP_TIMEOUT)."""
    rank = _peer.identity().rank
    n = int(_collective.broadcast(np.array([len(blob)], np.int64), name=f"{name}/length",
                                  timeout=timeout)[0])
    data = np.frombuffer(blob, np.uint8) if rank == 0 else np.zeros(n, np.uint8)
    return _collective.broadcast(data, name=f"{name}/bytes").tobytes()


_context: Optional[Elastic] = None


def context() -> Elastic:
    global _context
    if _context is None:
        _context = Elastic()
    return _context


def resize_now(n: int, agreed: bool = False, leave: Sequence[int] = (),
               request: Optional[str] = None) -> bool:
    """The whole resize at once, for programs without a trainer: a collective of the current
    workers. They agree on n (all must pass the same, unless `agreed`), rank 0 writes the new
    version, the launchers start the joiners, the workers wait (up to KUNGFU_RESIZE_TIMEOUT)
    until every joiner reported ready, then switch together. True: the cluster changed (a
    worker left out is detached: kf.detached()); False: n is the current size, or the resize
    was given up (a warning says why). The joiners have none of the others' state: the program
    gives it to them (e.g. kf.broadcast of its variables and its step, called by the joiners
    when they start and by the others after a resize that returned True). `request`: the
    cluster asked for from outside (take_request, as JSON, agreed), instead of a size."""
    ctx = context()
    n = ctx.check_size(n)
    gone = ctx.check_leave(leave)
    me = _peer.identity()
    prefix = f"kungfu/elastic/{ctx.current.version}/resize"
    if not agreed:
        if not _collective.consensus(json.dumps([n, gone]), name=f"{prefix}/size"):
            raise ResizeError(f"kf.resize outside kf.Hook is a collective: every worker must ask "
                              f"for the same size and leavers (this one asked for {n}"
                              f"{', without ' + ', '.join(gone) if gone else ''})")
    if n == me.size and not gone and request is None:
        return False
    new = ctx.agree_proposal(n, gone, request)
    if isinstance(new, str):
        warnings.warn(f"kungfu: resize to {n} failed: {new}; the cluster stays at {me.size}")
        return False
    if ctx.joiners(new):
        ctx.pending, ctx.pending_since = new, time.monotonic()
        decision = None
        while decision is None:  # rank 0 decides; the others wait in the broadcast
            if me.rank == 0:
                decision = ctx.pending_decision()
                if decision is None:
                    time.sleep(0.05)
                    continue
            got = broadcast_blob(json.dumps(decision or {}).encode(), f"{prefix}/decision",
                                 timeout=ctx.timeout + 60)
            decision = json.loads(got.decode())
        if "switch" not in decision:
            ctx.abandon(me.rank, decision.get("why"))
            return False
    ctx.switch(new)
    return True


def detached() -> bool:
    """Whether a resize removed this worker from the cluster."""
    return _peer.detached()
