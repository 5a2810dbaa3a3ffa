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

from conftest import check_epochs, run_elastic, run_recovered, sizes_of, steps_of


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


# The recovery protocol (who is left out, rollbacks, stopped and hung workers, joiners, the
# launcher's restarts, cool-downs and errors) with numpy workers; test_recovery.py keeps the
# runs that check TensorFlow's and Keras's state (model.fit's train function, custom loops over
# tf.function, weights and optimizer state, Keras checkpoints).

# 240 samples, batch 8: 10 steps per epoch at 3 workers, 8 per epoch at 4 (the last one short).
STEPS = 24


def _recovered(tmp_path, np_: int, *faults: str, **kw):
    """conftest.run_recovered of elastic_numpy.py."""
    return run_recovered(tmp_path, np_, STEPS, *faults, script="elastic_numpy.py", timeout=150,
                         **kw)


@pytest.mark.timeout(160)
def test_a_worker_killed_in_its_first_step(tmp_path):
    # Rolled back to the commit before any step: step 1 is trained by the two survivors.
    _, records, finals = _recovered(tmp_path, 3, "--kill", "2@step", steps_before=False)
    assert {f["recoveries"][0]["step"] for f in finals} == {0}, finals
    assert len(steps_of(records)[1]) == 2


@pytest.mark.timeout(160)
def test_a_worker_killed_before_the_agreement_of_its_step(tmp_path):
    # Killed after its training step 6 but before the Loop's agreement of step 6, which the
    # others then never finish: the survivors roll back to step 5, the last one all committed.
    _, _, finals = _recovered(tmp_path, 3, "--kill", "1@6-")
    assert {f["recoveries"][0]["step"] for f in finals} == {5}, finals


@pytest.mark.timeout(160)
def test_the_last_rank_killed_at_the_end_of_an_epoch(tmp_path):
    # Step 10 ends epoch 0: the survivors fail in the epoch's own agreement and end it again.
    _, records, _ = _recovered(tmp_path, 3, "--kill", "2@10+")
    steps = steps_of(records)
    assert {row["epoch"] for row in steps[10]} == {0} and {row["epoch"] for row in steps[11]} == {1}


@pytest.mark.timeout(160)
def test_a_worker_killed_after_the_last_step(tmp_path):
    """Training ends before a replacement could join (whether the survivors asked for one in
    time or not): the closing summary never says it was replaced."""
    r, _, _ = _recovered(tmp_path, 3, "--kill", f"1@{STEPS}+", steps_after=False, replace=True)
    assert "elastic job finished" in r.stderr
    assert re.search(r"survived: worker 1 \(127\.0\.0\.1:\d+\) was killed by SIGKILL "
                     r"\(exit code 137\) at [\d.]+s; (not replaced|a replacement started in "
                     r"version \d+ never joined \(its resize was abandoned\))$", r.stderr, re.M), \
        r.stderr[-3000:]
    assert "replaced in version" not in r.stderr, r.stderr[-3000:]


@pytest.mark.timeout(160)
def test_two_workers_killed_at_once(tmp_path):
    # Both die after step 4: mostly one recovery loses both. On a busy machine one of them may
    # still be finishing step 4 when the other's loss is seen; it then checks in alive, is kept,
    # and dies in the recovered cluster, which recovers again.
    _recovered(tmp_path, 4, "--kill", "1@4+", "--kill", "3@4+", expect_lost=2, max_recoveries=2)


@pytest.mark.timeout(160)
def test_a_stopped_worker_is_left_out(tmp_path):
    r, _, finals = _recovered(tmp_path, 3, "--hang", "2@5",
                              env={"KUNGFU_PEER_TIMEOUT": "2s", "KUNGFU_RECOVERY_WINDOW": "1s"})
    assert "not in the cluster any more; stopping it" in r.stderr
    assert all("timeout" in f["recoveries"][0]["cause"] for f in finals), finals


