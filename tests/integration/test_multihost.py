"""Network namespaces as "hosts", each with a veth link to a bridge; one kungfu-run in each.

Needs root and iproute2 (`ip netns`). Where a namespace cannot be created the tests fail with
the reason: they are part of what CI runs (as root). Namespace names include the pid, so runs
in parallel do not collide; the fixture always deletes the namespaces (and with them the links).
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TOKEN = secrets.token_hex(32)  # the job token of every launcher in a test
PY = sys.executable
pytestmark = pytest.mark.timeout(120)


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20, check=False)
    if check and r.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` failed ({r.returncode}): {r.stderr.strip()}")
    return r


class Hosts:
    """`count` network namespaces ("hosts"), each joined by one veth link to a bridge in a switch
    namespace of its own, so every host reaches every other through its own link."""

    def __init__(self, tag: str, count: int):
        self.ns = [f"kft{tag}{chr(ord('a') + i)}" for i in range(count)]
        self.switch = f"kft{tag}s"
        self.nic = [f"kfv{i}" for i in range(count)]   # the host's end of its link
        self.port = [f"kfp{i}" for i in range(count)]  # the switch's end
        subnet = 1 + os.getpid() % 250
        self.ip = [f"10.199.{subnet}.{i + 1}" for i in range(count)]

    def build(self, created: list) -> None:
        for ns in self.ns + [self.switch]:
            r = ip("netns", "add", ns, check=False)
            if r.returncode != 0:
                pytest.fail(
                    f"cannot create network namespace {ns} (`ip netns add` needs root): "
                    f"{r.stderr.strip()}"
                )
            created.append(ns)
        sw = self.switch
        ip("-n", sw, "link", "add", "kfbr", "type", "bridge")
        ip("-n", sw, "link", "set", "kfbr", "up")
        for ns, nic, port, addr in zip(self.ns, self.nic, self.port, self.ip):
            # Each veth pair is created inside the switch namespace with its other end moved
            # straight into the host's: nothing appears in the caller's namespace.
            ip("-n", sw, "link", "add", port, "type", "veth", "peer", "name", nic, "netns", ns)
            ip("-n", sw, "link", "set", port, "master", "kfbr", "up")
            ip("-n", ns, "addr", "add", f"{addr}/24", "dev", nic)
            ip("-n", ns, "link", "set", "lo", "up")
            ip("-n", ns, "link", "set", nic, "up")


@contextlib.contextmanager
def netns_hosts(count: int):
    """Builds Hosts(count); always deletes its namespaces (and with them the links)."""
    if shutil.which("ip") is None:
        pytest.fail("the multi-host test needs iproute2's `ip` command (run as root in CI)")
    hosts = Hosts(str(os.getpid()), count)
    created: list = []
    try:
        hosts.build(created)
        yield hosts
    finally:
        for ns in created:
            ip("netns", "del", ns, check=False)
        left = ip("netns", "list", check=False).stdout
        assert not any(ns in left for ns in created), f"namespaces left behind: {left}"


@pytest.fixture
def two_hosts():
    with netns_hosts(2) as hosts:
        yield hosts


def launcher_env(pythonpath: str = "") -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUNGFU_")}
    env["KUNGFU_JOB_TOKEN"] = TOKEN  # one secret for the launchers of all hosts
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO)] + [p for p in [pythonpath, env.get("PYTHONPATH")] if p])
    return env


def run_on_both(hosts: Hosts, args_per_host, timeout: float = 60, pythonpath: str = "",
                env: dict | None = None):
    """Runs one launcher per host (args_per_host[i] in hosts.ns[i]), with `env` added to its
    environment; returns (rc, out, err)."""
    procs = [
        subprocess.Popen(["ip", "netns", "exec", ns, PY, "-m", "kungfu.cmd", *args],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env={**launcher_env(pythonpath), **(env or {})})
        for ns, args in zip(hosts.ns, args_per_host)
    ]
    try:
        outs = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [(p.returncode, out, err) for p, (out, err) in zip(procs, outs)]


WORKER = """
    import os, sys
    import numpy as np
    import kungfu as kf

    r, n = kf.rank(), kf.size()
    x = kf.allreduce(np.arange(4, dtype=np.float32) * (r + 1))
    ranks = kf.allgather(np.array([r], dtype=np.int32))
    root = kf.broadcast(np.array([float(r) + 0.25]), root=n - 1)
    print(f"rank={r} size={n} local={kf.local_rank()}/{kf.local_size()} "
          f"spec={os.environ['KUNGFU_SELF_SPEC']} sum={x.tolist()} ranks={ranks.tolist()} "
          f"bcast={root.tolist()}")
