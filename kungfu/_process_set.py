"""Process sets: collectives among some of the workers (Horovod's hvd.ProcessSet).

`ProcessSet(ranks)` names workers by their global ranks. Passed as `process_set=` to a
collective, only the members call it, roots and results are the set's (rank i of the set is its
i-th smallest global rank), and the result is as if the set were the whole cluster. The runtime
runs a set's operations in a session over the members that shares the cluster's connections
(srcs/go-free-runtime/include/kungfu/process_set.h), under names of their own: sets run
concurrently with each other and with the cluster's operations.

Resize: a set belongs to the cluster version it was made in. After a resize or a recovery the
ranks may name other workers, so using it raises an error that says to make it again.
"""
from __future__ import annotations

import numbers
import threading
from typing import Iterable, List, Optional

import numpy as np

from kungfu import _peer
from kungfu.errors import InvalidArgumentError

# (version, ranks) of the sets whose members this process has checked (one consensus each).
_checked: set = set()
_checked_lock = threading.Lock()


class ProcessSet:
    """Some workers, by global rank, of the cluster version current when it was made."""

    def __init__(self, ranks: Iterable[int]):
        ranks = list(ranks.tolist() if isinstance(ranks, np.ndarray) else ranks)
        if any(isinstance(r, bool) or not isinstance(r, numbers.Integral) for r in ranks):
            raise InvalidArgumentError(f"process set ranks must be ints, got {ranks!r}")
        ranks = sorted(int(r) for r in ranks)
        peer = _peer.get()
        if not ranks:
            raise InvalidArgumentError("a process set needs at least one rank")
        dup = [a for a, b in zip(ranks, ranks[1:]) if a == b]
        if dup:
            raise InvalidArgumentError(f"process set rank {dup[0]} is given twice: {ranks}")
        bad = [r for r in ranks if not 0 <= r < peer.size]
        if bad:
            raise InvalidArgumentError(
                f"process set rank {bad[0]} is out of range: the cluster has {peer.size} workers")
        self.ranks: List[int] = ranks
        self.version: int = peer.version

    @classmethod
    def _of(cls, ranks: List[int], version: int) -> "ProcessSet":
        """The set of `ranks` made in cluster `version` (checked when used, not here): what an
        op built for a set records, for its gradient."""
        ps = cls.__new__(cls)
        ps.ranks, ps.version = sorted(int(r) for r in ranks), int(version)
        return ps

    def included(self) -> bool:
        """Whether this worker is a member."""
        return _peer.get().rank in self.ranks

    def rank(self) -> Optional[int]:
        """This worker's rank in the set, or None if it is not a member."""
        me = _peer.get().rank
        return self.ranks.index(me) if me in self.ranks else None

    def size(self) -> int:
        return len(self.ranks)

    def __repr__(self) -> str:
        return f"ProcessSet({self.ranks}, version={self.version})"

    def __eq__(self, other) -> bool:
        return (isinstance(other, ProcessSet) and other.ranks == self.ranks
                and other.version == self.version)

    def __hash__(self) -> int:
        return hash((tuple(self.ranks), self.version))


def members(process_set: Optional[ProcessSet], what: str) -> list:
    """The ranks that the native calls take ([] for the whole cluster), after the checks every
    use makes: a current version, this worker a member (both refused at once, on this worker
    only), and the first time, a consensus of the members on the ranks."""
    if process_set is None:
        return []
    if not isinstance(process_set, ProcessSet):
        raise InvalidArgumentError(
            f"{what}: process_set must be a kungfu ProcessSet or None, got "
            f"{type(process_set).__name__}")
    peer = _peer.get()
    if process_set.version != peer.version:
        raise InvalidArgumentError(
            f"{what}: {process_set!r} was made for cluster version {process_set.version}, and the "
            f"cluster is now at version {peer.version} (a resize or a recovery changed who the "
            "ranks are): make the process set again")
    if peer.rank not in process_set.ranks:
        raise InvalidArgumentError(
            f"{what}: this worker (rank {peer.rank}) is not a member of {process_set!r}: only "
            "members may call its operations")
    key = (process_set.version, tuple(process_set.ranks))
    with _checked_lock:
        first = key not in _checked
        _checked.add(key)
    if first and len(process_set.ranks) > 1:
        _check(peer, process_set)
    return process_set.ranks


def _check(peer, process_set: ProcessSet) -> None:
    """Every member must have made the same set. Members that made different sets run this
    under different set names: the runtime's name-mismatch check (or the deadline) fails it,
    naming both sets."""
    from kungfu.errors import raise_for_status

    data = np.array(process_set.ranks, np.int64).view(np.uint8)
    native = peer.consensus(data, "kungfu::process-set", -1, process_set.ranks)
    native.wait(-1.0)
    raise_for_status(native.status())  # names both sets when members made different ones
    if not native.agreed():  # same prefix, so the same ranks: cannot happen, but say so
        raise InvalidArgumentError(f"the members of {process_set!r} made different sets")