@pytest.mark.timeout(160)
def test_a_stopped_worker_that_wakes_up_leaves_with_a_clear_error(tmp_path):
    # Continued 5 s after it stopped: the others recovered without it (peer timeout 2 s, window
    # 1 s) and the launcher gives it 10 s to leave; its next collective fails, it checks in,
    # finds the decision without it and exits.
    r, _, _ = _recovered(tmp_path, 3, "--hang", "2@5", "--wake-after", "5",
                         env={"KUNGFU_PEER_TIMEOUT": "2s", "KUNGFU_RECOVERY_WINDOW": "1s",
                              "KUNGFU_LEAVE_GRACE": "10s"})
    assert "without this one" in r.stderr and "ExpelledError" in r.stderr, r.stderr[-4000:]
    assert "no longer in the cluster, exited with code 1" in r.stderr, r.stderr[-4000:]


@pytest.mark.timeout(160)
def test_a_worker_killed_while_the_others_wait_out_a_hung_one(tmp_path):
    # 4 workers; rank 1 stops (SIGSTOP) after step 5. The others fail after the peer timeout
    # and check in alive; rank 2 then dies (SIGKILL) inside the recovery window that waits for
    # rank 1. Its launcher says it died: the survivors leave both out and no worker is started
    # in rank 2's slot (-replace=false; and a dead member's slot never gets a joiner). Before,
    # rank 2 was kept as a member and its slot restarted as a joiner: a hang until -timeout.
    r, records, finals = _recovered(
        tmp_path, 4, "--hang", "1@5", "--kill-after-check-in", "2", expect_lost=2,
        env={"KUNGFU_PEER_TIMEOUT": "2s", "KUNGFU_RECOVERY_WINDOW": "2s"})
    assert "in place of the lost one" not in r.stderr, r.stderr[-4000:]
    assert "worker 2 (" in r.stderr and "was killed by SIGKILL" in r.stderr, r.stderr[-4000:]
    lost = sorted(finals[0]["recoveries"][0]["lost"])
    assert [records[p.replace(":", "_")][0]["rank"] for p in lost] == [1, 2], lost


@pytest.mark.timeout(160)
def test_a_worker_that_dies_just_after_the_survivors_agreed_to_keep_it(tmp_path):
    # 4 workers; rank 1 dies after step 5. Rank 2 dies once the decision that keeps it is
    # stored (before its launcher's word reached the store): the others cannot connect to it
    # (KUNGFU_CONNECT_TIMEOUT), recover again without it, and no worker is started in its
    # slot as a member of the version that lists it. One recovery, two lost, on each finisher.
    r, records, finals = _recovered(
        tmp_path, 4, "--kill", "1@5+", "--kill-after-decision", "2", expect_lost=2,
        env={"KUNGFU_CONNECT_TIMEOUT": "3s"})
    assert "in place of the lost one" not in r.stderr, r.stderr[-4000:]
    lost = sorted(finals[0]["recoveries"][0]["lost"])
    assert [records[p.replace(":", "_")][0]["rank"] for p in lost] == [1, 2], lost


@pytest.mark.timeout(160)
def test_too_few_survivors_end_the_job_with_a_clear_error(tmp_path):
    r, _ = run_elastic(tmp_path, 3, 3, "--max-steps", str(STEPS), "--kill", "1@5+",
                       launcher_args=("-min-np", "3"), script="elastic_numpy.py", timeout=150)
    assert r.returncode != 0
    assert "the job needs at least 3 (kungfu-run -min-np)" in r.stderr, r.stderr[-4000:]
    assert "training did not finish" in r.stderr, r.stderr[-4000:]


@pytest.mark.timeout(160)
def test_a_failure_beyond_the_restart_budget_ends_the_job(tmp_path):
    r, _ = run_elastic(tmp_path, 3, 3, "--max-steps", str(STEPS), "--kill", "1@5+",
                       launcher_args=("-max-restarts", "0"), script="elastic_numpy.py",
                       timeout=150)
    assert r.returncode == 137, r.stderr[-4000:]  # the first failure's exit code (SIGKILL)
    assert "survives at most 0 (kungfu-run -max-restarts)" in r.stderr, r.stderr[-4000:]


