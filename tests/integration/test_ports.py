"""Jobs that share a host: kungfu-run binds its workers' ports itself and hands the listening
sockets to them (KUNGFU_LISTEN_FD), so a port it found free cannot be taken before its worker
listens, and jobs started at once with the default ports all start.
"""
from __future__ import annotations

import os
import re
import socket
import subprocess
import time

import pytest

# (conftest puts this folder on sys.path)
from test_launcher import PY, env_with_repo, launcher_cmd, run_launcher  # noqa: E402

pytestmark = pytest.mark.timeout(180)

# Each worker checks the allreduce's value and that it listens on the socket its launcher bound.
ALLREDUCE = """
import os, sys
import numpy as np
import kungfu as kf
from kungfu import _peer

r, n = kf.rank(), kf.size()
total = kf.allreduce(np.array([r + 1], dtype=np.int64))
assert total.tolist() == [n * (n + 1) // 2], total
print(f"ok rank={r} spec={os.environ['KUNGFU_SELF_SPEC']} held={_peer.inherited_listener()}")
"""

JOBS = 20


def test_twenty_jobs_started_at_once_with_default_ports_all_finish(tmp_path):
    path = tmp_path / "allreduce.py"
    path.write_text(ALLREDUCE)
    env = env_with_repo(KUNGFU_CONNECT_TIMEOUT="60s")
    procs = [subprocess.Popen(launcher_cmd("-np", "2", PY, str(path)), env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(JOBS)]
    outs = []
    deadline = time.monotonic() + 150
    for p in procs:
        try:
            out, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
        outs.append((p.returncode, out, err))
    failed = [(rc, err[-2000:]) for rc, _, err in outs if rc != 0]
    assert not failed, f"{len(failed)} of {JOBS} jobs failed; first: {failed[0]}"
    for _, out, _ in outs:
        lines = re.findall(r"^\[\d\] ok rank=(\d) spec=\S+ held=(\S+)$", out, re.M)
        assert sorted(r for r, _ in lines) == ["0", "1"], out
        # Every worker listened on the socket its launcher had bound for it.
        assert all(held == "True" for _, held in lines), out


def test_a_port_taken_after_the_launcher_bound_it_cannot_be_lost(tmp_path):
    """A worker that starts late still gets its port: the launcher holds it from the start,
    and another process's bind fails (with SO_REUSEADDR too) while the job runs."""
    path = tmp_path / "slow.py"
    path.write_text("import sys, time\n"
                    "time.sleep(float(sys.argv[1]))\n" + ALLREDUCE)
    proc = subprocess.Popen(launcher_cmd("-np", "2", "-v", PY, str(path), "3"),
                            env=env_with_repo(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        ports = _ports_of_first_job(proc)
        for port in ports:  # while the workers sleep, before they import kungfu
            for reuse in (0, 1):
                with socket.socket() as s:
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, reuse)
                    with pytest.raises(OSError):
                        s.bind(("127.0.0.1", port))
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert out.count(" ok rank=") == 2, out


def _ports_of_first_job(proc) -> list:
    """The ports of a launcher run with -v, read from its debug line for each worker."""
    ports = []
    while len(ports) < 2:
        line = proc.stderr.readline()
        assert line, "the launcher ended before it started its workers"
        m = re.search(r"KUNGFU_SELF_SPEC=127\.0\.0\.1:(\d+)", line)
        if m:
            ports.append(int(m.group(1)))
    return ports


def test_a_given_port_range_that_is_taken_fails_before_any_worker_starts(tmp_path):
    """A -port-range the user gave is not moved: a port of it in use is a usage error that names
    it, before any worker runs."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        marker = tmp_path / "ran"
        r = run_launcher("-np", "2", "-port-range", f"{port}-{port + 1}", PY, "-c",
                         f"open({str(marker)!r}, 'w')")
    assert r.returncode == 2, r.stderr
    assert f"127.0.0.1:{port}" in r.stderr and "-port-range" in r.stderr, r.stderr
    assert not os.path.exists(marker)
