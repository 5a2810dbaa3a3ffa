"""Recovery: workers of an elastic job killed (SIGKILL) or stopped (SIGSTOP) in model.fit; the
survivors go on. Real processes under kungfu-run -w, elastic_train.py (next to this file) with a
fixed size; every worker records each step it trained.

Each run checks what a user is promised: the job finishes with exit code 0 and says what it
survived, every sample of every epoch is trained exactly once (the failed step's batch is redone
by the survivors), the survivors' weights are bit-identical after every step (leaving out the
records of a step that a recovery undid: conftest.steps_of), and each survivor recovered once,
without the lost peer.
"""
from __future__ import annotations

import re
from collections import defaultdict

import pytest

pytest.importorskip("tensorflow")

from conftest import SAMPLES, check_epochs, run_elastic, sizes_of, steps_of  # noqa: E402

# 240 samples, batch 8: 10 steps per epoch at 3 workers, 8 per epoch at 4 (the last one short).
STEPS = 24


def _recovered(tmp_path, np_: int, *faults: str, env=None, expect_lost: int = 1,
               steps_after: bool = True, steps_before: bool = True, replace: bool = False):
    """A run that goes on with the survivors (-replace=false unless `replace`;
    test_lost_workers_are_replaced has a replacement that joins)."""
    r, records = run_elastic(tmp_path, np_, np_, "--schedule", str(np_), "--tail", "1000",
                             "--max-steps", str(STEPS), "--step-sleep", "0.02", *faults,
                             env_extra=env, launcher_args=() if replace else ("-replace=false",))
    log = r.stdout[-3000:] + r.stderr[-6000:]
    assert r.returncode == 0, log
    assert "survived" in r.stderr or expect_lost == 0, log
    steps = steps_of(records)
    assert sorted(steps) == list(range(1, STEPS + 1)), log
    for step, rows in steps.items():
        assert len({row["digest"] for row in rows}) == 1, f"step {step}: {rows}"
    check_epochs(steps)
    finals = [rows[-1] for rows in records.values() if rows and "done" in rows[-1]]
    assert len(finals) == np_ - expect_lost, log
    for f in finals:
        assert f["size"] == np_ - expect_lost and f["step"] == STEPS, f
        [rec] = f["recoveries"]
        assert len(rec["lost"]) == expect_lost and rec["size"] == np_ - expect_lost, rec
    sizes = [len(rows) for rows in steps.values()]
    assert sizes[0] == (np_ if steps_before else np_ - expect_lost), sizes
    if steps_after:  # the survivors trained on after the loss
        assert sizes[-1] == np_ - expect_lost, sizes
    return r, records, finals


@pytest.mark.timeout(200)
def test_a_middle_rank_killed_during_a_step(tmp_path):
    _, records, finals = _recovered(tmp_path, 3, "--kill", "1@6")
    lost = finals[0]["recoveries"][0]["lost"][0]
    rows = records[lost.replace(":", "_")]
    assert rows[-1]["fault"] == 9 and rows[-2]["step"] in (5, 6), rows[-2:]  # killed in step 6
    assert rows[0]["rank"] == 1


@pytest.mark.timeout(200)
def test_a_worker_killed_in_the_first_step(tmp_path):
    # Rolled back to the commit before any step: step 1 is trained by the two survivors.
    _, records, finals = _recovered(tmp_path, 3, "--kill", "2@1", steps_before=False)
    assert {f["recoveries"][0]["step"] for f in finals} == {0}, finals
    assert len(steps_of(records)[1]) == 2


@pytest.mark.timeout(200)
def test_rank_0_killed_before_its_first_step(tmp_path):
    # Killed once connected, as kf.Hook begins the broadcast of its initial state in model.fit's
    # on_train_begin: the others recover from the state before training (before, the job
    # ended); the new rank 0 broadcasts its weights, and step 1 is trained by the two.
    _, records, finals = _recovered(tmp_path, 3, "--kill-in-start", "0", steps_before=False)
    assert {f["recoveries"][0]["step"] for f in finals} == {0}, finals
    lost = finals[0]["recoveries"][0]["lost"][0]
    assert not [row for row in records.get(lost.replace(":", "_"), []) if "step" in row]


