"""A timeline of what this worker did: every collective the runtime ran, and Python-side phases
(the elastic membership states), as a Chrome trace that chrome://tracing and ui.perfetto.dev
open.

With KUNGFU_TIMELINE=DIR (kungfu-run -timeline DIR sets it for every worker) each worker process
writes DIR/<host>-<pid>.trace.json in the JSON Array Format, as it goes: "[" first, then events
separated by ",\\n"; a background thread drains the runtime about once a second, and at exit the
file gets its closing "]" (so it is strict JSON then). A process that crashed leaves an array
without its "]": Chrome and Perfetto open it anyway, and so does `load`. `merge` joins the files
of a directory into one trace (kungfu-run does it when the job ends: DIR/timeline.json).

One collective is a complete event ("ph": "X") named by the op's name, with the op's kind as
its category and in args its bytes, strategy, sequence number, status, `queue_us` (from the
call until a runtime thread started it) and `wait_us` (from that start until the first message
of the op arrived from any peer: the time spent waiting for the slowest peer to get there; 0 if
a peer was there first). Its track (tid) is the runtime thread that ran it. Python phases
(`span`, `record`, `phase`) go on tracks of their own, named after them.

Nothing here imports numpy or TensorFlow; without KUNGFU_TIMELINE every call is a no-op.
"""
from __future__ import annotations

import atexit
import contextlib
import json
import os
import socket
import threading
import time
import warnings
from typing import Dict, Iterator, List, Optional, Tuple

from kungfu import _env

__all__ = ["enabled", "span", "record", "phase", "flush", "close", "load", "merge"]

DRAIN_SECONDS = 1.0  # how often the background thread drains the runtime and writes
# Python tracks' tids: the runtime numbers its threads from 1 (the pool grows with blocked ops,
# so there may be many), these start far above. They are shown first (a negative sort index).
_PY_TRACK_BASE = 1 << 20


def _now_us() -> int:
    return time.time_ns() // 1000


class _Writer:
    """Appends events to this process's trace file. The lock guards the file, the pending
    events, the tracks and the attached peers; the native drain runs outside it."""

    def __init__(self, directory: str):
        os.makedirs(directory, exist_ok=True)
        self.pid = os.getpid()
        self.path = os.path.join(directory, f"{socket.gethostname()}-{self.pid}.trace.json")
        self._lock = threading.Lock()
        self._file = open(self.path, "w", encoding="utf-8")
        self._file.write("[")
        self._first = True
        self._closed = False
        self._pending: List[dict] = []
        self._peers: list = []
        self._tracks: Dict[object, int] = {}  # runtime track id or Python track name -> tid
        self._open: Dict[str, tuple] = {}  # phase track -> (name, start_us, args)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kungfu-timeline", daemon=True)
        self._thread.start()
        atexit.register(self.close)

    # events ------------------------------------------------------------------------------
    def _meta(self, what: str, args: dict, tid: int = 0) -> None:
        self._pending.append({"name": what, "ph": "M", "pid": self.pid, "tid": tid, "args": args})

    def _tid(self, key, label: str) -> int:
        """Requires the lock. The tid of a track, naming it on first use."""
        tid = self._tracks.get(key)
        if tid is None:
            python = sum(not isinstance(k, int) for k in self._tracks)
            tid = key if isinstance(key, int) else _PY_TRACK_BASE + python
            self._tracks[key] = tid
            self._meta("thread_name", {"name": label}, tid)
            self._meta("thread_sort_index",
                       {"sort_index": tid if isinstance(key, int) else python - 1000}, tid)
        return tid

    def name_process(self, label: str) -> None:
        with self._lock:
            self._meta("process_name", {"name": label})

    def add(self, track: str, name: str, cat: str, ts: int, dur: int, args: dict) -> None:
        with self._lock:
            tid = self._tid(track, track)
            self._pending.append({"name": name, "cat": cat, "ph": "X", "ts": ts,
                                  "dur": max(0, dur), "pid": self.pid, "tid": tid, "args": args})

    def phase(self, track: str, name: Optional[str], args: dict) -> None:
        now = _now_us()
        with self._lock:
            prev = self._open.pop(track, None)
        if prev is not None:
            self.add(track, prev[0], track, prev[1], now - prev[1], prev[2])
        if name is not None:
            with self._lock:
                self._open[track] = (name, now, args)

    # the runtime -------------------------------------------------------------------------
    def attach(self, peer) -> None:
        with self._lock:
            self._peers.append(peer)

    def detach(self, peer) -> None:
        """Takes the peer's last events (call after it stopped) and lets go of it."""
        self._drain_peer(peer)
        with self._lock:
            self._peers = [p for p in self._peers if p is not peer]

    def _drain_peer(self, peer) -> None:
        events, dropped = peer.drain_timeline()
        if not events and not dropped:
            return
        with self._lock:
            for (kind, name, seq, nbytes, strategy, ts, dur, queue_us, wait_us, status,
                 track) in events:
                tid = self._tid(track, f"kungfu runtime thread {track}")
                self._pending.append({
                    "name": name, "cat": kind, "ph": "X", "ts": ts, "dur": dur,
                    "pid": self.pid, "tid": tid,
                    "args": {"kind": kind, "bytes": nbytes, "strategy": strategy, "seq": seq,
                             "wait_us": wait_us, "queue_us": queue_us, "status": status}})
            if dropped:
                self._pending.append({
                    "name": "timeline events dropped", "ph": "i", "s": "p", "ts": _now_us(),
                    "pid": self.pid, "tid": 0, "args": {"dropped": dropped}})

    # writing -----------------------------------------------------------------------------
    def flush(self) -> None:
        with self._lock:
            peers = list(self._peers)
        for p in peers:
            self._drain_peer(p)
        with self._lock:
            if self._closed or not self._pending:
                return
            parts = []
            for e in self._pending:
                parts.append(("" if self._first else ",\n") + json.dumps(e, separators=(",", ":")))
                self._first = False
            self._pending = []
            self._file.write("".join(parts))
            self._file.flush()

    def _loop(self) -> None:
        while not self._stop.wait(DRAIN_SECONDS):
            try:
                self.flush()
            except Exception:  # a full disk must not end training; the next flush retries
                pass

    def close(self) -> None:
        """At exit: ends open phases, drains the peers one last time, closes the array."""
        self._stop.set()
        with self._lock:
            tracks = list(self._open)
        for track in tracks:
            self.phase(track, None, {})
        self.flush()
        with self._lock:
            if not self._closed:
                self._closed = True
                self._file.write("\n]\n")
                self._file.close()


