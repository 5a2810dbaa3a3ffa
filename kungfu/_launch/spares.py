"""Warm spares: `kungfu-run -w -spares K` (the worker's side is kungfu/_spare.py).

A spare is a worker process started before the cluster needs it: the job's environment without
an identity, and one end of a Unix socket pair (KUNGFU_SPARE_FD) on which it waits for one. It
imports and runs the script up to the first call that needs its place (kf.Hook rehearses a
joiner's training step before that), so a grow or a replacement that takes it skips the start-up.

1. `fill(free)`: the launcher keeps K spares alive, at most `free` (this host's slots that the
   latest version does not use: a spare that could never be taken costs memory for nothing).
2. `take(worker, env, listener)`: a new version lists a peer of this host that no worker runs:
   the oldest live spare becomes that worker. The launcher sends its identity (`env`, one JSON
   line) with the listening socket it holds for that address (SCM_RIGHTS: the spare could not
   have inherited it, not knowing its place when it started) and closes its end; from then on
   it is an ordinary joiner under the launcher (its exit events carry the key it was started
   with). `fill` then starts another, if slots remain.
3. `stop()`: when the launcher ends, every spare's socket is closed (a spare waiting for its place
   exits 0) and any spare still running is terminated: SIGTERM, SIGKILL GRACE_SECONDS later.

A spare that exits before it was taken is reported; after MAX_FAILURES of those no more spares
are started (a script that fails at start-up would otherwise be started again forever).
"""
from __future__ import annotations

import itertools
import json
import os
import signal
import socket
import subprocess
import time
from typing import Callable, Dict, Optional, Tuple

from kungfu._hosts import Worker
from kungfu._launch.flags import GRACE_SECONDS
from kungfu._launch.processes import _describe_exit, _Running

MAX_FAILURES = 2


class Spares:
    """The warm spares of one launcher. `launcher` is the ElasticLauncher: its _spawn, _watch,
    ids (the keys of exit events), info and error."""

    def __init__(self, launcher, count: int, host: str, env: Callable[[], Dict[str, str]]):
        self.launcher = launcher
        self.count = count
        self.host = host  # the host the spares run on (their placeholder worker's)
        self.env = env  # the job's variables a spare starts with (not its identity)
        self.waiting: Dict[int, Tuple[_Running, socket.socket]] = {}  # key -> (spare, our end)
        self.numbers = itertools.count()
        self.failures = 0
        self.ended: Dict[int, _Running] = {}  # spares stopped by stop() (their exits expected)

    def fill(self, free: int) -> None:
        """Starts spares until min(count, free) wait."""
        while (len(self.waiting) < min(self.count, free) and self.failures < MAX_FAILURES
               and not self.launcher.stopping):
            number = next(self.numbers)
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                run = self.launcher._spawn(Worker(-1, self.host, 0, 0), extra_env=self.env(),
                                           spare=(number, theirs.fileno()))
            except OSError as e:
                ours.close()
                self.failures = MAX_FAILURES
                self.launcher.error(f"cannot start spare {number}: {e}; no spares from now on")
                return
            finally:
                theirs.close()
            key = next(self.launcher.ids)
            self.waiting[key] = (run, ours)
            self.launcher._watch(run, key)
            self.launcher.info(f"spare {number} started (pid {run.proc.pid})")

    def take(self, worker: Worker, env: Dict[str, str],
             listener: Optional[int]) -> Optional[Tuple[int, _Running, int]]:
        """The oldest live spare, made `worker` with identity `env` and the listening socket
        `listener` of its address (None: it binds the address itself): (key, run, its number),
        or None when no spare is alive."""
        line = (json.dumps(env) + "\n").encode()
        for key in sorted(self.waiting):
            run, ours = self.waiting.pop(key)
            # Nothing is sent once the whole line is: a spare that read it may have closed its
            # end already, and even an empty send would then fail.
            try:
                sent = socket.send_fds(ours, [line], [] if listener is None else [listener])
                if sent < len(line):
                    ours.sendall(line[sent:])
            except OSError:  # it exited (its exit event is on its way); a part of a line is
                self.ended[key] = run  # end of file to it (kungfu/_spare.py)
                continue
            finally:
                ours.close()
            number, run.spare, run.worker = run.spare, None, worker
            return key, run, number
        return None

    def exited(self, key: int, rc: int) -> bool:
        """Whether exit event `key` was a spare's (not taken); an unexpected one is reported."""
        if key in self.ended:
            self.ended.pop(key).returncode = rc
            return True
        if key not in self.waiting:
            return False
        run, ours = self.waiting.pop(key)
        ours.close()
        run.returncode = rc
        self.failures += 1
        more = "" if self.failures < MAX_FAILURES else "; no spares from now on"
        self.launcher.error(f"{run.label()} {_describe_exit(rc)} before it was needed "
                            f"(after {time.monotonic() - run.started:.1f}s){more}")
        return True

    def stop(self) -> None:
        """Ends every spare not taken (see the module doc, step 3)."""
        for key, (run, ours) in list(self.waiting.items()):
            ours.close()
            self.ended[key] = run
        self.waiting.clear()
        alive = [r for r in self.ended.values() if r.returncode is None]
        for run in alive:
            try:
                os.killpg(run.proc.pid, signal.SIGTERM)
            except (ProcessLookupError, PermissionError):
                pass
        until = time.monotonic() + GRACE_SECONDS
        for run in alive:
            try:
                run.proc.wait(timeout=max(0.0, until - time.monotonic()))
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(run.proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
