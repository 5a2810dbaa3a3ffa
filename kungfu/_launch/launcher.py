"""kungfu-run's launcher: one event loop that starts this host's workers, supervises them and
stops the job when a worker fails, a signal comes or the time limit passes.

One launcher runs on each host of a job. It computes the whole peer list from -np and -H (the
same on every host), starts the workers whose host is its own, gives each its identity through
the KUNGFU_* environment variables (kungfu._env.worker_env), prefixes every line the workers
print with their rank, forwards SIGINT/SIGTERM, and stops the job when a worker fails or the
time limit passes. Elastic mode (-w, kungfu/_launch/elastic.py) extends the same loop.

The launcher never loads TensorFlow, nor the native runtime but to read the strategies' names
(kungfu/_launch/flags.py: for -help and -strategy).
"""
from __future__ import annotations

import queue
import shlex
import signal
import socket
import threading
import time
from typing import Dict, List, Optional

from kungfu import timeline
from kungfu._hosts import Worker
from kungfu._launch.flags import EXIT_TIMEOUT, GRACE_SECONDS, Options
from kungfu._launch.output import _fmt_seconds, _plural, _ranks
from kungfu._launch.processes import Processes, _describe_exit, _exit_code


class _Interrupted(Exception):
    """A signal or -timeout ended a wait before the event loop ran; `code` is the exit code."""

    def __init__(self, code: int):
        super().__init__(code)
        self.code = code