@pytest.mark.timeout(200)
def test_rank_0_killed_between_steps(tmp_path):
    # The survivors fail in the next step's gradient allreduce (inside Keras's train function)
    # and redo it; rank 1 becomes rank 0 and writes that training is done.
    r, records, finals = _recovered(tmp_path, 3, "--kill", "0@5+")
    assert "elastic job finished" in r.stderr
    assert all("allreduce" in f["recoveries"][0]["cause"] for f in finals), finals


# The two places a survivor of a custom loop meets the failure: in the guarded step (the next
# step's gradient allreduce) or in the Hook's agreement of the step. (A kill during a step lands
# in either one, by timing; the Keras tests above kill during a step, through the same guard.)
@pytest.mark.parametrize("fault", ["1@5+", "1@6-"], ids=["between-steps", "before-the-agreement"])
@pytest.mark.timeout(200)
def test_a_custom_loop_survives_with_hook_guard(tmp_path, fault):
    # A GradientTape loop over data.epoch_batches() with the step wrapped by hook.guard.
    _, records, finals = _recovered(tmp_path, 3, "--kill", fault, "--custom-loop")
    # The custom loop ran (no Keras train function), and the survivors rolled back to the last
    # step every one of them had committed: killed after step 5; or after its step 6 but before
    # the Hook's agreement of step 6, which the others then never finished.
    assert all(row["traces"] is None for rows in steps_of(records).values() for row in rows)
    rolled_back_to = {"1@5+": {5}, "1@6-": {5}}[fault]
    (step,) = {f["recoveries"][0]["step"] for f in finals}
    assert step in rolled_back_to, finals


@pytest.mark.timeout(200)
def test_the_last_rank_killed_at_the_end_of_an_epoch(tmp_path):
    # Step 10 ends epoch 0: the survivors fail in the epoch's own agreement and end it again.
    _, records, _ = _recovered(tmp_path, 3, "--kill", "2@10+")
    steps = steps_of(records)
    assert {row["epoch"] for row in steps[10]} == {0} and {row["epoch"] for row in steps[11]} == {1}


@pytest.mark.timeout(200)
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


@pytest.mark.timeout(200)
def test_two_workers_killed_at_once(tmp_path):
    _recovered(tmp_path, 4, "--kill", "1@4+", "--kill", "3@4+", expect_lost=2)


@pytest.mark.timeout(200)
def test_a_stopped_worker_is_left_out(tmp_path):
    r, _, finals = _recovered(tmp_path, 3, "--hang", "2@5",
                              env={"KUNGFU_PEER_TIMEOUT": "2s", "KUNGFU_RECOVERY_WINDOW": "1s"})
    assert "not in the cluster any more; stopping it" in r.stderr
    assert all("timeout" in f["recoveries"][0]["cause"] for f in finals), finals


@pytest.mark.timeout(200)
def test_a_stopped_worker_that_wakes_up_leaves_with_a_clear_error(tmp_path):
    # Continued 5 s after it stopped: the others recovered without it (peer timeout 2 s, window
    # 1 s) and the launcher gives it 10 s to leave; its next collective fails, it checks in,
    # finds the decision without it and exits.
    r, records, _ = _recovered(tmp_path, 3, "--hang", "2@5", "--wake-after", "5",
                               env={"KUNGFU_PEER_TIMEOUT": "2s", "KUNGFU_RECOVERY_WINDOW": "1s"})
    assert "without this one" in r.stderr and "ExpelledError" in r.stderr, r.stderr[-4000:]
    assert "no longer in the cluster, exited with code 1" in r.stderr, r.stderr[-4000:]


@pytest.mark.timeout(200)
def test_a_worker_killed_while_a_resize_waits_for_its_joiner(tmp_path):
    # 2 workers, rank 0 asks for 3 after step 3; rank 1 dies after step 6, while the joiner is
    # still starting. Rank 0 goes on alone (the resize is given up, its joiner stopped), then
    # the replacement for rank 1 joins: 2, 1, 2 workers.
    r, records = run_elastic(tmp_path, 2, 3, "--schedule", "3", "--gap", "3", "--tail",
                             "100000", "--max-steps", "90", "--step-sleep", "0.2",
                             "--kill", "1@6+")
    log = r.stderr[-5000:]
    assert r.returncode == 0, log
    assert "not in the cluster any more; stopping it" in r.stderr, log
    assert "in place of the lost one" in r.stderr, log
    steps = steps_of(records)
    assert sizes_of(steps) == [2, 1, 2], steps
    check_epochs(steps)


