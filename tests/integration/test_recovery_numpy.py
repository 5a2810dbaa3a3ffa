"""Recovery under kungfu-run -w with numpy workers (elastic_numpy.py, a second to start): the
start, the commits and the recovery are kungfu._loop.Loop's, which kf.Hook and ElasticTrainer
share (test_recovery.py runs TensorFlow workers in model.fit).

A worker lost while the job starts is the most common fault there is (a node lost as the job
starts): before it connects, in the broadcast of rank 0's initial state (rank 0 itself, or
another rank), or right before its first step. The survivors recover as from any other loss,
from the state before training (the new rank 0's initial weights are broadcast again), a
replacement takes the lost slot, and training finishes: every sample of every epoch trained
once, equal weights on every worker after every step.

A loop that cannot recover (its step not guarded; kf.Hook without kf.ElasticData) says so as
training starts, and the launcher says that a failure ends the job, not that the others go on.
"""
from __future__ import annotations

import re

import pytest

from conftest import check_epochs, run_elastic, sizes_of, steps_of


@pytest.mark.parametrize("kill", ["0@import", "2@import", "0@broadcast", "1@broadcast",
                                  "1@step"])
@pytest.mark.timeout(150)
def test_a_worker_lost_while_the_job_starts_is_replaced(tmp_path, kill):
    rank = int(kill.split("@")[0])
    # Versions: 0 (3 workers), 1 (the 2 survivors), 2 (the replacement joined): 5 steps there.
    r, records = run_elastic(tmp_path, 3, 3, "--kill", kill, "--max-steps", "2000",
                             "--stop-at-version", "2:5", script="elastic_numpy.py",
                             timeout=140)
    log = r.stdout[-2000:] + r.stderr[-6000:]
    assert r.returncode == 0, log
    assert f"worker {rank} (" in r.stderr and "was killed by SIGKILL" in r.stderr, log
    assert "in place of the lost one" in r.stderr and "replaced in version 2" in r.stderr, log
    steps = steps_of(records)
    assert sorted(steps) == list(range(1, max(steps) + 1)), log
    assert sizes_of(steps) == [2, 3], {s: len(rows) for s, rows in steps.items()}
    check_epochs(steps)
    finals = [rows[-1] for rows in records.values() if rows and "done" in rows[-1]]
    assert len(finals) == 3 and {(f["size"], f["step"]) for f in finals} == {
        (3, max(steps))}, finals
    lost = [f for f in finals if len(f["recoveries"]) == 1]
    assert len(lost) == 2, finals  # the survivors; the replacement joined after
    for f in lost:
        rec = f["recoveries"][0]
        assert rec["step"] == 0 and rec["size"] == 2 and len(rec["lost"]) == 1, rec
    victim = lost[0]["recoveries"][0]["lost"][0].replace(":", "_")
    first = next(row for row in records[victim] if "step" in row)
    assert first["step"] > 1 and first["size"] == 3, first  # the replacement's first step


@pytest.mark.timeout(120)
def test_a_peer_still_starting_when_another_is_lost_is_waited_for(tmp_path):
    """Rank 0 dies before it connects while rank 2 is still starting (8 s late: a framework's
    import on a loaded machine), longer than KUNGFU_RECOVERY_WINDOW (2 s here). Before training
    started the survivors wait for a peer that has not checked in as long as a connect would
    (KUNGFU_CONNECT_TIMEOUT): rank 2 is a member of the recovered cluster, not left out."""
    r, records = run_elastic(tmp_path, 3, 3, "--kill", "0@import", "--slow-start", "2:8",
                             "--max-steps", "20", script="elastic_numpy.py", timeout=100,
                             env_extra={"KUNGFU_RECOVERY_WINDOW": "2s"},
                             launcher_args=("-replace=false",))
    log = r.stdout[-2000:] + r.stderr[-6000:]
    assert r.returncode == 0 and "ExpelledError" not in r.stderr, log
    steps = steps_of(records)
    assert sorted(steps) == list(range(1, 21)) and sizes_of(steps) == [2], log
    finals = [rows[-1] for rows in records.values() if rows and "done" in rows[-1]]
    assert len(finals) == 2, log
    for f in finals:
        [rec] = f["recoveries"]
        assert rec["step"] == 0 and len(rec["lost"]) == 1, rec


@pytest.mark.timeout(120)
def test_a_loop_that_cannot_recover_says_so_and_so_does_the_launcher(tmp_path):
    r, records = run_elastic(tmp_path, 3, 3, "--kill", "1@3", "--no-guard", "--max-steps",
                             "200", script="elastic_numpy.py", timeout=100)
    log = r.stdout[-2000:] + r.stderr[-6000:]
    assert r.returncode == 137, log  # the lost worker's exit code: the job did not finish
    why = ("its training step is not wrapped by NumpyTrainer.guard (before before_train), "
           "which needs data=kf.ElasticData(...)")
    lines = r.stderr.splitlines()
    # Rank 0 warned as training started, once; the launcher's line of the kill says the truth.
    warned = [i for i, line in enumerate(lines) if line.endswith(
        f"UserWarning: kungfu: this elastic job cannot survive the loss of a worker: {why}; a "
        "worker lost ends the job")]
    assert len(warned) == 1 and lines[warned[0]].startswith("[0] "), log
    told = [i for i, line in enumerate(lines) if re.fullmatch(
        r"kungfu-run: worker 1 \(127\.0\.0\.1:\d+\) was killed by SIGKILL \(exit code 137\); "
        r"training cannot recover from it, so the job ends: " + re.escape(why), line)]
    assert len(told) == 1 and warned[0] < told[0], log
    assert "go on" not in r.stderr and "told to recover" not in r.stderr, log
    assert "training did not finish after the failures above" in r.stderr, log
    assert max(steps_of(records)) < 10, log  # the others failed at their next collective