class Launcher(Processes):
    """A static job: the workers of this host start together and the first failure ends it."""

    def __init__(self, opts: Options, peers: List[Worker], mine: List[Worker],
                 listeners: Optional[Dict[str, socket.socket]] = None):
        super().__init__(opts, peers, mine, listeners)
        # The event loop's state (see _run).
        self.start = 0.0
        self.result: Optional[int] = None  # the job's exit code, once decided
        self.stopping = False
        self.stop_signal = signal.SIGTERM
        self.kill_at: Optional[float] = None
        self.killed = False
        self.received_signal: Optional[int] = None

    def run(self) -> int:
        start = time.monotonic()
        started_at = time.time()
        previous = self._install_signal_handlers()
        try:
            return self._run(start)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            if not self._drained:
                self._drain()
            self._release_ports()
            for run in self.running.values():
                if run.log is not None:
                    with run.log_lock:
                        run.log.close()
            if self.opts.timeline is not None:
                self._merge_timeline(started_at)

    def _merge_timeline(self, since: float) -> None:
        """Joins the trace files this job's workers wrote here into DIR/timeline.json."""
        try:
            out, files = timeline.merge(self.opts.timeline, since=since)
        except OSError as e:
            self.error(f"timeline: cannot merge the workers' traces in {self.opts.timeline}: {e}")
            return
        self.info(f"timeline: {out} ({_plural(files, 'worker trace')}; open it in "
                  f"ui.perfetto.dev or chrome://tracing)")

    # the event loop: one for every mode; elastic mode (kungfu/_launch/elastic.py) extends it
    # through _begin, _poll, _on_exit, _over, _conclude, _close and _success.

    POLL_SECONDS = 0.5  # the longest wait for an event between two polls

    def _run(self, start: float) -> int:
        self.start = start
        try:
            code = self._begin()
        except _Interrupted as e:
            code = e.code
        if code is not None:
            self._close()
            return code
        deadline = None if self.opts.timeout is None else start + self.opts.timeout
        try:
            while True:
                now = time.monotonic()
                if not self.stopping:
                    self._poll(now)
                if self._over():
                    break
                waits = [self.POLL_SECONDS]
                if deadline is not None and not self.stopping:
                    waits.append(deadline - now)
                if self.kill_at is not None and not self.killed:
                    waits.append(self.kill_at - now)
                try:
                    event = self.events.get(timeout=max(0.0, min(waits)))
                except queue.Empty:
                    event = None
                now = time.monotonic()
                if event is not None and event[0] == "exit":
                    self._on_exit(event, now)
                elif event is not None and event[0] == "signal":
                    self._on_signal_event(event[1], now)
                if deadline is not None and not self.stopping and now >= deadline:
                    self.error(f"timeout: the job did not finish within "
                               f"{_fmt_seconds(self.opts.timeout)}; stopping "
                               f"{_plural(len(self._alive()), 'worker')}")
                    self._stop(EXIT_TIMEOUT, signal.SIGTERM, now)
                if (self.kill_at is not None and not self.killed and now >= self.kill_at
                        and self._alive()):
                    alive = ", ".join(str(r.worker.rank) for r in self._alive())
                    self.error(f"workers {alive} still running {_fmt_seconds(GRACE_SECONDS)} "
                               f"after {signal.Signals(self.stop_signal).name}; sending SIGKILL")
                    self._signal_all(signal.SIGKILL)
                    self.killed = True
            self._conclude()
        finally:
            self._close()
        self._drain()
        if self.result is not None:
            return self.result
        if self.received_signal is not None:
            return 128 + self.received_signal
        return self._success()

    def _stop(self, result: Optional[int], sig: int, now: float) -> None:
        """Ends the job: `result` is its exit code (None: decided later); the workers get `sig`,
        and SIGKILL GRACE_SECONDS later."""
        if result is not None:
            self.result = result
        self.stopping = True
        self.stop_signal = sig
        self._signal_all(sig)
        self.kill_at = now + GRACE_SECONDS

    def _on_signal_event(self, signum: int, now: float) -> None:
        name = signal.Signals(signum).name
        if not self.stopping:
            self.received_signal = signum
            self.info(f"received {name}; forwarding it to "
                      f"{_plural(len(self._alive()), 'worker')}")
            self._stop(None, signum, now)
        elif not self.killed:
            self.error(f"received {name} again; killing the workers")
            self._signal_all(signal.SIGKILL)
            self.killed = True

    def _wait_at_start(self, what: str, seconds: float = 0.0, call=None):
        """A wait before the event loop runs, which honours what the loop would: SIGINT and
        SIGTERM end it at once (exit code 128+k) and so does -timeout (124), by _Interrupted.
        Waits `seconds`, or, given `call`, runs it on a helper thread and returns its result (or
        raises its exception), so that a call that blocks (a request to a host that does not
        answer) cannot hold a signal up. `what` names the wait in the line that ends it."""
        tag = object()
        if call is not None:
            def helper():
                try:
                    self.events.put(("call", tag, True, call()))
                except Exception as e:  # handed to the waiting thread
                    self.events.put(("call", tag, False, e))

            threading.Thread(target=helper, name="kungfu-run-start", daemon=True).start()
        until = None if call is not None else time.monotonic() + seconds
        deadline = None if self.opts.timeout is None else self.start + self.opts.timeout
        while True:
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                self.error(f"timeout: the job did not start within "
                           f"{_fmt_seconds(self.opts.timeout)} ({what})")
                raise _Interrupted(EXIT_TIMEOUT)
            if until is not None and now >= until:
                return None
            waits = [self.POLL_SECONDS] + [t - now for t in (until, deadline) if t is not None]
            try:
                event = self.events.get(timeout=max(0.0, min(waits)))
            except queue.Empty:
                continue
            if event[0] == "signal":
                self.received_signal = event[1]
                self.info(f"received {signal.Signals(event[1]).name} while {what}; exiting")
                raise _Interrupted(128 + event[1])
            if event[0] == "call" and event[1] is tag:
                if event[2]:
                    return event[3]
                raise event[3]

    # What a static job does at each point of the loop.

    def _begin(self) -> Optional[int]:
        """Starts the job; an exit code if it cannot."""
        mine = self.mine
        hosts = ", ".join(dict.fromkeys(w.host for w in mine))
        self.info(
            f"starting {_plural(len(mine), 'worker')} of {len(self.peers)} on {hosts} "
            f"({_ranks(mine)}), strategy {self.opts.strategy}: {shlex.join(self.opts.command)}"
        )
        return self._start_all()

    def _poll(self, now: float) -> None:
        """Between events, while the job is not stopping."""

    def _over(self) -> bool:
        return not self._alive()

    def _on_exit(self, event: tuple, now: float) -> None:
        """A worker exited: the first failure stops the job (its exit code is the job's)."""
        if event[2] != 0 and self.result is None and not self.stopping:
            event = self._first_failure(event)
        _, rank, rc, _ = event
        run = self.running[rank]
        run.returncode = rc
        if rc != 0 and self.result is None and not self.stopping:
            others = len(self._alive())
            tail = f"; stopping the other {_plural(others, 'local worker')}"
            self.error(f"worker {rank} ({run.worker.spec}) {_describe_exit(rc)}"
                       + (tail if others else ""))
            self._stop(_exit_code(rc), signal.SIGTERM, now)
        elif rc != 0 and self.result is None and self.received_signal is not None:
            self.result = _exit_code(rc)

    def _conclude(self) -> None:
        """The loop ended (before _close)."""

    def _close(self) -> None:
        """After the loop, however it ended."""

    def _success(self) -> int:
        """The exit code when no failure, timeout or signal decided it."""
        n = len(self.mine)
        self.info(f"{'all ' if n > 1 else ''}{_plural(n, 'worker')} finished successfully in "
                  f"{time.monotonic() - self.start:.1f}s")
        return 0
