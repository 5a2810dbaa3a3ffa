"""The worker's end of kungfu-run's watchdog pipe (KUNGFU_WATCHDOG_FD).

kungfu-run keeps the only write end of a pipe whose read end every worker inherits, through any
wrapper (bash -c "python train.py" included). When the launcher dies, however it dies, the pipe
reaches end of file; the worker then says so on stderr and kills its own process group (the
worker, its wrappers and their children), so nothing keeps running, or holding its ports, after
the job is gone. PR_SET_PDEATHSIG covers only the launcher's direct children.
"""
from __future__ import annotations

import os
import signal
import sys
import threading

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
