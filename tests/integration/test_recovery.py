"""Recovery: workers of an elastic job killed (SIGKILL) or stopped (SIGSTOP) in model.fit; the
survivors go on. Real processes under kungfu-run -w, elastic_train.py (next to this file) with a
fixed size; every worker records each step it trained.

Each run checks what a user is promised: the job finishes with exit code 0 and says what it
survived, every sample of every epoch is trained exactly once (the failed step's batch is redone
by the survivors), the survivors' weights are bit-identical after every step (leaving out the
records of a step that a recovery undid: conftest.steps_of), and each survivor recovered once,
without the lost peer.

These runs check what is TensorFlow's and Keras's: a failure inside model.fit's train function
or a tf.function step, the weights and optimizer state a recovery restores and broadcasts, a
replacement's rehearsal of the train function, Keras checkpoints. The recovery protocol itself
(who is left out, stopped and hung workers, joiners, restarts, the host cool-down, the launcher's
errors) is the same Loop's with any framework: test_recovery_numpy.py runs it with numpy
workers, which start in a second.
"""
from __future__ import annotations

import re
from collections import defaultdict

import pytest

pytest.importorskip("tensorflow")

from conftest import (SAMPLES, check_epochs, run_elastic, run_recovered, sizes_of,  # noqa: E402
                      steps_of)

# 240 samples, batch 8: 10 steps per epoch at 3 workers, 8 per epoch at 4 (the last one short).
STEPS = 24


def _recovered(tmp_path, np_: int, *faults: str, **kw):
    """conftest.run_recovered of elastic_train.py (its policy keeps the size)."""
    return run_recovered(tmp_path, np_, STEPS, "--schedule", str(np_), "--tail", "1000", *faults,
                         **kw)


@pytest.mark.timeout(200)
def test_a_middle_rank_killed_during_a_step(tmp_path):
    _, records, finals = _recovered(tmp_path, 3, "--kill", "1@6")
    lost = finals[0]["recoveries"][0]["lost"][0]
    rows = records[lost.replace(":", "_")]
    assert rows[-1]["fault"] == 9 and rows[-2]["step"] in (5, 6), rows[-2:]  # killed in step 6
    assert rows[0]["rank"] == 1


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


@pytest.mark.timeout(200)
def test_a_custom_loop_survives_with_hook_guard(tmp_path):
    # A GradientTape loop over data.epoch_batches() with the step (a tf.function) wrapped by
    # hook.guard; rank 1 killed after step 5: the survivors fail in the guarded step (the next
    # step's gradient allreduce). (A kill between a custom loop's training step and its
    # agreement is the Loop's protocol: test_recovery_numpy.py.)
    _, records, finals = _recovered(tmp_path, 3, "--kill", "1@5+", "--custom-loop")
    # The custom loop ran (no Keras train function), and the survivors rolled back to the last
    # step every one of them had committed.
    assert all(row["traces"] is None for rows in steps_of(records).values() for row in rows)
    assert {f["recoveries"][0]["step"] for f in finals} == {5}, finals


@pytest.mark.timeout(300)
def test_lost_workers_are_replaced(tmp_path):
    """The default: after the recovery rank 0 asks for the size before the failure; the
    launcher starts a new worker in the freed slot, which joins as in a resize. Steps are
    slowed down so that it has time to start (TensorFlow's import) before training ends.

    Rank 1 of 3 is killed: the survivor that was rank 2 becomes rank 1, and the replacement
    joins as rank 2. After every step each worker's os.environ (RANK, WORLD_SIZE, LOCAL_RANK,
    KUNGFU_SELF_SPEC, ...) is its place in the cluster it trains in, and kungfu-run prefixes
    its lines with that rank (once the launcher has read the new version: a line printed in
    between may still carry the rank before)."""
    r, records = run_elastic(tmp_path, 3, 3, "--schedule", "3", "--tail", "100000",
                             "--max-steps", "100", "--step-sleep", "0.25", "--kill", "1@5+",
                             "--stop-at-version", "2:5",  # 5 steps after the replacement joined
                             "--print-ranks")
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
    # The ranks in os.environ and in kungfu-run's prefixes.
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
