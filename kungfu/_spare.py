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
launcher's exit, however it happens, closes its end. A spare is always a joiner: `pending()`
lets kf.Hook treat it as one (and rehearse its step alone) before it has a place.
"""
from __future__ import annotations

import json
import os
import socket
import sys
import threading
from typing import List, Tuple

from kungfu import _env

_lock = threading.Lock()
_assigned = False


def pending() -> bool:
    """Whether this process is a warm spare that has no place in the cluster yet."""
    return not _assigned and _env.SPARE_FD.get() is not None


def _read_line(fd: int) -> Tuple[bytes, List[int]]:
    """The line on socket `fd` and the descriptors that came with it; b"" at end of file."""
    data, fds = b"", []
    with socket.socket(fileno=os.dup(fd)) as sock:
        while not data.endswith(b"\n"):
            chunk, got, _, _ = socket.recv_fds(sock, 65536, 1)
            fds += got
            if not chunk:
                for f in fds:
                    os.close(f)
                return b"", []  # end of file: not needed
            data += chunk
    return data, fds


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
            line, fds = _read_line(fd)
        except OSError:
            line, fds = b"", []
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
        if fds:  # the listening socket of its address (kungfu/_peer.py, listen_fd)
            os.environ[_env.LISTEN_FD.name] = str(fds[0])
        try:
            os.close(fd)
        except OSError:
            pass
        _assigned = True
