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
def test_a_loop_that_cannot_recover_says_so_and_so_does_the_launcher(tmp_path):
    r, records = run_elastic(tmp_path, 3, 3, "--kill", "1@3", "--no-guard", "--max-steps",
                             "200", script="elastic_numpy.py", timeout=100)
    log = r.stdout[-2000:] + r.stderr[-6000:]
    assert r.returncode == 137, log  # the lost worker's exit code: the job did not finish
    why = ("its training step is not wrapped by NumpyTrainer.guard, which needs "
           "data=kf.ElasticData(...)")
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
