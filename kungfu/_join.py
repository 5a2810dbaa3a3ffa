"""Uneven data: join (Horovod's hvd.join, PyTorch's Join) over the numpy collectives.

Inside `with Join():` every collective of the whole cluster is announced before it is issued: one
small allgather named "kungfu::join" (a *round*) carries its description (kind, name, the how
many-th use of the name since the scope began, shape, dtype, reduce op, root, strategy). The
announcement is asynchronous: nobody waits for it, so a round costs a few small messages per
collective and no time on the caller's path.

A worker that calls `join()` has no more data: it stops issuing collectives of its own and takes
part in the rounds instead, each one waited for. From the descriptions it learns, it issues every
collective the others still issue, under the same name, with what contributes nothing (zeros to a
sum or an average, the identity of min, max and prod, no rows to an allgather, a buffer that
receives a broadcast), so the others need not know who has joined: an average is still the sum
divided by the cluster's size, Horovod's (a joined worker counts as zeros). Collectives it
cannot take part in (consensus, alltoall, reducescatter, a broadcast from a joined root) it fails
on every worker with a reason naming itself and the operation (Peer.fail).

A round in which every worker says it has joined ends join() on all of them with the same value:
the rank that joined last (the one whose join came in the latest round; the highest such rank
when several joined in the same round). Then the scope starts afresh (the next epoch), every
worker issuing its own collectives again.

Every wait is a collective's wait with its deadline (`timeout`, else KUNGFU_OP_TIMEOUT), and a
worker that dies fails the others' waits with the runtime's error naming it.
"""
from __future__ import annotations

import json
import threading
from typing import Any, Callable, Dict, List, Optional

import numpy as np

from kungfu import _collective, _peer
from kungfu.errors import InvalidArgumentError

ROUND = "kungfu::join"  # the rounds' name; collectives under it are never announced


class _Scope:
    """This worker's state inside `with Join():` (one at a time per process)."""

    def __init__(self, timeout: Optional[float]):
        self.timeout = timeout
        self.lock = threading.Lock()
        self.rounds = 0       # rounds this worker has issued since the scope (or last join) began
        self.uses: Dict[str, int] = {}  # per name: uses issued or served since then
        self.joined = False


_scope: Optional[_Scope] = None
# Bindings whose collectives do not go through _collective (TensorFlow's ops) announce them with
# announce(via=...) and register here how a joined worker issues one: fn(description, timeout).
_servers: Dict[str, Callable[[dict, Optional[float]], None]] = {}


def active() -> bool:
    """Whether this worker is inside a Join block and has not joined (its collectives announce
    themselves)."""
    scope = _scope
    return scope is not None and not scope.joined


def register_server(via: str, fn: Callable[[dict, Optional[float]], None]) -> None:
    _servers[via] = fn


def _key(kind: str, name: Optional[str]) -> str:
    # The runtime numbers operations per name (unnamed ones per kind), as this does.
    return name if name else "\0" + kind


def _announce(kind: str, name: Optional[str], array: np.ndarray, ranks, **extra) -> None:
    """Called by every collective of _collective just before it is issued."""
    if (name or "").startswith(ROUND):
        return
    announce(kind, name, ranks, s=list(array.shape), d=array.dtype.name, **extra)


def announce(kind: str, name: Optional[str], ranks=(), **fields) -> None:
    """Describes a collective about to be issued, to the workers that have joined (nothing
    outside a Join block or once this worker has joined). `fields` (JSON values) are what a
    server needs; via="<binding>" makes register_server's function of that binding issue it."""
    scope = _scope
    if scope is None or scope.joined:
        return
    if ranks:
        raise InvalidArgumentError(
            f"{kind} '{name or ''}': collectives of a process set are not supported inside "
            "kungfu's Join (a worker that has joined takes part in the whole cluster's only)")
    with scope.lock:
        key = _key(kind, name)
        use = scope.uses.get(key, 0)
        scope.uses[key] = use + 1
        scope.rounds += 1
        _round(dict(k=kind, n=name or "", i=use, **fields), scope.timeout)  # nobody waits


def _round(desc: dict, timeout: Optional[float]) -> _collective.Handle:
    data = np.frombuffer(json.dumps(desc).encode(), np.uint8)
    return _collective.allgather_async(data, ROUND, timeout=timeout, with_rows=True)


def identity(op: str, dtype: np.dtype) -> Any:
    """What a joined worker contributes to a reduction: the value that changes nothing."""
    if op in ("sum", "avg"):
        return 0
    if op == "prod":
        return 1
    if dtype == np.bool_:
        return op == "min"
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return info.max if op == "min" else info.min
    return np.inf if op == "min" else -np.inf  # floats, bfloat16 included


def _unsupported(desc: dict, me: int, why: str, timeout) -> None:
    """Fails the operation on every worker, naming this one and the operation."""
    kind, name = desc["k"], desc["n"]
    reason = (f"rank {me} has joined (it has no more data): {kind} '{name}' {why} (supported "
              "while a rank has joined: allreduce, barrier, allgather, and reduce, gather and "
              "broadcast to or from a rank that has not joined)")
    ms = _collective._timeout_ms(timeout)
    _peer.get().fail(kind, name, reason, ms, [])


