"""The process-wide native peer: created from the environment on first use, stopped at exit."""
from __future__ import annotations

import atexit
import contextlib
import os
import socket
import threading
from dataclasses import dataclass
from typing import Callable, List, Optional

from kungfu import _env, _gpu, _native, _spare, _watchdog, timeline
from kungfu.errors import PeerFailedError, raise_for_status


@dataclass(frozen=True)
class Identity:
    """Who this process is, as kungfu-run described it (rank 0 of 1 when run alone)."""

    self_spec: Optional[str]
    peers: List[str]
    version: int

    @property
    def rank(self) -> int:
        return self.peers.index(self.self_spec) if self.self_spec else 0

    @property
    def size(self) -> int:
        return max(len(self.peers), 1)

    def _host(self, spec: str) -> str:
        return spec.rsplit(":", 1)[0]

    @property
    def local_rank(self) -> int:
        if not self.self_spec:
            return 0
        me = self._host(self.self_spec)
        return [self._host(p) for p in self.peers[: self.rank]].count(me)

    @property
    def local_size(self) -> int:
        if not self.self_spec:
            return 1
        me = self._host(self.self_spec)
        return [self._host(p) for p in self.peers].count(me)


def identity_from_env(environ=None) -> Identity:
    """The identity kungfu-run gave this worker (`environ`: another environment to read). A
    warm spare waits here for its place first (kungfu/_spare.py)."""
    if environ is None:
        _spare.wait()
    spec = _env.SELF_SPEC.get(environ)
    peers_raw = _env.INIT_PEERS.get(environ)
    if not spec:
        return Identity(None, [], 0)
    peers = [p for p in (peers_raw or spec).split(",") if p]
    if spec not in peers:
        raise ValueError(
            f"{_env.SELF_SPEC.name}={spec!r} is not in {_env.INIT_PEERS.name}={peers_raw!r}"
        )
    return Identity(spec, peers, _env.INIT_CLUSTER_VERSION.get(environ))


_lock = threading.Lock()
_peer = None
_listener: Optional[tuple] = None  # (address, socket or -1): see listen_fd
_detached = False
_member: Optional[Identity] = None  # this worker in the last cluster it was a member of
_before_join: Optional[Callable[[], None]] = None  # see on_join
_gone: Optional[Callable[[List[str], int], Optional[str]]] = None  # see on_connect_wait
GONE_POLL_SECONDS = 0.5


def on_join(fn: Callable[[], None]) -> None:
    """`fn` runs before a joiner of an elastic job first connects (kungfu/elastic reports it
    ready in the store: the core knows nothing of the store)."""
    global _before_join
    _before_join = fn


def on_connect_wait(fn: Callable[[List[str], int], Optional[str]]) -> None:
    """While a peer connects, `fn(peers, version)` is asked every GONE_POLL_SECONDS why waiting
    is pointless (kungfu/elastic: a peer its launcher saw exit); an answer fails the connect
    at once with it, instead of at the connect deadline."""
    global _gone
    _gone = fn


def _start(peer, peers: List[str], version: int) -> None:
    """peer.start(), given up as soon as the on_connect_wait function names a reason."""
    if _gone is None or len(peers) < 2:
        raise_for_status(peer.start())
        return
    done, lock, aborted = threading.Event(), threading.Lock(), []

    def watch() -> None:
        while not done.wait(GONE_POLL_SECONDS):
            try:
                why = _gone(peers, version)
            except Exception:  # noqa: BLE001 - a store that cannot answer: keep waiting
                continue
            with lock:
                if why and not done.is_set():
                    aborted.append(why)
                    peer.abort_start(why)
                    return

    watcher = threading.Thread(target=watch, name="kungfu-connect-watch", daemon=True)
    watcher.start()
    try:
        status = peer.start()
    finally:
        with lock:
            done.set()
    watcher.join(timeout=GONE_POLL_SECONDS + 5)
    if aborted and status[0] == 0:  # aborted just as it connected: the peer is failed anyway
        raise PeerFailedError(aborted[0])
    raise_for_status(status)


def listen_fd(self_spec: Optional[str]) -> int:
    """The socket kungfu-run bound to this worker's address and holds for the job
    (KUNGFU_LISTEN_FD), which every peer of this process at that address listens on; -1 where
    there is none (the runtime then binds the address itself). A resize keeps a worker's
    address, so one socket serves each cluster version it is in. Checked once: a process that
    inherited the variable but not the socket (one the worker started) has another file, or
    none, at that number."""
    global _listener
    if not self_spec:
        return -1
    if _listener is None:
        fd = _env.LISTEN_FD.get()
        _listener = (self_spec, fd if fd is not None and _bound_to(fd, self_spec) else -1)
        if _listener[1] >= 0:
            os.set_inheritable(fd, False)  # the script's own children do not hold the port
    return _listener[1] if _listener[0] == self_spec else -1


def _bound_to(fd: int, spec: str) -> bool:
    """Whether `fd` is a TCP socket bound to the port of address `spec`."""
    try:
        probe = socket.socket(fileno=os.dup(fd))
    except OSError:
        return False
    with probe:
        try:
            port = probe.getsockname()[1]
        except OSError:
            return False
        return (probe.family == socket.AF_INET and probe.type == socket.SOCK_STREAM
                and str(port) == spec.rsplit(":", 1)[1])


def inherited_listener() -> bool:
    """Whether this worker listens on a socket kungfu-run bound for it (listen_fd)."""
    return _listener is not None and _listener[1] >= 0