@pytest.mark.timeout(240)
def test_the_leader_killed_while_it_lends_variables_to_a_joiner(tmp_path):
    # 2 workers grow to 3; rank 0 dies once it has lent its variables to the joiner. The joiner
    # cannot finish its sync and fails; rank 1 alone recovers (it becomes rank 0), then
    # replacements fill both lost slots, joining rank 1 (a replacement in slot 0 must not become
    # rank 0: a joiner's state would overwrite the job's): 2, 1, 3 workers, every sample once,
    # equal weights, and the steps go on from where they were.
    r, records = run_elastic(tmp_path, 2, 3, "--schedule", "3", "--gap", "3", "--tail",
                             "12", "--step-sleep", "0.05", "--kill-while-lending", "0")
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


@pytest.mark.timeout(240)
def test_a_host_that_fails_twice_gets_no_new_worker_while_it_cools_down(tmp_path):
    # One host, 3 workers in 4 slots, with a warm spare. Rank 2 dies at step 4 and is replaced
    # (the spare takes its place; the launcher starts another spare). Rank 1 dies at step 50,
    # well after: the host has failed twice, so it gets no new worker for the cool-down (8 s),
    # although a warm spare waits there; the two survivors train on meanwhile, then the spare
    # joins: 3, 2, 3, 2, 3 workers. (Spares make both replacements quick, so the second one's
    # delay is the cool-down's, not a TensorFlow start-up's, which varies with the load.)
    cooldown = 8.0
    # Versions: 0 (3 workers), 1 (recovered, 2), 2 (replaced, 3), 3 (2), 4 (3): the job stops
    # 5 steps into version 4.
    r, records = run_elastic(tmp_path, 3, 4, "--schedule", "3", "--tail", "100000",
                             "--max-steps", "200", "--step-sleep", "0.2", "--kill", "2@4+",
                             "--kill", "1@50+", "--stop-at-version", "4:5",
                             launcher_args=("-host-cooldown", "8s", "-spares", "1"))
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
    # How long each size lasted, from its first step to the next size's first step. Both
    # stretches of 2 workers wait for a replacement to start and join; the second also waits
    # out the cool-down.
    runs = []  # [size, time of its first step]
    for rows in steps.values():
        if not runs or runs[-1][0] != len(rows):
            runs.append([len(rows), min(row["t"] for row in rows)])
    first, second = runs[2][1] - runs[1][1], runs[4][1] - runs[3][1]
    assert second - first >= cooldown - 3, (first, second)


@pytest.mark.timeout(200)
def test_too_few_survivors_end_the_job_with_a_clear_error(tmp_path):
    r, _ = run_elastic(tmp_path, 3, 3, "--schedule", "3", "--tail", "1000", "--max-steps",
                       str(STEPS), "--kill", "1@5+", launcher_args=("-min-np", "3"))
    assert r.returncode != 0
    assert "the job needs at least 3 (kungfu-run -min-np)" in r.stderr, r.stderr[-4000:]
    assert "training did not finish" in r.stderr, r.stderr[-4000:]


@pytest.mark.timeout(200)
def test_a_failure_beyond_the_restart_budget_ends_the_job(tmp_path):
    r, _ = run_elastic(tmp_path, 3, 3, "--schedule", "3", "--tail", "1000", "--max-steps",
                       str(STEPS), "--kill", "1@5+", launcher_args=("-max-restarts", "0"))
    assert r.returncode == 137, r.stderr[-4000:]  # the first failure's exit code (SIGKILL)
    assert "survives at most 0 (kungfu-run -max-restarts)" in r.stderr, r.stderr[-4000:]


@pytest.mark.timeout(300)
def test_lost_workers_are_replaced(tmp_path):
    # The default: after the recovery rank 0 asks for the size before the failure; the
    # launcher starts a new worker in the freed slot, which joins as in a resize. Steps are
    # slowed down so that it has time to start (TensorFlow's import) before training ends.
    r, records = run_elastic(tmp_path, 3, 3, "--schedule", "3", "--tail", "100000",
                             "--max-steps", "100", "--step-sleep", "0.25", "--kill", "1@5+",
                             "--stop-at-version", "2:5")  # 5 steps after the replacement joined
    log = r.stdout[-3000:] + r.stderr[-6000:]
    assert r.returncode == 0, log
    assert "in place of the lost one" in r.stderr and "replaced in version 2" in r.stderr, log
    steps = steps_of(records)
    assert sizes_of(steps) == [3, 2, 3], steps
    check_epochs(steps)
    finals = [rows[-1] for rows in records.values() if rows and "done" in rows[-1]]
    assert len(finals) == 3 and {f["size"] for f in finals} == {3}, finals
    # The replacement (same slot, so the same record file as the lost worker) rehearsed.
    lost = next(rows for rows in records.values() if any("fault" in row for row in rows))
    after = lost[[i for i, row in enumerate(lost) if "fault" in row][0] + 1:]
    trained = [row for row in after if "done" not in row]
    assert trained and all(row["rehearsed"] for row in trained), trained[:2]


