"""The workers of this host as processes: spawning them with their identity, copying their
output, reaping them, signalling them, and blaming the one that failed first.

Every worker runs in a process group of its own, which is signalled as a whole. Two pipes tie
the workers to this launcher (kungfu/_watchdog.py): the watchdog pipe, whose end tells a worker
that its launcher is gone, and the exit-note pipe, on which a worker notes when it begins to
exit; the notes order the failures (_first_failure).
"""
from __future__ import annotations

import logging
import os
import queue
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import BinaryIO, Dict, List, Optional

from kungfu import _env
from kungfu._hosts import Worker
from kungfu._launch.flags import EXIT_CANNOT_EXECUTE, EXIT_NOT_FOUND, Options
from kungfu._launch.output import _binary, _Output, _plural, configure_logging, copy_lines, logger
from kungfu._launch.plan import gpu_count, visible_devices

BLAME_WINDOW = 0.1  # seconds of exits compared to find the worker that failed first
# How long a failure waits for the exit of a worker that had begun to exit before it.
EXITING_WAIT = 5.0
# A worker killed by a signal notes no exit: when it died is known only by its reap, and its
# peers, whose collectives fail on it within milliseconds, may note their exits before the
# launcher's waiting thread reaps it (under load, tens of milliseconds later: 4 of 9 kills blamed
# a survivor). So such a death counts as having begun this long before its reap. A failure
# noted earlier than that came first; a signal that is a consequence of a noted failure (a
# crash after a peer's) within it would be blamed instead, which kungfu's workers never do.
SIGNAL_SLACK = 1.0