def _serve(desc: dict, me: int, joined: set, timeout) -> Optional[_collective.Handle]:
    """Issues, on a joined worker, the collective `desc` describes, contributing nothing.
    `joined`: the ranks that had joined in the round that described it (the same set on every
    worker, so all the joined ones fail an op whose root is among them, none serves it)."""
    kind, name = desc["k"], desc["n"] or None
    if "via" in desc:
        server = _servers.get(desc["via"])
        if server is None:
            _unsupported(desc, me, f"comes from {desc['via']}, which this rank has not loaded",
                         timeout)
        else:
            server(desc, timeout)  # issued and waited for (TensorFlow runs it eagerly)
        return None
    shape, dtype = tuple(desc["s"]), np.dtype(desc["d"])
    op, root, strategy = desc.get("o"), desc.get("r", 0), desc.get("st")
    c = _collective
    if kind in ("allreduce", "reduce"):
        x = np.full(shape, identity(op, dtype), dtype)
        if kind == "allreduce":
            return c.allreduce_async(x, op, name, strategy, timeout)
        if root not in joined:
            return c.reduce_async(x, op, root, name, strategy, timeout)
    elif kind in ("allgather", "gather"):
        none = np.zeros((0,) + shape[1:], dtype)
        if kind == "allgather":
            return c.allgather_async(none, name, timeout)
        if root not in joined:
            return c.gather_async(none, root, name, timeout)
    elif kind == "broadcast":
        if root not in joined:
            return c.broadcast_async(np.zeros(shape, dtype), root, name, strategy, timeout)
    elif kind == "barrier":
        native = _peer.get().barrier(name or "", c._timeout_ms(timeout), [])
        return c.Handle(native, lambda: None)
    else:
        _unsupported(desc, me, "is not supported while a rank has joined", timeout)
        return None
    _unsupported(desc, me, f"has the joined rank {root} as its root", timeout)
    return None


class _Server:
    """A joined worker's part in the rounds: what it has served, and the handles of that."""

    def __init__(self, scope: _Scope, me: int):
        self.scope, self.me = scope, me
        self.waiting: Dict[str, Dict[int, dict]] = {}  # per name: described uses not yet due
        self.handles: List[_collective.Handle] = []

    def take(self, descs: List[dict], joined: set) -> None:
        """Serves each described use once, in the order of the uses of its name."""
        for d in sorted(descs, key=lambda d: d["i"]):
            self.waiting.setdefault(_key(d["k"], d["n"] or None), {})[d["i"]] = d
        for key, uses in self.waiting.items():
            while self.scope.uses.get(key, 0) in uses:
                d = uses.pop(self.scope.uses.get(key, 0))
                self.scope.uses[key] = d["i"] + 1
                h = _serve(d, self.me, joined, self.scope.timeout)
                if h is not None:
                    self.handles.append(h)
            for i in [i for i in uses if i < self.scope.uses.get(key, 0)]:
                del uses[i]  # issued here before joining, or served already
        self.handles = [h for h in self.handles if not self._finished(h)]

    @staticmethod
    def _finished(h: _collective.Handle, block: bool = False) -> bool:
        if not block and not h.done():
            return False
        try:
            h.wait()  # raises the error of a served collective that failed
        except InvalidArgumentError:
            pass  # the others' input or call was refused: theirs to handle (they got it too)
        return True

    def finish(self) -> None:
        for h in self.handles:
            self._finished(h, block=True)
        left = {k: sorted(u) for k, u in self.waiting.items() if u}
        if left:
            raise InvalidArgumentError(
                f"join: workers described uses of names that never came in order: {left}")


def join(timeout: Optional[float] = None) -> int:
    """This worker has no more data: it takes part in the others' collectives (contributing
    nothing) until every worker has joined, then returns on all of them the rank that joined
    last. Must be called inside `with Join():` (where collectives announce themselves)."""
    scope = _scope
    if scope is None:
        raise InvalidArgumentError(
            "join() needs the collectives to be issued inside `with Join():` (kungfu.Join, "
            "kungfu.torch.Join), where a joined worker learns what the others issue")
    if timeout is None:
        timeout = scope.timeout
    me = _peer.get().rank
    with scope.lock:
        scope.joined = True
        mine = scope.rounds
    server = _Server(scope, me)
    while True:
        with scope.lock:
            scope.rounds += 1
        data, rows = _round({"j": mine}, timeout).wait()
        ends = np.cumsum(rows).tolist()
        descs = [json.loads(data[e - n:e].tobytes()) for n, e in zip(rows, ends)]
        if all("j" in d for d in descs):
            break
        server.take([d for d in descs if "j" not in d],
                    {r for r, d in enumerate(descs) if "j" in d})
    server.finish()
    with scope.lock:
        scope.rounds, scope.uses, scope.joined = 0, {}, False
    return max(range(len(descs)), key=lambda r: (descs[r]["j"], r))


class Join:
    """`with Join(): <the loop over this worker's batches>`: workers may run different numbers
    of steps. Inside, every collective announces itself; at the end of the block (or at an
    explicit join()), a worker that has run out of data takes part in the others' collectives,
    contributing zeros, until all of them are done; `last_joined` is then the rank that joined
    last. Every worker enters and leaves the block at the same point of its program.

    `timeout`: the deadline of each round and of the collectives a joined worker issues (None:
    KUNGFU_OP_TIMEOUT). `enable=False` makes the block do nothing (PyTorch's Join takes it too)."""

    def __init__(self, timeout: Optional[float] = None, enable: bool = True):
        self.timeout = timeout
        self.enable = enable
        self.last_joined: Optional[int] = None

    def __enter__(self) -> "Join":
        global _scope
        if not self.enable:
            return self
        if _scope is not None:
            raise InvalidArgumentError("Join blocks do not nest")
        _scope = _Scope(self.timeout)
        _collective._announce = _announce
        return self

    def __exit__(self, kind, value, tb) -> None:
        global _scope
        if not self.enable:
            return
        try:
            if kind is None:
                self.last_joined = join(self.timeout)
        finally:
            _scope = None
            _collective._announce = None