"""


def prefixed(text: str) -> dict:
    out: dict = {}
    for line in text.splitlines():
        m = re.fullmatch(r"\[(\d+)\] (.*)", line)
        assert m, f"line without rank prefix: {line!r}"
        out.setdefault(int(m.group(1)), []).append(m.group(2))
    return out


@pytest.mark.parametrize("strategy", ["AUTO", "BINARY_TREE_STAR", "RING"])
def test_allreduce_across_two_namespaces(two_hosts, tmp_path, strategy):
    script = tmp_path / "worker.py"
    script.write_text(textwrap.dedent(WORKER))
    a, b = two_hosts.ip
    common = ["-np", "4", "-H", f"{a}:2,{b}:2", "-strategy", strategy, "-timeout", "60s",
              "-port-range", "10000-10001"]
    results = run_on_both(two_hosts, [
        [*common, "-self", a, PY, str(script)],              # host a: by address
        [*common, "-nic", two_hosts.nic[1], PY, str(script)],  # host b: by interface
    ])
    for rc, out, err in results:
        assert rc == 0, f"exit {rc}\nstdout:\n{out}\nstderr:\n{err}"
    on_a, on_b = prefixed(results[0][1]), prefixed(results[1][1])
    assert sorted(on_a) == [0, 1] and sorted(on_b) == [2, 3]
    specs = [f"{a}:10000", f"{a}:10001", f"{b}:10000", f"{b}:10001"]
    for rank in range(4):
        lines = (on_a if rank < 2 else on_b)[rank]
        assert lines == [
            f"rank={rank} size=4 local={rank % 2}/2 spec={specs[rank]} "
            f"sum=[0.0, 10.0, 20.0, 30.0] ranks=[0, 1, 2, 3] bcast=[3.25]"
        ]
    assert f"starting 2 workers of 4 on {a} (ranks 0-1), strategy {strategy}" in results[0][2]
    assert f"starting 2 workers of 4 on {b} (ranks 2-3), strategy {strategy}" in results[1][2]


def test_failure_on_one_host_fails_the_job_on_both(two_hosts, tmp_path):
    """A worker exiting 3 on host b: launcher b exits 3; host a's workers see a dead peer."""
    script = tmp_path / "worker.py"
    script.write_text(textwrap.dedent("""
        import sys
        import numpy as np
        import kungfu as kf

        kf.allreduce(np.ones(1))  # everyone connected
        if kf.rank() == 3:
            sys.exit(3)
        kf.allreduce(np.ones(1), timeout=30)
        print("unexpected: second allreduce succeeded")
    """))
    a, b = two_hosts.ip
    common = ["-np", "4", "-H", f"{a}:2,{b}:2", "-q", "-timeout", "60s"]
    results = run_on_both(two_hosts, [
        [*common, "-self", a, PY, str(script)],
        [*common, "-self", b, PY, str(script)],
    ])
    (rc_a, out_a, err_a), (rc_b, out_b, err_b) = results
    assert rc_b == 3, err_b
    assert rc_a == 1, f"exit {rc_a}\n{err_a}"  # a Python worker's uncaught exception
    assert "PeerFailedError" in err_a
    assert "unexpected" not in out_a + out_b
    assert "kungfu-run: worker 3 (" in err_b and "exited with code 3" in err_b


@pytest.mark.timeout(300)
@pytest.mark.parametrize("workers", [(1, 3), (2, 2), (1, 1, 2)], ids=["1+3", "2+2", "1+1+2"])
def test_every_strategy_across_uneven_hosts(tmp_path, workers):
    """Every strategy, every dtype, sizes 1, 7 and 2**20 + 3, across two and three namespaces
    with uneven workers per host: right on every peer, and bit-identical across peers."""
    with netns_hosts(len(workers)) as hosts:
        spec = ",".join(f"{addr}:{n}" for addr, n in zip(hosts.ip, workers))
        np_ = sum(workers)
        args = [["-np", str(np_), "-H", spec, "-self", addr, "-timeout", "240s", "-q",
                 PY, str(REPO / "tests" / "integration" / "_w_multihost.py")]
                for addr in hosts.ip]
        env_path = str(REPO / "tests" / "integration")
        results = run_on_both(hosts, args, timeout=270, pythonpath=env_path)
    reports = {}
    for rc, out, err in results:
        assert rc == 0, f"exit {rc}\nstdout:\n{out[-3000:]}\nstderr:\n{err[-3000:]}"
        for rank, lines in prefixed(out).items():
            reports[rank] = json.loads(lines[-1])
    assert sorted(reports) == list(range(np_))
    problems = [f for rep in reports.values() for group in rep["failures"].values() for f in group]
    assert not problems, "\n".join(problems[:40])
    for rank, rep in reports.items():
        assert rep["size"] == np_ and rep["count"] == rep["expected"], (rank, rep["count"])
    digests = {rep["digest"] for rep in reports.values()}
    assert len(digests) == 1, f"results differ between peers: {digests}"