@pytest.mark.timeout(200)
def test_the_store_down_for_seconds_during_a_recovery(tmp_path):
    """The killed worker stops etcd (SIGSTOP) for 4 s as it dies: the survivors and the
    launcher retry the store and the job goes on once it answers."""
    from etcd_server import ETCD, Etcd

    if ETCD is None:
        pytest.skip("etcd is not on PATH (scripts/install.sh installs etcd-server)")
    (tmp_path / "etcd").mkdir()
    etcd = Etcd(str(tmp_path / "etcd"))
    try:
        etcd.wait_ready()
        r, records = run_elastic(
            tmp_path, 3, 3, "--max-steps", str(STEPS), "--kill", "1@5+", "--pause-pid",
            str(etcd.proc.pid), "--pause-seconds", "4", launcher_args=("-replace=false",),
            store=f"etcd://{etcd.host_port}", script="elastic_numpy.py", timeout=150)
    finally:
        etcd.proc.send_signal(__import__("signal").SIGCONT)
        etcd.stop()
    assert r.returncode == 0, r.stderr[-5000:]
    steps = steps_of(records)
    assert sorted(steps) == list(range(1, STEPS + 1))
    for step, rows in steps.items():
        assert len({row["digest"] for row in rows}) == 1, f"step {step}: {rows}"
    check_epochs(steps)
    finals = [rows[-1] for rows in records.values() if rows and "done" in rows[-1]]
    assert len(finals) == 2 and all(len(f["recoveries"]) == 1 for f in finals), finals
    for f in finals:  # the store was down during the recovery: it waited for it
        rec = f["recoveries"][0]
        assert rec["restored_at"] - rec["failed_at"] > 3, rec


@pytest.mark.timeout(160)
def test_a_worker_killed_while_a_resize_waits_for_its_joiner(tmp_path):
    # 2 workers, rank 0 asks for 3 after step 3; rank 1 dies after step 6, while the joiner is
    # still starting (joiners start 4 s late, as with a framework's import). Rank 0 goes on
    # alone (the resize is given up, its joiner stopped), then the replacement for rank 1
    # joins: 2, 1, 2 workers.
    # Versions: 0 (2 workers), 1 (the resize, abandoned), 2 (the recovery, 1), 3 (the
    # replacement joined, 2): 5 steps there.
    r, records = run_elastic(tmp_path, 2, 3, "--schedule", "3", "--gap", "3", "--tail",
                             "100000", "--max-steps", "100000", "--step-sleep", "0.2",
                             "--kill", "1@6+", "--slow-join", "4", "--stop-at-version", "3:5",
                             script="elastic_numpy.py", timeout=150)
    log = r.stderr[-5000:]
    assert r.returncode == 0, log
    assert "not in the cluster any more; stopping it" in r.stderr, log
    assert "in place of the lost one" in r.stderr, log
    steps = steps_of(records)
    assert sizes_of(steps) == [2, 1, 2], steps
    check_epochs(steps)


@pytest.mark.timeout(160)
def test_the_leader_killed_while_it_lends_variables_to_a_joiner(tmp_path):
    # 2 workers grow to 3; rank 0 dies once it has lent its variables to the joiner. The joiner
    # cannot finish its sync and fails; rank 1 alone recovers (it becomes rank 0), then
    # replacements fill both lost slots, joining rank 1 (a replacement in slot 0 must not become
    # rank 0: a joiner's state would overwrite the job's): 2, 1, 3 workers, every sample once,
    # equal weights, and the steps go on from where they were.
    r, records = run_elastic(tmp_path, 2, 3, "--schedule", "3", "--gap", "3", "--tail",
                             "12", "--max-steps", "100000", "--step-sleep", "0.05",
                             "--kill-while-lending", "0", script="elastic_numpy.py",
                             timeout=150)
    log = r.stderr[-6000:]
    assert r.returncode == 0, log
    assert "survived: worker 0" in r.stderr, log
    steps = steps_of(records)
    assert sizes_of(steps) == [2, 1, 3], steps
    check_epochs(steps)
    finals = [rows[-1] for rows in records.values() if rows and "done" in rows[-1]]
    assert len(finals) == 3 and {f["size"] for f in finals} == {3}, finals
    assert len({f["step"] for f in finals}) == 1 and finals[0]["step"] == max(steps), finals
    for rows in records.values():  # no worker's steps ever go back (a restart from 0)
        numbers = [row["step"] for row in rows if "slice" in row]
        assert numbers == sorted(numbers), numbers


