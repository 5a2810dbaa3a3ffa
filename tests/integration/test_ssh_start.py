"""The ssh start (kungfu/_launch/ssh.py): one kungfu-run command runs a job on several "hosts",
network namespaces (test_multihost.py's), each of the first two running Debian's OpenSSH server
with a throwaway host key and a key made for the test; the third has none and starts the job.

Needs root, iproute2 and openssh-server (scripts/install.sh installs it with apt-get)."""
from __future__ import annotations

import json
import os
import queue
import re
import shutil
import signal
import subprocess
import textwrap
import threading
import time

import pytest

from test_multihost import PY, launcher_env, netns_hosts

SSHD = "/usr/sbin/sshd"
PORT = 2222  # the servers' port, given by -ssh-port (the usual 22 may be taken on the machine)
pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(not os.path.exists(SSHD) or shutil.which("ssh-keygen") is None
                       or os.geteuid() != 0,
                       reason="needs root and openssh-server (scripts/install.sh installs it)"),
]

WORKER = """
    import os, sys, time
    import numpy as np
    import kungfu as kf

    r, n = kf.rank(), kf.size()
    x = kf.allreduce(np.arange(3, dtype=np.float64) + 10 * r)
    print(f"rank={r} size={n} local={kf.local_rank()}/{kf.local_size()} "
          f"spec={os.environ['KUNGFU_SELF_SPEC']} sum={x.tolist()} "
          f"launcher={os.getppid()} pid={os.getpid()}", flush=True)
    print(f"rank {r} on stderr", file=sys.stderr, flush=True)
    if len(sys.argv) > 2 and r == int(sys.argv[2]):
        sys.exit(3)
    if len(sys.argv) > 1:
        time.sleep(float(sys.argv[1]))
"""


def _in_ns(ns, *argv, **kw):
    return ["ip", "netns", "exec", ns, *argv]


def _keygen(path):
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "kungfu-test", "-f",
                    str(path)], check=True, timeout=30)
    return path.with_suffix(".pub").read_text().split()[:2]


def _wait_for_port(ns, addr, deadline=15.0):
    probe = ("import socket, sys, time\n"
             f"end = time.monotonic() + {deadline}\n"
             "while True:\n"
             "    try:\n"
             f"        socket.create_connection(('{addr}', {PORT}), 1).close(); break\n"
             "    except OSError:\n"
             "        if time.monotonic() > end: sys.exit(1)\n"
             "        time.sleep(0.1)\n")
    r = subprocess.run(_in_ns(ns, PY, "-c", probe), timeout=deadline + 10, check=False)
    assert r.returncode == 0, f"sshd on {addr}:{PORT} did not come up"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Hosts a and b with sshd on PORT, c without; yields (hosts, env of a starting launcher,
    ssh flags, folder)."""
    d = tmp_path_factory.mktemp("ssh")
    host_key, user_key = _keygen(d / "host_key"), d / "id"
    _keygen(user_key)
    (d / "authorized_keys").write_text(user_key.with_suffix(".pub").read_text())
    os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # sshd's privilege separation folder
    (d / "sshd_config").write_text(textwrap.dedent(f"""\
        Port {PORT}
        HostKey {d / 'host_key'}
        AuthorizedKeysFile {d / 'authorized_keys'}
        PubkeyAuthentication yes
        PasswordAuthentication no
        KbdInteractiveAuthentication no
        PermitRootLogin prohibit-password
        UsePAM no
        StrictModes no
        PidFile none
        LogLevel ERROR
    """))
    with netns_hosts(3) as hosts:
        (d / "known_hosts").write_text("".join(
            f"[{addr}]:{PORT} {' '.join(host_key)}\n" for addr in hosts.ip[:2]))
        servers = [subprocess.Popen(_in_ns(ns, SSHD, "-D", "-e", "-f", str(d / "sshd_config")),
                                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                   for ns in hosts.ns[:2]]
        try:
            for addr in hosts.ip[:2]:
                _wait_for_port(hosts.ns[2], addr)
            env = {**launcher_env(),
                   "KUNGFU_SSH": f"ssh -F none -o UserKnownHostsFile={d / 'known_hosts'} "
                                 f"-o StrictHostKeyChecking=yes"}
            flags = ["-ssh-port", str(PORT), "-ssh-identity-file", str(user_key)]
            yield hosts, env, flags, d
        finally:
            for s in servers:
                s.terminate()
                s.wait(timeout=10)


def _worker(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(textwrap.dedent(WORKER))
    return script


def _start(cluster, ns, args, tmp_path, extra_env=None):
    hosts, env, flags, _ = cluster
    return subprocess.Popen(_in_ns(ns, PY, "-m", "kungfu.cmd", *flags, *args),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**env, **(extra_env or {})}, cwd=tmp_path)


def test_one_command_runs_a_job_on_two_hosts(cluster, tmp_path):
    """From host c, which runs no worker: ranks 0 on a and 1-2 on b, each host's launcher started
    over ssh. -show-ranks prints ranks 0 and 2 only; -logdir keeps every rank's output."""
    hosts, env, flags, _ = cluster
    a, b, _c = hosts.ip
    _worker(tmp_path)
    p = _start(cluster, hosts.ns[2], ["-np", "3", "-H", f"{a}:1,{b}:2", "-timeout", "90s",
                                      "-logdir", "logs", "-show-ranks", "0,2", "worker.py"],
               tmp_path)
    out, err = p.communicate(timeout=100)
    assert p.returncode == 0, f"exit {p.returncode}\nstdout:\n{out}\nstderr:\n{err}"
    total = [30.0, 33.0, 36.0]  # sum over r of arange(3) + 10 r
    where = {0: (f"{a}:10000", "0/1"), 1: (f"{b}:10000", "0/2"), 2: (f"{b}:10001", "1/2")}
    lines = {}
    for line in out.splitlines():
        m = re.fullmatch(r"\[(\d+)\] (.*)", line)
        assert m, f"a line without a rank: {line!r}"
        lines.setdefault(int(m.group(1)), []).append(m.group(2))
    assert sorted(lines) == [0, 2], out  # -show-ranks
    assert "[1] " not in err and "[0] rank 0 on stderr" in err and "[2] rank 2 on stderr" in err
    for rank in range(3):
        spec, local = where[rank]
        # Both of the worker's streams, in the order they came (two pipes: either first).
        log = (tmp_path / "logs" / f"rank-{rank}.log").read_text().splitlines()
        assert len(log) == 2 and f"rank {rank} on stderr" in log, log
        [said] = [line for line in log if line.startswith("rank=")]
        assert said.startswith(f"rank={rank} size=3 local={local} spec={spec} sum={total} ")
        if rank in lines:
            assert lines[rank] == [said]
    # The other hosts' launchers speak with their host's name; this one sums up.
    assert f"kungfu-run: {a}: starting 1 worker of 3 on {a} (rank 0)" in err, err
    assert f"kungfu-run: {b}: starting 2 workers of 3 on {b} (ranks 1-2)" in err, err
    assert "all 3 workers on 2 hosts finished successfully" in err, err


