"""Resize, the worker's side (framework-neutral). kf.Hook drives it; see docs/elastic.md.

Protocol (cluster version v -> v+1), steps as in DESIGN.md:
1. A policy calls kf.resize(n) on some workers; the decisions are agreed like every action
   (lowest deciding rank wins). Rank 0 writes v+1 = the first n slots of the job's hosts to the
   store (compare-and-swap on v) and broadcasts what it wrote. The new peer list keeps the old
   peers in their order (growing appends, shrinking drops the highest ranks), so rank 0 stays.
2. Launchers see v+1 and start the joiners; the existing workers keep training in v.
3. A joiner imports, builds its model, enters model.fit; its Hook rehearses the training step
   alone (tracing it now, not after the switch), marks it ready in the store and connects
   (waiting until the others switch).
4. At each step boundary rank 0 checks the store; once every joiner is ready it decides
   "switch" (agreed like any action) and all existing workers swap in a v+1 native peer together.
   Workers not in v+1 are detached. A resize whose joiners are not all ready within
   KUNGFU_RESIZE_TIMEOUT is abandoned: rank 0 writes v+2 = the old peers and training goes on.
5. With joiners, the joiners take rank 0's training state (kf.Hook does that part: variables
   peer-to-peer from rank 0, its Hook state broadcast).
"""
from __future__ import annotations

import time
import warnings
from typing import List, Optional

from kungfu import _env, _peer
from kungfu.store import DONE_KEY, ClusterConfig, Store, StoreError, connect


class ResizeError(ValueError):
    """A resize request that cannot be satisfied (size out of range, not an elastic job)."""


class Elastic:
    """This worker's view of the elastic job: the store, the job's slots, the current and
    pending configurations."""

    def __init__(self):
        url = _env.CONFIG_SERVER.get()
        self.store: Optional[Store] = connect(url) if url else None
        self.hosts = _env.ELASTIC_HOSTS.get()
        self.port_range = _env.PORT_RANGE.get()
        self.timeout = _env.RESIZE_TIMEOUT.get()
        ident = _peer.identity_from_env()
        self.self_spec = ident.self_spec
        self.current = ClusterConfig(ident.version, ident.peers) if ident.peers else None
        self.pending: Optional[ClusterConfig] = None
        self.pending_since = 0.0

    @property
    def enabled(self) -> bool:
        return self.store is not None and self.hosts is not None

    def max_size(self) -> int:
        from kungfu._launcher import parse_hosts

        return sum(h.slots for h in parse_hosts(self.hosts))

    def plan(self, n: int) -> List[str]:
        from kungfu._launcher import parse_hosts, parse_port_range, plan_workers

        ports = parse_port_range(self.port_range)
        return [w.spec for w in plan_workers(n, parse_hosts(self.hosts), ports)]

    def check_size(self, n) -> int:
        if not self.enabled:
            raise ResizeError("kf.resize needs an elastic job: start it with kungfu-run -w")
        if isinstance(n, bool) or not isinstance(n, int):
            raise ResizeError(f"the new cluster size must be an integer, got {n!r}")
        if not 1 <= n <= self.max_size():
            raise ResizeError(f"cannot resize to {n} workers: the job has 1 to {self.max_size()} "
                              f"slots (kungfu-run -H {self.hosts})")
        return n

    # -- steps of the protocol ----------------------------------------------------------------

    def propose(self, n: int) -> Optional[ClusterConfig]:
        """Rank 0: writes the configuration of n workers as the next version; None if another
        write came first."""
        stored, _ = self.store.config()
        new = ClusterConfig(stored.version + 1, self.plan(n))
        return new if self.store.propose(new) else None

    def joiners(self, new: ClusterConfig) -> List[str]:
        return [p for p in new.peers if p not in self.current.peers]

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

    def finish(self) -> None:
        """Rank 0, when training ends: tells the launchers that the job is over."""
        try:
            self.store.put(DONE_KEY, str(self.current.version))
        except StoreError as e:
            warnings.warn(f"kungfu: cannot tell the config store that training ended: {e}")

    def join(self) -> None:
        """A joiner: reports ready for its version, then connects (the others switch to that
        version once every joiner is ready). A store that cannot be reached is retried for as
        long as the resize may wait (the others abandon it after that)."""
        deadline = time.monotonic() + self.timeout
        delay = 0.1
        while True:
            try:
                self.store.mark_ready(self.current.version, self.self_spec)
                break
            except StoreError as e:
                if time.monotonic() + delay > deadline:
                    raise StoreError(f"this joiner could not report ready to the config store "
                                     f"within {self.timeout:g}s (KUNGFU_RESIZE_TIMEOUT): {e}") from None
                warnings.warn(f"kungfu: cannot reach the config store to report ready, retrying: {e}")
                time.sleep(delay)
                delay = min(delay * 2, 2.0)
        _peer.get()


_context: Optional[Elastic] = None


def context() -> Elastic:
    global _context
    if _context is None:
        _context = Elastic()
    return _context


def resize(n: int) -> bool:
    """Asks for a cluster of n workers. Call it from a policy hook (kf.Hook); the decision is
    agreed, then applied once the new workers are ready, without stopping training. Returns
    whether the request changes the cluster (False: n is the current size already). Bad sizes
    raise ResizeError (a ValueError) at once."""
    from kungfu.policy import _actions
    import kungfu as kf

    ctx = context()
    n = ctx.check_size(n)
    if not _actions.in_round():
        raise RuntimeError("kf.resize is applied by kf.Hook: call it from a policy hook")
    if n == kf.size() and ctx.pending is None:
        return False
    _actions._record("resize", n)
    return True


def detached() -> bool:
    """Whether a resize removed this worker from the cluster."""
    return _peer.detached()