@pytest.mark.timeout(160)
def test_a_host_that_fails_twice_gets_no_new_worker_while_it_cools_down(tmp_path):
    # One host, 3 workers in 4 slots, with a warm spare. Rank 2 dies after step 4 and is
    # replaced (the spare takes its place; the launcher starts another spare). Rank 1 dies
    # after step 60, well after (more than the 5 s within which a host's failures count once):
    # the host has failed twice, so it gets no new worker for the cool-down (8 s), although a
    # warm spare waits there; the two survivors train on meanwhile, then the spare joins: 3, 2,
    # 3, 2, 3 workers.
    cooldown = 8.0
    # Versions: 0 (3 workers), 1 (recovered, 2), 2 (replaced, 3), 3 (2), 4 (3): the job stops
    # 5 steps into version 4.
    r, records = run_elastic(tmp_path, 3, 4, "--max-steps", "100000", "--step-sleep", "0.15",
                             "--kill", "2@4+", "--kill", "1@60+", "--stop-at-version", "4:5",
                             launcher_args=("-host-cooldown", "8s", "-spares", "1"),
                             script="elastic_numpy.py", timeout=150)
    log = r.stderr[-6000:]
    assert r.returncode == 0, log
    assert "host 127.0.0.1: its workers failed 2 times in" in r.stderr, log
    assert "it gets no new worker for 8s" in r.stderr, log
    # Both replacements were warm spares, the second one taken only after the cool-down.
    assert len(re.findall(r"version [24]: spare \d, started [\d.]+s ago, is worker \d ",
                          r.stderr)) == 2, log
    steps = steps_of(records)
    assert sizes_of(steps) == [3, 2, 3, 2, 3], steps
    check_epochs(steps)
    # The cool-down began once the launcher saw the second failure, after the worker wrote that
    # it faulted; the replacement's cluster was planned once it ended, before its first step.
    # (Both times are the same machine's clock: no duration measured under load is compared.)
    faults = sorted(row["at"] for rows in records.values() for row in rows if "fault" in row)
    runs = []  # [size, time of its first step]
    for rows in steps.values():
        if not runs or runs[-1][0] != len(rows):
            runs.append([len(rows), min(row["t"] for row in rows)])
    assert len(faults) == 2 and runs[3][1] > faults[1], (faults, runs)
    assert runs[4][1] - faults[1] >= cooldown, (faults, runs)


# A checkpoint file that cannot be written or read (the Loop's, with any framework; the
# checkpoints of Keras models are test_recovery.py's).


@pytest.mark.timeout(120)
def test_a_checkpoint_folder_that_cannot_be_made_stops_every_worker_at_once(tmp_path):
    # A missing folder is made (as Keras's ModelCheckpoint does: tests/unit/test_membership.py);
    # one under a file cannot be.
    (tmp_path / "afile").write_text("")
    ckpt = tmp_path / "afile" / "nodir" / "x.ckpt"
    r, records = run_elastic(tmp_path, 3, 3, "--max-steps", "30",
                             "--checkpoint", str(ckpt), script="elastic_numpy.py",
                             timeout=100)
    assert r.returncode == 1, r.stderr[-4000:]
    for rank in range(3):  # every worker, before training: no step, no recovery
        assert f"[{rank}] kungfu.elastic._checkpoint.CheckpointError: kungfu: cannot write the " \
               f"checkpoint {ckpt}: its folder {ckpt.parent} cannot be created (Not a " \
               "directory)" in r.stderr, r.stderr[-4000:]
    assert not steps_of(records) and "recovered in" not in r.stderr, r.stderr[-4000:]


@pytest.mark.timeout(120)
def test_a_corrupted_checkpoint_stops_every_worker_naming_it(tmp_path):
    from kungfu.elastic import _checkpoint

    ckpt = tmp_path / "x.ckpt"
    _checkpoint.write(str(ckpt), b"training state" * 100)
    blob = bytearray(ckpt.read_bytes())
    blob[-700] ^= 0x40  # one bit of the content
    ckpt.write_bytes(bytes(blob))
    r, records = run_elastic(tmp_path, 2, 2, "--max-steps", "10",
                             "--checkpoint", str(ckpt), script="elastic_numpy.py",
                             timeout=100)
    assert r.returncode == 1, r.stderr[-4000:]
    for rank in range(2):
        assert f"[{rank}] kungfu.elastic._checkpoint.CheckpointError: kungfu: the checkpoint " \
               f"{ckpt} is corrupted: the SHA-256 of its content does not match its header" \
               in r.stderr, r.stderr[-4000:]
    assert not steps_of(records)
    assert ckpt.read_bytes() == bytes(blob)  # left as it was, for the user to look at