def _read_until(p, ranks, err, deadline=60.0):
    """The worker lines of `ranks` on p's stdout, read as they come: {rank: (launcher, pid)}.
    p's stderr is collected into the list `err` meanwhile, and after."""
    lines: "queue.Queue[str]" = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in p.stdout], daemon=True).start()
    threading.Thread(target=lambda: err.extend(p.stderr), daemon=True).start()
    found, end = {}, time.monotonic() + deadline
    while set(found) != set(ranks):
        try:
            line = lines.get(timeout=max(0.1, end - time.monotonic()))
        except queue.Empty:
            raise AssertionError(f"ranks {ranks} did not report: {found}\n{''.join(err)}")
        m = re.match(r"\[(\d+)\] rank=.* launcher=(\d+) pid=(\d+)", line)
        if m:
            found[int(m.group(1))] = (int(m.group(2)), int(m.group(3)))
    return found


def _gone(pids, deadline=20.0):
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        alive = [pid for pid in pids if os.path.exists(f"/proc/{pid}")
                 and "zombie" not in open(f"/proc/{pid}/status").read()]
        if not alive:
            return []
        time.sleep(0.2)
    return alive


def _children(pid, name):
    """The processes called `name` whose parent is `pid`."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{entry}/comm") as f:
                comm = f.read().strip()
        except (OSError, IndexError):
            continue
        if entry.isdigit() and int(fields[1]) == pid and comm == name:
            found.append(int(entry))
    return found


@pytest.mark.parametrize("how", ["remote launcher killed", "remote worker fails", "SIGINT",
                                 "SIGTERM", "starter killed"])
def test_the_job_ends_on_every_host(cluster, tmp_path, how):
    """Host a runs rank 0 and starts b's launcher (rank 1). A remote launcher killed or a remote
    worker failing fails the job naming the host; SIGINT or SIGTERM to the starting launcher, or
    its death by SIGKILL, stops both hosts' workers."""
    hosts, _, _, _ = cluster
    a, b, _c = hosts.ip
    _worker(tmp_path)
    fail = ["1"] if how == "remote worker fails" else []
    p = _start(cluster, hosts.ns[0], ["-np", "2", "-H", f"{a}:1,{b}:1", "worker.py", "300",
                                      *fail], tmp_path)
    lines: list = []
    try:
        found = _read_until(p, [0, 1], lines)
        # The workers, b's launcher, and (for the kill) the ssh that started it.
        watched = [found[0][1], found[1][1], found[1][0]]
        if how == "remote launcher killed":
            os.kill(found[1][0], signal.SIGKILL)
        elif how == "starter killed":  # the pipes close: every host stops its workers
            watched += _children(p.pid, "ssh")
            assert len(watched) == 4, watched
            p.kill()
        elif how in ("SIGINT", "SIGTERM"):
            p.send_signal(signal.SIGINT if how == "SIGINT" else signal.SIGTERM)
        p.wait(timeout=40)
    finally:
        if p.poll() is None:
            p.kill()
    time.sleep(0.5)  # the last lines
    err = "".join(lines)
    assert _gone(watched) == [], f"left running: {watched}\n{err}"
    if how == "starter killed":
        assert p.returncode == -signal.SIGKILL
    elif how == "remote launcher killed":
        assert p.returncode == 255, err
        assert f"kungfu-run: {b}: cannot be reached over ssh, or its launcher died" in err, err
    elif how == "remote worker fails":  # the worker's exit code, as a launcher per host gives
        assert p.returncode == 3, err
        assert f"kungfu-run: {b}: worker 1 ({b}:10000) exited with code 3" in err, err
        assert f"kungfu-run: {b}: its launcher exited with code 3; stopping the job" in err, err
    else:
        assert p.returncode != 0, err
        assert f"received {how}" in err, err
        assert f"kungfu-run: {b}: received SIGTERM" in err, err


