"""The worker's ends of kungfu-run's pipes: the watchdog (KUNGFU_WATCHDOG_FD) and the exit note
(KUNGFU_EXIT_NOTE_FD).

kungfu-run keeps the only write end of a pipe whose read end every worker inherits, through any
wrapper (bash -c "python train.py" included). When the launcher dies, however it dies, the pipe
reaches end of file; the worker then says so on stderr and kills its own process group (the
worker, its wrappers and their children), so nothing keeps running, or holding its ports, after
the job is gone. PR_SET_PDEATHSIG covers only the launcher's direct children.

The exit note: when a worker begins to exit (its peer's exit handler, before the peer says
goodbye), it writes one line to a pipe that kungfu-run reads: its process group (the launcher's
child) and the time (CLOCK_MONOTONIC, shared by the processes of a host). A worker that exits
with an error takes its peers down a moment later, and theirs may be the first exits the
launcher sees; the note tells it which worker began first.
"""
from __future__ import annotations

import os
import signal
import stat
import sys
import threading
import time

from kungfu import _env

_started = False


def _watch(fd: int) -> None:
    try:
        while os.read(fd, 1):
            pass  # nobody writes; a byte would be harmless
    except OSError:
        return  # not a pipe we can read: nothing to watch
    try:  # stderr was most likely a pipe to the launcher: writing may fail, ending may not
        sys.stderr.write("kungfu: kungfu-run is gone (its watchdog pipe closed); ending this "
                         "worker\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass
    try:
        os.killpg(os.getpgrp(), signal.SIGKILL)
    finally:
        os._exit(137)


def start_from_env() -> None:
    """Starts the watcher once, if this process was started by kungfu-run."""
    global _started
    fd = _env.WATCHDOG_FD.get()
    if fd is None or _started:
        return
    try:
        os.fstat(fd)
    except OSError:
        return  # not inherited (a process the worker started with close_fds): nothing to watch
    _started = True
    threading.Thread(target=_watch, args=(fd,), name="kungfu-watchdog", daemon=True).start()


_noted = False


def note_exit() -> None:
    """Tells kungfu-run that this worker begins to exit, once (nothing outside kungfu-run)."""
    global _noted
    where = _env.EXIT_NOTE_FD.get()
    if where is None or _noted:
        return
    _noted = True
    try:
        fd, inode = (int(x) for x in where.split(":"))
        st = os.fstat(fd)
        # A process that got the variable but not the pipe may have that number open on
        # something else: write only into the launcher's pipe.
        if not stat.S_ISFIFO(st.st_mode) or st.st_ino != inode:
            return
        # One write of less than PIPE_BUF bytes: never interleaved with another worker's.
        os.write(fd, f"{os.getpgrp()} {time.monotonic():.6f}\n".encode())
    except (OSError, ValueError):
        pass  # not inherited, malformed, or the launcher is gone