def _create(self_spec: Optional[str], peers: List[str], version: int,
            before_connect: Optional[Callable[[], None]] = None):
    """The started native peer. `before_connect` runs once it listens (its port is its own: a
    port in use fails here, before the call says anything to anyone) and before it connects."""
    _watchdog.start_from_env()
    # Before the peer: the timeline's exit handler then runs after the peer's stop (atexit
    # runs handlers last in, first out) and takes the peer's last events.
    record = timeline.enabled()

    multi = len(peers) > 1
    gpu_path, gpu_device = _gpu.backend_for(self_spec or "127.0.0.1:1", peers or [])
    peer = _native.lib().Peer(
        self_id=self_spec if multi else "127.0.0.1:1",
        peers=peers if multi else [],
        version=version,
        strategy=_native.strategy_code(_env.ALLREDUCE_STRATEGY.get()),
        op_timeout_ms=int(_env.OP_TIMEOUT.get() * 1000),
        peer_timeout_ms=int(_env.PEER_TIMEOUT.get() * 1000),
        mismatch_grace_ms=int(_env.MISMATCH_GRACE.get() * 1000),
        connect_timeout_ms=int(_env.CONNECT_TIMEOUT.get() * 1000),
        chunk_bytes=_env.CHUNK_BYTES.get(),
        parallelism=_env.PARALLELISM.get(),
        fusion_bytes=_env.FUSION_BYTES.get(),
        job_token=_env.JOB_TOKEN.get() or "",
        progress_ms=int(_env.PROGRESS_INTERVAL.get() * 1000),
        timeline=record,
        gpu_path=gpu_path,
        gpu_device=gpu_device,
        gpu_chunk_bytes=_env.GPU_CHUNK_BYTES.get(),
        listen_fd=listen_fd(self_spec) if multi else -1,
    )
    raise_for_status(peer.listen())
    if before_connect is not None:
        before_connect()
    _start(peer, peers, version)
    atexit.register(_stop_at_exit, peer)
    if record:
        where = f"rank {peer.rank} {self_spec}" if multi else "alone"
        timeline._attach(peer, f"worker {where} (version {version}, pid {os.getpid()})")
    return peer


def _stop_at_exit(peer) -> None:
    _watchdog.note_exit()  # before the goodbye that fails the peers' waits on this worker
    peer.stop()


def _stop(peer) -> None:
    """Stops a peer that is being replaced, keeping its timeline events."""
    peer.stop()
    timeline._detach(peer)


def get():
    """The started native peer of this process."""
    global _peer
    if _peer is not None:
        return _peer
    with _lock:
        if _peer is None:
            ident = identity_from_env()
            # A joiner connects at its version once it said it is ready (the others switch to
            # that version when every joiner is), and says so only once it listens: a joiner
            # whose port is taken fails before the switch, and its resize is abandoned.
            _peer = _create(ident.self_spec, ident.peers, ident.version,
                            _before_join if _env.ELASTIC_JOINING.get() else None)
    return _peer


def started() -> bool:
    return _peer is not None


def identity():
    """The started native peer, or this worker's identity from its environment (rank, size,
    local rank and size) when it has not connected yet. A worker a resize left out keeps the
    rank and size it last had (never rank 0: shrinks drop the highest ranks), so code after
    training that runs on rank 0 only does not run there too."""
    if _detached and _member is not None:
        return _member
    return get() if _peer is not None else identity_from_env()


def joining() -> bool:
    """Whether this is a worker of an elastic job that joins a running cluster and has not
    connected yet (it connects on its first collective, which reports it ready first: kf.Hook
    does so when it syncs it, not on import)."""
    return _peer is None and started_as_joiner()


def started_as_joiner() -> bool:
    """Whether this worker was started to join a running elastic job (a warm spare always is)."""
    return _spare.pending() or bool(_env.ELASTIC_JOINING.get())


def replace(self_spec: str, peers: List[str], version: int) -> None:
    """Swaps in a new native peer for cluster `version` (the old one, if any, is stopped first:
    the new one listens on the same address) and writes this worker's place in it into
    os.environ. Call between operations only."""
    global _peer, _detached, _member
    with _lock:
        old, _peer = _peer, None
        if old is not None:
            _stop(old)
        if _member is None:
            _member = identity_from_env()
        if self_spec in peers:
            _peer = _create(self_spec, list(peers), version)
            _member = Identity(self_spec, list(peers), version)
            # RANK, WORLD_SIZE, KUNGFU_SELF_SPEC ... stay true for the script and the processes
            # it starts from now on (the strategy and the joining flag stay as they were).
            _env.set_worker_env(os.environ, _env.worker_env(self_spec, list(peers), version))
        else:  # detached: a cluster of one, so that code after training still runs
            _peer = _create(None, [], version)
            _detached = True


@contextlib.contextmanager
def solo():
    """While the block runs, this process is a cluster of one; before and after it has no peer.
    A joiner uses it to rehearse its training step before it connects (kf.Hook)."""
    global _peer
    with _lock:
        if _peer is not None:
            raise RuntimeError("kungfu: solo() needs a process that has not connected yet")
        _peer = _create(None, [], 0)
    try:
        yield
    finally:
        with _lock:
            peer, _peer = _peer, None
        _stop(peer)


def detached() -> bool:
    """Whether this worker was removed from the cluster by a resize."""
    return _detached