def test_a_commit_restores_weights_optimizer_state_and_position():
    """The in-memory commit holds what a step changes: restoring it undoes later training (the
    tensors kept are not written through by the optimizer), and the data position."""
    import keras
    import numpy as np

    import kungfu as kf

    rng = np.random.default_rng(0)
    x, y = rng.random((64, 4), np.float32), rng.random((64, 2), np.float32)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    model.compile(optimizer=kf.Optimizer(keras.optimizers.SGD(0.1, momentum=0.9)), loss="mse",
                  jit_compile=False)
    data = kf.ElasticData(x, y, batch_size=8, record=True)
    hook = kf.Hook(data=data)
    hook.set_model(model)
    hook.membership.recovering = True
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)  # builds the optimizer's slots
    for _ in range(3):
        data.commit()
    hook.state.step = 3
    hook.membership.commit("step")
    variables = hook.membership.variables.synced()
    kept = [v.numpy().copy() for v in variables]
    model.fit(x, y, batch_size=8, epochs=2, verbose=0)
    data.commit()
    hook.state.step = 4
    assert sum(not np.array_equal(k, v.numpy()) for k, v in zip(kept, variables)) >= 4
    hook.membership.restore(hook.membership.commits[-1])
    assert all(np.array_equal(k, v.numpy()) for k, v in zip(kept, variables))
    assert hook.state.step == 3 and data.offset == 24 and len(data.served) == 3


@pytest.mark.timeout(240)
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
            tmp_path, 3, 3, "--schedule", "3", "--tail", "1000", "--max-steps", str(STEPS),
            "--kill", "1@5+", "--pause-pid", str(etcd.proc.pid), "--pause-seconds", "4",
            launcher_args=("-replace=false",), store=f"etcd://{etcd.host_port}")
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


@pytest.mark.timeout(300)
def test_a_job_resumes_from_its_checkpoint_at_another_size(tmp_path):
    """The loss of the whole job: kf.Hook(checkpoint=...) has rank 0 write the commit to a file
    (here every 3 steps). A first job of 2 workers stops after step 6 (mid-epoch); a second
    job of 3 resumes from the file: it goes on at step 7 in the same epoch, from the sample the
    first one stopped at, with its weights."""
    ckpt = tmp_path / "ckpt" / "train.ckpt"
    ckpt.parent.mkdir()
    common = ["--tail", "100000", "--checkpoint", str(ckpt), "--checkpoint-every", "3"]
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    r1, first = run_elastic(tmp_path / "a", 2, 2, "--schedule", "2", "--max-steps", "6", *common)
    assert r1.returncode == 0, r1.stderr[-4000:]
    assert ckpt.exists() and [p.name for p in ckpt.parent.iterdir()] == ["train.ckpt"]
    r2, second = run_elastic(tmp_path / "b", 3, 3, "--schedule", "3", "--max-steps", "20",
                             *common)
    assert r2.returncode == 0, r2.stderr[-4000:]
    assert "resumed from" in r2.stderr and "at step 6 (epoch 0, 96 samples into it)" in r2.stderr
    s1, s2 = steps_of(first), steps_of(second)
    assert sorted(s1) == list(range(1, 7)) and sorted(s2) == list(range(7, 21)), (s1, s2)
    assert all(len(rows) == 2 for rows in s1.values()) and all(len(rows) == 3
                                                               for rows in s2.values())
    served = defaultdict(list)
    for steps in (s1, s2):
        for rows in steps.values():
            for row in rows:
                served[row["epoch"]].append(row["served"])
    epoch0 = [i for part in served[0] for i in part]
    assert sorted(epoch0) == list(range(SAMPLES)), "epoch 0 across both jobs"
    # The second job starts from the first one's weights, on every worker.
    begins = {row["begin"] for rows in second.values() for row in rows if "begin" in row}
    assert begins == {s1[6][0]["digest"]}, (begins, s1[6][0]["digest"])