@pytest.mark.timeout(150)
def test_an_etcd_job_survives_the_loss_of_a_launcher_in_one_recovery(tmp_path):
    """Two launchers (hosts 127.0.0.1 and 127.0.0.2, two workers each) share an etcd store.
    Launcher a is killed with SIGKILL after step 5: its workers end with it (the watchdog pipe)
    and nobody reports them dead, so b's workers leave both out together when
    KUNGFU_RECOVERY_WINDOW ends (one recovery, one pause) and finish training on their own.

    Host a's rank 0 waits before it writes its record of step 5 (as a worker descheduled on a
    loaded machine): it trained step 5 with the others but dies before its record says so. So the records of a
    step are not the workers that trained it (a fresh-clone CI run read 4 -> 3 -> 2 from them);
    the sizes are those the workers recorded, and the step's parts a split among 4."""
    import json
    import os
    import secrets
    import subprocess
    import sys
    import time

    from conftest import HERE, REPO_ROOT, SAMPLES, free_port_range
    from etcd_server import ETCD, Etcd

    if ETCD is None:
        pytest.skip("etcd is not on PATH (scripts/install.sh installs etcd-server)")
    etcd = Etcd(str(tmp_path))
    out = tmp_path / "records"
    out.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUNGFU_")}
    env.update(PYTHONPATH=REPO_ROOT, KUNGFU_JOB_TOKEN=secrets.token_hex(32))
    ports = free_port_range(2, ("127.0.0.1", "127.0.0.2"))
    common = ["-w", "-np", "4", "-H", "127.0.0.1:2,127.0.0.2:2", "-port-range", ports,
              "-config-server", f"etcd://{etcd.host_port}", "-replace=false", "-timeout", "120s"]
    # A window of 3 s: a survivor descheduled for a second on a loaded machine checks in late.
    worker = ["env", "KUNGFU_RECOVERY_WINDOW=3s", sys.executable,
              os.path.join(HERE, "elastic_numpy.py"), "--out", str(out), "--samples",
              str(SAMPLES), "--max-steps", "40", "--step-sleep", "0.05", "--hold-record",
              "0@5"]
    launchers = []
    try:
        etcd.wait_ready()
        for host in ("127.0.0.1", "127.0.0.2"):
            launchers.append(subprocess.Popen(
                [sys.executable, "-m", "kungfu.cmd", *common, "-self", host, *worker],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                cwd=REPO_ROOT))
        a, b = launchers
        # Host a's rank 1: its record of step 5 is written while rank 0 waits to write its own.
        fast = out / "127.0.0.1_{}.jsonl".format(int(ports.split("-")[0]) + 1)
        deadline = time.monotonic() + 100
        while time.monotonic() < deadline and a.poll() is None:
            rows = fast.read_text().splitlines() if fast.exists() else []
            if len(rows) >= 5:
                break
            time.sleep(0.02)
        assert a.poll() is None, a.communicate()[1][-3000:]
        a.kill()
        _, err_b = b.communicate(timeout=120)
    finally:
        for p in launchers:
            if p.poll() is None:
                p.kill()
            p.communicate()
        etcd.stop()
    assert b.returncode == 0, err_b[-5000:]
    records = {f.stem: [json.loads(line) for line in f.read_text().splitlines()]
               for f in out.glob("*.jsonl")}
    steps = steps_of(records)
    assert sorted(steps) == list(range(1, 41)), err_b[-3000:]
    for step, rows in steps.items():
        assert len({row["digest"] for row in rows}) == 1, f"step {step}: {rows}"
        assert len({row["size"] for row in rows}) == 1 and len(rows) <= rows[0]["size"], rows
    sizes = [rows[0]["size"] for rows in steps.values()]
    assert sorted(set(sizes), reverse=True) == [4, 2] and sizes == sorted(sizes, reverse=True)
    check_epochs(steps)
    # The race this test makes sure of: a step trained by 4 with 3 records.
    assert any(len(rows) == 3 for rows in steps.values()), {s: len(r) for s, r in steps.items()}
    finals = [rows[-1] for rows in records.values() if rows and "done" in rows[-1]]
    assert len(finals) == 2, err_b[-3000:]
    for f in finals:
        [rec] = f["recoveries"]  # one recovery leaves the whole host out
        assert sorted(p.split(":")[0] for p in rec["lost"]) == ["127.0.0.1"] * 2, rec
