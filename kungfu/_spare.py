"""A warm spare (`kungfu-run -w -spares K`): a worker process started before the cluster needs it.

It imports and runs the script up to the first call that needs its place in the cluster, and
waits there for the launcher to give it one (kungfu/_launch/spares.py is the other side):

1. The launcher starts it with KUNGFU_SPARE_FD, the read end of a pipe only the launcher writes.
   Its environment has the job's variables but no identity (no KUNGFU_SELF_SPEC, no RANK).
2. Before anything reads the identity (kungfu/_peer.py: kf.rank(), kf.size(), the first
   collective), `wait()` reads one line from the pipe: a JSON object of environment variables,
   those of a joiner (its address, the peers and cluster version it joins,
   KUNGFU_ELASTIC_JOINING=1, the standard rank variables). They go into os.environ, and the
   process goes on exactly as a joiner started with them.
3. End of file instead: the launcher stopped its spares (the job ended) or died. The spare was
   not needed; it exits 0 at once, without running the rest of the script.

The wait has no deadline of its own: a spare lives as long as its launcher wants it, and the
launcher's exit, however it happens, closes the pipe. A spare is always a joiner: `pending()`
lets kf.Hook treat it as one (and rehearse its step alone) before it has a place.
"""
from __future__ import annotations

import json
import os
import sys
import threading

from kungfu import _env

_lock = threading.Lock()
_assigned = False


def pending() -> bool:
    """Whether this process is a warm spare that has no place in the cluster yet."""
    return not _assigned and _env.SPARE_FD.get() is not None


def _read_line(fd: int) -> bytes:
    data = b""
    while not data.endswith(b"\n"):
        chunk = os.read(fd, 65536)
        if not chunk:
            return b""  # end of file: not needed
        data += chunk
    return data


def wait() -> None:
    """Returns at once unless this is a spare without a place; then blocks until the launcher
    gives it one (its identity is in os.environ afterwards) or exits 0 if it never will."""
    global _assigned
    if _assigned or _env.SPARE_FD.get() is None:
        return
    with _lock:
        if _assigned:
            return
        fd = _env.SPARE_FD.get()
        try:
            line = _read_line(fd)
        except OSError:
            line = b""
        if not line:
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except (OSError, ValueError):
                    pass
            os._exit(0)
        env = json.loads(line.decode())
        _env.set_worker_env(os.environ, env)
        os.environ.pop(_env.SPARE_FD.name, None)
        try:
            os.close(fd)
        except OSError:
            pass
        _assigned = True