def test_a_hook_without_elastic_data_says_why_it_cannot_recover():
    """In an elastic job rank 0 warns with this as training starts and tells the launchers,
    which then say that a failure ends the job (test_recovery_numpy.py runs that path)."""
    import keras
    import numpy as np

    import kungfu as kf

    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    without = kf.Hook()
    without.set_model(model)
    assert without._why_no_recovery().startswith(
        "kf.Hook recovers only with data=kf.ElasticData(...), on which the survivors train a "
        "failed step again"), without._why_no_recovery()
    data = kf.ElasticData(np.zeros((8, 4), np.float32), np.zeros((8, 2), np.float32),
                          batch_size=4)
    with_data = kf.Hook(data=data)
    with_data.set_model(model)
    with_data.membership.recovering = True  # as on_train_begin sets it in an elastic job
    assert with_data._why_no_recovery() is None


def test_a_checkpoint_of_another_model_is_refused_by_name(tmp_path):
    import keras
    import numpy as np

    import kungfu as kf

    def hook_for(width):
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(width)])
        model.compile(optimizer=kf.Optimizer(keras.optimizers.SGD(0.1)), loss="mse",
                      jit_compile=False)
        model.fit(np.zeros((8, 4), np.float32), np.zeros((8, width), np.float32), verbose=0)
        hook = kf.Hook(checkpoint=tmp_path / "c.ckpt", checkpoint_every=1)
        hook.set_model(model)
        return hook

    writer = hook_for(2)
    writer.state.step = 1
    writer.membership.commit("step")
    assert (tmp_path / "c.ckpt").exists() and len(list(tmp_path.iterdir())) == 1
    with pytest.raises(ValueError, match=r"float32\[4, 3\] in this model, but the checkpoint "):
        hook_for(3)._resume()
    resumed = hook_for(2)
    assert resumed._resume() and resumed.state.step == 1
    with pytest.raises(ValueError, match="checkpoint_every"):
        kf.Hook(checkpoint="x", checkpoint_every=0)


@pytest.mark.timeout(200)
def test_a_worker_killed_while_the_others_wait_out_a_hung_one(tmp_path):
    # 4 workers; rank 1 stops (SIGSTOP) in step 5. The others fail after the peer timeout and
    # check in alive; rank 2 then dies (SIGKILL) inside the recovery window that waits for rank
    # 1. Its launcher says it died: the survivors leave both out and no worker is started in
    # rank 2's slot (-replace=false; and a dead member's slot never gets a joiner). Before,
    # rank 2 was kept as a member and its slot restarted as a joiner: a hang until -timeout.
    r, records, finals = _recovered(
        tmp_path, 4, "--hang", "1@5", "--kill-after-check-in", "2", expect_lost=2,
        env={"KUNGFU_PEER_TIMEOUT": "2s", "KUNGFU_RECOVERY_WINDOW": "2s"})
    assert "in place of the lost one" not in r.stderr, r.stderr[-4000:]
    assert "worker 2 (" in r.stderr and "was killed by SIGKILL" in r.stderr, r.stderr[-4000:]
    lost = sorted(finals[0]["recoveries"][0]["lost"])
    assert [records[p.replace(":", "_")][0]["rank"] for p in lost] == [1, 2], lost


@pytest.mark.timeout(300)
def test_a_checkpoint_written_at_an_epochs_end_resumes_in_the_next_epoch(tmp_path):
    """2 workers, 15 steps per epoch, a checkpoint every 100 steps (kf.Hook's default): the
    file holds the end of epoch 0 only (step 16 cuts epoch 1 short, which is not written). The
    second job resumes there, "0 samples into" epoch 1, and trains it (before, its first batch
    waited for a release that never came: no step)."""
    ckpt = tmp_path / "train.ckpt"
    common = ["--schedule", "2", "--tail", "100000", "--checkpoint", str(ckpt),
              "--checkpoint-every", "100"]
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    r1, first = run_elastic(tmp_path / "a", 2, 2, "--max-steps", "16", *common)
    assert r1.returncode == 0, r1.stderr[-4000:]
    r2, second = run_elastic(tmp_path / "b", 2, 2, "--max-steps", "35", *common, timeout=150)
    assert r2.returncode == 0, r2.stderr[-4000:]
    assert r2.stderr.count("at step 15 (epoch 1, 0 samples into it)") == 2, r2.stderr[-4000:]
    s1, s2 = steps_of(first), steps_of(second)
    assert sorted(s2) == list(range(16, 36)), sorted(s2)
    begins = {row["begin"] for rows in second.values() for row in rows if "begin" in row}
    assert begins == {s1[15][0]["digest"]}, (begins, s1[15][0]["digest"])
    assert {row["epoch"] for row in s2[16]} == {1} and {row["epoch"] for row in s2[31]} == {2}
    check_epochs(s2)  # epoch 1 whole, from its first sample