def test_a_host_that_cannot_be_reached_fails_the_job_naming_it(cluster, tmp_path):
    """c runs no sshd (connection refused); .250 is no host at all (no answer: the start's
    deadline). Either way the job fails at once with code 255, naming the host, and rank 0,
    which waits for its peer, is stopped."""
    hosts, _, _, _ = cluster
    a, _b, c = hosts.ip
    _worker(tmp_path)
    nobody = a.rsplit(".", 1)[0] + ".250"
    for host, why in ((c, "Connection refused"), (nobody, "")):
        start = time.monotonic()
        p = _start(cluster, hosts.ns[0], ["-np", "2", "-H", f"{a}:1,{host}:1", "worker.py"],
                   tmp_path, {"KUNGFU_SSH_START_TIMEOUT": "3s"})
        out, err = p.communicate(timeout=60)
        assert p.returncode == 255, f"exit {p.returncode}\n{err}"
        assert re.search(rf"kungfu-run: {re.escape(host)}: (cannot be reached over ssh|its "
                         rf"launcher did not start within 3s)", err), err
        assert why in err, err
        # Stopped by the launcher, long before rank 0's own wait for its peer would end.
        assert time.monotonic() - start < 40, err


ELASTIC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "elastic_numpy.py")


def _records(folder):
    """{worker file name: its JSON lines} of elastic_numpy.py's records."""
    return {f.stem: [json.loads(line) for line in f.read_text().splitlines()]
            for f in folder.glob("*.jsonl")}


def _start_elastic(cluster, where, np, tmp_path, *args):
    """kungfu-run -w from host `where` of a:2,b:1 (the store there) running elastic_numpy.py
    with `args`; returns the process and the records' folder."""
    hosts = cluster[0]
    a, b, _c = hosts.ip
    out = tmp_path / "records"
    out.mkdir()
    return _start(cluster, hosts.ns[where], [
        "-w", "-np", str(np), "-H", f"{a}:2,{b}:1", "-builtin-config-port", "auto", "-timeout",
        "90s", PY, ELASTIC, "--out", str(out), *args], tmp_path), out


def test_an_elastic_job_from_one_command_grows_onto_a_host_without_workers(cluster, tmp_path):
    """-w from host c, which runs no worker but hosts the config store: a's launcher starts the
    2 workers, b's starts with none and gets the third when rank 0 asks for 3."""
    hosts, _, _, _ = cluster
    a, b, c = hosts.ip
    p, out = _start_elastic(cluster, 2, 2, tmp_path, "--schedule", "3", "--max-steps", "60")
    stdout, err = p.communicate(timeout=100)
    assert p.returncode == 0, f"exit {p.returncode}\nstdout:\n{stdout}\nstderr:\n{err}"
    # The store listens on c's address toward the others, and they follow it.
    assert re.search(rf"config store at http://{re.escape(c)}:\d+", err), err
    assert f"starting the launchers of {a}, {b} over ssh" in err, err
    records = _records(out)
    assert sorted(records) == [f"{a}_10000", f"{a}_10001", f"{b}_10000"], sorted(records)
    joiner = records[f"{b}_10000"]
    assert joiner[-1]["done"] and joiner[-1]["size"] == 3, joiner[-1]
    assert {r["size"] for r in joiner if "step" in r} == {3}
    first = [r for r in records[f"{a}_10000"] if "step" in r]
    assert first[0]["size"] == 2 and first[-1]["size"] == 3
    # Every worker ended with the same weights.
    assert len({rs[-2]["digest"] for rs in records.values()}) == 1
    # b's launcher's lines come back with its name: it started the joiner, rank 2.
    assert f"kungfu-run: {b}: version 1: started worker 2 ({b}:10000)" in err, err


