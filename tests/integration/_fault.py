"""The fault the elastic test workers (elastic_train.py, elastic_numpy.py) inflict on
themselves: recorded first, so that a test knows when it happened."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time


def fault(out, sig: int, pause_pid: int = 0, pause_seconds: float = 3.0,
          wake_after: float = 0.0) -> None:
    """Writes {"fault": sig, "at": time.time()} to the records `out`, then signals this process
    with `sig`. `pause_pid`: a process stopped (SIGSTOP) for `pause_seconds` first (the config
    store, to test an outage); `wake_after`: a SIGSTOP'ed worker is continued that much later."""
    out.write(json.dumps({"fault": int(sig), "at": time.time()}) + "\n")
    out.flush()
    if pause_pid:
        os.kill(pause_pid, signal.SIGSTOP)
        subprocess.Popen(["sh", "-c", f"sleep {pause_seconds}; kill -CONT {pause_pid}"])
    if sig == signal.SIGSTOP and wake_after:
        subprocess.Popen(["sh", "-c", f"sleep {wake_after}; kill -CONT {os.getpid()}"])
    os.kill(os.getpid(), sig)