@pytest.mark.timeout(120)
def test_a_checkpoint_folder_that_cannot_be_made_stops_every_worker_at_once(tmp_path):
    # A missing folder is made (as Keras's ModelCheckpoint does: tests/unit/test_membership.py);
    # one under a file cannot be.
    (tmp_path / "afile").write_text("")
    ckpt = tmp_path / "afile" / "nodir" / "x.ckpt"
    r, records = run_elastic(tmp_path, 3, 3, "--schedule", "3", "--max-steps", "30",
                             "--checkpoint", str(ckpt), timeout=100)
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
    r, records = run_elastic(tmp_path, 2, 2, "--schedule", "2", "--max-steps", "10",
                             "--checkpoint", str(ckpt), timeout=100)
    assert r.returncode == 1, r.stderr[-4000:]
    for rank in range(2):
        assert f"[{rank}] kungfu.elastic._checkpoint.CheckpointError: kungfu: the checkpoint " \
               f"{ckpt} is corrupted: the SHA-256 of its content does not match its header" \
               in r.stderr, r.stderr[-4000:]
    assert not steps_of(records)
    assert ckpt.read_bytes() == bytes(blob)  # left as it was, for the user to look at


@pytest.mark.timeout(200)
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


@pytest.mark.timeout(240)
def test_ranks_in_environ_and_output_follow_recovery_and_replacement(tmp_path):
    """Rank 1 of 3 is killed: the survivor that was rank 2 becomes rank 1, and the replacement
    joins as rank 2. After every step each worker's os.environ (RANK, WORLD_SIZE, LOCAL_RANK,
    KUNGFU_SELF_SPEC, ...) is its place in the cluster it trains in, and kungfu-run prefixes
    its lines with that rank (once the launcher has read the new version: a line printed in
    between may still carry the rank before)."""
    r, records = run_elastic(tmp_path, 3, 3, "--schedule", "3", "--tail", "100000",
                             "--max-steps", "100", "--step-sleep", "0.25", "--kill", "1@4+",
                             "--stop-at-version", "2:4", "--print-ranks")
    log = r.stdout[-3000:] + r.stderr[-6000:]
    assert r.returncode == 0, log
    steps = steps_of(records)
    assert sizes_of(steps) == [3, 2, 3], steps
    for worker, rows in records.items():
        for row in rows:
            if "step" not in row or "digest" not in row:
                continue
            env, spec = row["env"], worker.replace("_", ":")
            peers = env["KUNGFU_INIT_PEERS"].split(",")
            assert (env["RANK"], env["WORLD_SIZE"], env["KUNGFU_SELF_SPEC"]) == (
                str(row["rank"]), str(row["size"]), spec), (worker, row["step"], env)
            assert peers.index(spec) == row["rank"] and len(peers) == row["size"], env
            assert (env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"]) == (env["RANK"], env["WORLD_SIZE"])
    lines = defaultdict(list)  # spec -> [(prefix, rank printed)]
    for line in r.stdout.splitlines():
        m = re.fullmatch(r"\[(\d+)\] step \d+ rank (\d+) of \d+ at (\S+)", line)
        if m:
            lines[m.group(3)].append((int(m.group(1)), int(m.group(2))))
    moved = 0
    for spec, seen in lines.items():
        for (before_prefix, before), (prefix, rank) in zip([(None, None)] + seen, seen):
            assert prefix == rank or (prefix == before_prefix and before is not None), (spec, seen)
        assert seen[-1][0] == seen[-1][1], (spec, seen)
        moved += any(rank != seen[0][1] for _, rank in seen)
    assert moved >= 1, lines  # the survivor that was rank 2 printed as rank 1
    assert sorted(p for s in lines.values() for p in {s[-1][0]}) == [0, 1, 2], lines