def _preexec_parent_death_signal():
    """A preexec_fn that kills the worker when the launcher dies (Linux), or None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError):
        return None
    pr_set_pdeathsig = 1
    launcher_pid = os.getpid()

    def preexec():
        prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0)
        if os.getppid() != launcher_pid:  # the launcher died before prctl took effect
            os._exit(1)

    return preexec


def _ended(proc) -> bool:
    """Whether a worker's process has ended, though its waiting thread may not have reported
    the exit yet: a look that leaves the process to that thread to reap (WNOWAIT)."""
    if getattr(proc, "returncode", None) is not None:
        return True
    try:
        return os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return False  # not a child of this process (or reaped this instant: reported soon)



class _Running:
    def __init__(self, worker: Worker, proc: subprocess.Popen, log: Optional[BinaryIO]):
        self.worker = worker
        self.proc = proc
        self.log = log
        self.log_lock = threading.Lock()
        self.readers: List[threading.Thread] = []
        self.returncode: Optional[int] = None
        self.started = time.monotonic()
        self.spare: Optional[int] = None  # a warm spare's number until it is taken (spares.py)

    def label(self) -> str:
        """What its output lines are prefixed with: its rank, or "spare N"."""
        return str(self.worker.rank) if self.spare is None else f"spare {self.spare}"


def _exit_code(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


def _describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"was killed by {name} (exit code {128 - returncode})"
    return f"exited with code {returncode}"


class Processes:
    """This host's workers (`running`: the started ones by key, a rank unless elastic) and the
    events of their lives on one queue (`events`): ("exit", key, returncode, when) from a
    waiting thread per worker, ("signal", signum) from the signal handlers. The launcher's event
    loop (kungfu/_launch/launcher.py) consumes them."""

    def __init__(self, opts: Options, peers: List[Worker], mine: List[Worker],
                 listeners: Optional[Dict[str, socket.socket]] = None):
        self.opts = opts
        self.peers = peers
        self.mine = mine
        # host:port -> the listening socket of that slot of this host, held until the launcher
        # exits: each worker started there inherits it (kungfu/_launch/plan.py, listen).
        self.listeners = listeners or {}
        self.out = _Output(_binary(sys.stdout))
        self.err = _Output(_binary(sys.stderr))
        self.events: "queue.SimpleQueue[tuple]" = queue.SimpleQueue()
        self.running: Dict[int, _Running] = {}
        self._drained = False
        # Workers inherit the read end; only this process holds the write end, so the workers
        # see end of file when it dies, however it dies (kungfu/_watchdog.py).
        self._watchdog = os.pipe()
        # Workers note on this one when they begin to exit (kungfu/_watchdog.py): {pid: time}.
        self._exit_notes = os.pipe()
        self._exit_noted: Dict[int, float] = {}
        self._notes_reader: Optional[threading.Thread] = None
        configure_logging(self.err, opts.quiet, opts.verbose)
        self.gpus = gpu_count() if opts.gpu_per_worker else 0
        self.user_devices = os.environ.get("CUDA_VISIBLE_DEVICES")
        if opts.gpu_per_worker and (self.gpus or self.user_devices is not None):
            seen = (f"CUDA_VISIBLE_DEVICES={self.user_devices}" if self.user_devices is not None
                    else _plural(self.gpus, "GPU"))
            logger.debug(f"{seen}: each worker sees the device of its slot")

    # messages ---------------------------------------------------------------------------
    def info(self, msg: str) -> None:
        logger.info(msg)

    def error(self, msg: str) -> None:
        logger.error(msg)

    # signals ----------------------------------------------------------------------------
    def _on_signal(self, signum, _frame):
        self.events.put(("signal", signum))

    def _install_signal_handlers(self):
        previous = {}
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, self._on_signal)
        return previous

    # workers ----------------------------------------------------------------------------
    def _spawn(self, worker: Worker, peers: Optional[List[str]] = None, version: int = 0,
               extra_env: Optional[Dict[str, str]] = None, spare: Optional[tuple] = None,
               joining: bool = False) -> _Running:
        """Starts a worker (`joining`: a running cluster's). `spare`: (number, read end of its
        pipe) for a warm spare, which gets no identity, only the pipe it waits on for one
        (kungfu/_launch/spares.py)."""
        env = dict(os.environ)
        peers = [p.spec for p in self.peers] if peers is None else peers
        if spare is None:
            _env.set_worker_env(env, _env.worker_env(worker.spec, peers, version,
                                                     self.opts.strategy, joining))
        else:
            _env.set_worker_env(env, _env.NO_IDENTITY)
            env[_env.ALLREDUCE_STRATEGY.name] = self.opts.strategy
            env[_env.SPARE_FD.name] = str(spare[1])
        env.update(extra_env or {})
        env.pop(_env.LISTEN_FD.name, None)  # a launcher started by a worker passes its own on
        listener = self.listener_fd(worker.spec) if spare is None else None
        if listener is not None:
            env[_env.LISTEN_FD.name] = str(listener)
        if self.opts.gpu_per_worker:
            devices = visible_devices(worker.local_rank, self.gpus, self.user_devices)
            if devices is not None:
                env["CUDA_VISIBLE_DEVICES"] = devices
        if logger.isEnabledFor(logging.DEBUG):
            ident = " ".join(f"{k}={env[k]}" for k in (
                _env.SELF_SPEC.name, _env.INIT_CLUSTER_VERSION.name, *_env.STANDARD_RANK_VARS,
                "CUDA_VISIBLE_DEVICES") if k in env)
            who = f"worker {worker.rank}" if spare is None else f"spare {spare[0]}"
            logger.debug(f"{who}: {ident}: {shlex.join(self.opts.command)}")
        env[_env.JOB_TOKEN.name] = self.opts.job_token
        if self.opts.config_server_credentials is not None:
            env[_env.ETCD_CREDENTIALS.name] = self.opts.config_server_credentials
        env[_env.WATCHDOG_FD.name] = str(self._watchdog[0])
        notes = self._exit_notes[1]
        env[_env.EXIT_NOTE_FD.name] = f"{notes}:{os.fstat(notes).st_ino}"
        env["PYTHONUNBUFFERED"] = "1"
        if self.opts.timeline is not None:
            env[_env.TIMELINE.name] = self.opts.timeline
        log = None
        if self.opts.logdir is not None:
            name = f"rank-{worker.rank}.log" if spare is None else f"spare-{spare[0]}.log"
            log = open(os.path.join(self.opts.logdir, name), "wb")
        try:
            proc = subprocess.Popen(
                self.opts.command,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,  # own process group: signals reach its children too
                preexec_fn=_preexec_parent_death_signal(),
                pass_fds=(self._watchdog[0], notes) + (() if spare is None else (spare[1],))
                + (() if listener is None else (listener,)),
            )
        except BaseException:
            if log is not None:
                log.close()
            raise
        run = _Running(worker, proc, log)
        run.spare = None if spare is None else spare[0]
        return run

    def listener_fd(self, spec: str) -> Optional[int]:
        """The descriptor of the listening socket held for the worker at `spec`, if any."""
        sock = self.listeners.get(spec)
        return None if sock is None else sock.fileno()

    def _release_ports(self) -> None:
        """Closes the listening sockets (the launcher is done with its workers)."""
        for sock in self.listeners.values():
            sock.close()
        self.listeners = {}

    def _wait(self, run: _Running, key=None) -> None:
        code = run.proc.wait()
        logger.debug(f"worker {run.worker.rank} ({run.worker.spec}) {_describe_exit(code)} "
                     f"after {time.monotonic() - run.started:.1f}s")
        self.events.put(("exit", run.worker.rank if key is None else key, code, time.monotonic()))

    def _read_exit_notes(self) -> None:
        fd, pending = self._exit_notes[0], b""
        while True:
            try:
                data = os.read(fd, 4096)
            except OSError:
                return
            if not data:
                return
            *lines, pending = (pending + data).split(b"\n")
            for line in lines:
                try:
                    pgid, at = line.split()
                    self._exit_noted.setdefault(int(pgid), float(at))
                except ValueError:
                    continue  # not a note

    def _began_failing(self, event: tuple) -> float:
        """When the worker of an exit event began to exit: its note, else its exit (for a death
        by a signal, SIGNAL_SLACK before it)."""
        run = self.running.get(event[1])
        noted = None if run is None else self._exit_noted.get(run.proc.pid)
        if noted is not None:
            return min(noted, event[3])
        return event[3] - SIGNAL_SLACK if event[2] < 0 else event[3]

    def _first_failure(self, event: tuple) -> tuple:
        """The failing exit to blame: of those seen within BLAME_WINDOW of `event`, the one whose
        worker began to exit first. A worker that fails takes its peers down a moment later
        (PeerFailedError), and their exits can come first: a worker that has said goodbye still
        has its own exit to finish. So a worker that noted its exit before the failures seen
        began is waited for (up to EXITING_WAIT), and so is one whose process has ended but
        whose exit is not reported yet (a worker killed by a signal: see SIGNAL_SLACK)."""
        exits, others = [event], []
        start = time.monotonic()
        while True:
            failing = [e for e in exits if e[2] != 0]
            began = min(self._began_failing(e) for e in failing)
            seen = {e[1] for e in exits}
            exiting = any(run.returncode is None and key not in seen
                          and (self._exit_noted.get(run.proc.pid, began) < began
                               or _ended(run.proc))
                          for key, run in self.running.items())
            left = start + (EXITING_WAIT if exiting else BLAME_WINDOW) - time.monotonic()
            if left <= 0:
                break
            try:  # a note may come in meanwhile: look again soon
                e = self.events.get(timeout=min(left, 0.02))
            except queue.Empty:
                continue
            (exits if e[0] == "exit" else others).append(e)
        first = min(failing, key=self._began_failing)
        for e in others + sorted((e for e in exits if e is not first), key=lambda e: e[3]):
            self.events.put(e)  # handled in turn, after the culprit
        return first

    def _signal_all(self, sig: int) -> None:
        for run in self.running.values():
            if run.returncode is None:
                try:
                    os.killpg(run.proc.pid, sig)
                except (ProcessLookupError, PermissionError):
                    try:
                        run.proc.send_signal(sig)
                    except (ProcessLookupError, OSError):
                        pass

    def _alive(self) -> List[_Running]:
        return [r for r in self.running.values() if r.returncode is None]

    def _start_all(self) -> Optional[int]:
        """Starts this host's workers; on failure stops the started ones, returns an exit code."""
        # All workers are forked before any thread of this launcher starts (preexec_fn).
        for worker in self.mine:
            try:
                self.running[worker.rank] = self._spawn(worker)
            except OSError as e:
                cmd = self.opts.command[0]
                if isinstance(e, FileNotFoundError):
                    self.error(f"cannot start worker {worker.rank}: command not found: {cmd}")
                    code = EXIT_NOT_FOUND
                elif isinstance(e, PermissionError):
                    self.error(f"cannot start worker {worker.rank}: permission denied: {cmd}")
                    code = EXIT_CANNOT_EXECUTE
                else:
                    self.error(f"cannot start worker {worker.rank}: {e}")
                    code = EXIT_CANNOT_EXECUTE
                self._signal_all(signal.SIGKILL)
                for run in self.running.values():
                    run.proc.wait()
                    run.returncode = run.proc.returncode
                return code
        for run in self.running.values():
            self._watch(run)
        return None

    def _watch(self, run: _Running, key=None) -> None:
        """Threads that copy the worker's output and report its exit (and, once, the one that
        reads the workers' exit notes)."""
        if self._notes_reader is None:
            self._notes_reader = threading.Thread(target=self._read_exit_notes, daemon=True)
            self._notes_reader.start()
        for pipe, sink in ((run.proc.stdout, self.out), (run.proc.stderr, self.err)):
            t = threading.Thread(target=copy_lines, daemon=True,
                                 args=(run.label, pipe, sink, run.log, run.log_lock))
            t.start()
            run.readers.append(t)
        threading.Thread(target=self._wait, args=(run, key), daemon=True).start()

    def _drain(self, seconds: float = 2.0) -> None:
        """Waits for the workers' remaining output; a pipe held open by a process a worker
        left behind is abandoned after `seconds`."""
        self._drained = True
        until = time.monotonic() + seconds
        for run in self.running.values():
            for t in run.readers:
                t.join(timeout=max(0.0, until - time.monotonic()))