_lock = threading.Lock()
_writer: Optional[_Writer] = None
_disabled = False


def _get() -> Optional[_Writer]:
    """The process's writer, started on first use; None without KUNGFU_TIMELINE."""
    global _writer, _disabled
    if _writer is not None or _disabled:
        return _writer
    with _lock:
        if _writer is None and not _disabled:
            directory = _env.TIMELINE.get()
            try:
                _writer = _Writer(directory) if directory else None
            except OSError as e:  # training goes on without a timeline
                warnings.warn(f"kungfu: no timeline: cannot write to {_env.TIMELINE.name}="
                              f"{directory!r}: {e}", RuntimeWarning, stacklevel=3)
            _disabled = _writer is None
    return _writer


def enabled() -> bool:
    """Whether this process writes a timeline (KUNGFU_TIMELINE is set)."""
    return _get() is not None


def record(name: str, start_us: int, dur_us: int, track: str = "python", cat: str = "python",
           **args) -> None:
    """Adds one complete event: `start_us` is wall-clock microseconds since the epoch."""
    w = _get()
    if w is not None:
        w.add(track, name, cat, start_us, dur_us, args)


@contextlib.contextmanager
def span(name: str, track: str = "python", cat: str = "python", **args) -> Iterator[None]:
    """Records the block as one event on `track` (nothing without KUNGFU_TIMELINE)."""
    if _get() is None:
        yield
        return
    start = _now_us()
    try:
        yield
    finally:
        record(name, start, _now_us() - start, track, cat, **args)


def phase(track: str, name: Optional[str], **args) -> None:
    """Ends the phase open on `track` (an event from its start until now) and opens `name`
    (None: none). Phases still open at exit end then. For state machines: one call per
    transition."""
    w = _get()
    if w is not None:
        w.phase(track, name, args)


def flush() -> None:
    """Writes what was recorded so far (the background thread does it every second)."""
    w = _get()
    if w is not None:
        w.flush()


def close() -> None:
    """Ends the open phases, writes everything and closes the file (a strict JSON array then);
    later events are not written. Runs at exit by itself; call it before `os._exit`."""
    w = _get()
    if w is not None:
        w.close()


# Hooks for kungfu/_peer.py: the native peers whose events go to this process's file.
def _attach(peer, label: str) -> None:
    w = _get()
    if w is not None:
        w.name_process(label)
        w.attach(peer)


def _detach(peer) -> None:
    w = _get()
    if w is not None:
        w.detach(peer)


# Reading and merging ------------------------------------------------------------------------

def load(path: str) -> list:
    """The events of a trace file in the JSON Array Format, also one that a crashed process
    left without its closing "]" (or with a partly written last event, which is left out)."""
    with open(path, encoding="utf-8") as f:
        text = f.read().strip()
    try:
        data = json.loads(text)
        return data["traceEvents"] if isinstance(data, dict) else data
    except ValueError:
        pass
    body = text[1:] if text.startswith("[") else text
    events = []
    for line in body.split(",\n"):
        line = line.strip().rstrip("]").strip()
        if not line:
            continue
        try:
            events.append(json.loads(line))
        except ValueError:
            break  # the last event, cut short
    return events


def merge(directory: str, out: Optional[str] = None,
          since: Optional[float] = None) -> Tuple[str, int]:
    """Joins the *.trace.json files of `directory` into one trace (a JSON array) at `out`
    (default DIR/timeline.json); with `since` (a time.time()), only files written since then
    (a directory used by an earlier job keeps its files, but they stay out). Returns the path
    and the number of files joined."""
    out = out or os.path.join(directory, "timeline.json")
    names = sorted(n for n in os.listdir(directory) if n.endswith(".trace.json") and (
        since is None or os.path.getmtime(os.path.join(directory, n)) >= since))
    tmp = f"{out}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write("[")
        first = True
        for n in names:
            for e in load(os.path.join(directory, n)):
                f.write(("" if first else ",\n") + json.dumps(e, separators=(",", ":")))
                first = False
        f.write("\n]\n")
    os.replace(tmp, out)
    return out, len(names)