def test_an_elastic_job_goes_on_when_a_hosts_launcher_is_lost(cluster, tmp_path):
    """-w from host a (ranks 0-1, the store), b's launcher (rank 2) over ssh: b's launcher killed
    (a machine gone) takes its worker with it; a's workers recover without it and finish, the
    job exits 0, and b gets no replacement."""
    hosts, _, _, _ = cluster
    a, b, _c = hosts.ip
    p, out = _start_elastic(cluster, 0, 3, tmp_path, "--max-steps", "40", "--step-sleep", "0.1")
    lines: list = []
    threading.Thread(target=lambda: lines.extend(p.stderr), daemon=True).start()
    threading.Thread(target=lambda: lines.extend(p.stdout), daemon=True).start()
    try:
        end, victim = time.monotonic() + 60, out / f"{b}_10000.jsonl"
        while not (victim.exists() and victim.read_text().count("\n") >= 3):
            assert time.monotonic() < end and p.poll() is None, "".join(lines)
            time.sleep(0.1)
        worker = json.loads(victim.read_text().splitlines()[0])["pid"]
        with open(f"/proc/{worker}/stat") as f:
            launcher = int(f.read().rsplit(")", 1)[1].split()[1])
        os.kill(launcher, signal.SIGKILL)
        p.wait(timeout=80)
    finally:
        if p.poll() is None:
            p.kill()
    time.sleep(0.5)
    err = "".join(lines)
    assert p.returncode == 0, f"exit {p.returncode}\n{err}"
    assert f"kungfu-run: {b}: cannot be reached over ssh, or its launcher died" in err, err
    assert f"the job goes on without {b}" in err, err
    assert _gone([worker]) == []
    # b cools down for good: rank 0's replacement finds no free slot and asks for none (without
    # it: "version 2: 2 -> 3 workers; waiting for 1 joiner", a joiner b never starts).
    assert "2 -> 3 workers" not in err and "abandoned" not in err, err
    records = _records(out)
    assert sorted(records) == [f"{a}_10000", f"{a}_10001", f"{b}_10000"]  # no replacement
    for name in (f"{a}_10000", f"{a}_10001"):
        last = records[name][-1]
        assert last["done"] and last["size"] == 2, last
        [recovery] = last["recoveries"]
        assert recovery["lost"] == [f"{b}:10000"] and recovery["size"] == 2, recovery
    assert records[f"{a}_10000"][-2]["digest"] == records[f"{a}_10001"][-2]["digest"]


def test_sigterm_to_the_starter_of_an_elastic_job_stops_every_host(cluster, tmp_path):
    """SIGTERM to the starting launcher (host a, with the store) stops a's workers and, through
    the ssh pipe, b's launcher and worker; no worker is left running."""
    hosts, _, _, _ = cluster
    a, b, _c = hosts.ip
    p, out = _start_elastic(cluster, 0, 3, tmp_path, "--max-steps", "1000", "--step-sleep",
                            "0.1")
    lines: list = []
    threading.Thread(target=lambda: lines.extend(p.stderr), daemon=True).start()
    threading.Thread(target=lambda: lines.extend(p.stdout), daemon=True).start()
    try:
        files = [out / f"{a}_10000.jsonl", out / f"{a}_10001.jsonl", out / f"{b}_10000.jsonl"]
        end = time.monotonic() + 60
        while not all(f.exists() and f.read_text().count("\n") >= 2 for f in files):
            assert time.monotonic() < end and p.poll() is None, "".join(lines)
            time.sleep(0.1)
        workers = [json.loads(f.read_text().splitlines()[0])["pid"] for f in files]
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=40)
    finally:
        if p.poll() is None:
            p.kill()
    err = "".join(lines)
    assert _gone(workers) == [], err
    assert p.returncode == 128 + signal.SIGTERM, err
    assert f"kungfu-run: {b}: received SIGTERM; forwarding it to 1 worker" in err, err
