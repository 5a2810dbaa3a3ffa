"""Keras habits under kf.Hook, round 2: a custom train_step as the Keras guide writes it,
BackupAndRestore, CSVLogger and TensorBoard writing once, and the progress bar after a resume
(issue 25). Real processes; worker bodies in _w_keras_2.py."""
from __future__ import annotations

import pytest

pytest.importorskip("tensorflow")

import _w_keras_2 as w  # noqa: E402

ENV = {"TF_CPP_MIN_LOG_LEVEL": "3"}


@pytest.fixture(scope="module")
def guide_step(session_spawn):
    return session_spawn(2, w.guide_train_step, env=ENV, timeout=150)


def test_the_batch_size_of_a_guide_train_step_is_its_data(guide_step):
    # The guide's step counts its loss once per step: the batch is read from the data.
    for r in guide_step:
        assert r["local_batch"] == 32
        assert r["global_batch"] == [64.0] * len(r["global_batch"])


def test_the_metrics_of_a_guide_train_step_are_combined(guide_step):
    # Rank 1's labels are noise: from its own loss ReduceLROnPlateau would decide otherwise.
    r0, r1 = guide_step
    assert r0["loss"] == r1["loss"]
    assert r0["lr"] == r1["lr"] and r0["weights"] == r1["weights"]


def _elastic(tmp_path, np_: int, *args: str, timeout: float = 150):
    """_w_keras_2.py's main under kungfu-run -w (no replacement of a lost worker); returns the
    launcher's result and each survivor's JSON."""
    import json
    import os
    import subprocess
    import sys

    from conftest import HERE, REPO_ROOT, free_port_range, free_ports

    env = {k: v for k, v in os.environ.items() if not k.startswith("KUNGFU_")}
    env["PYTHONPATH"] = os.pathsep.join([REPO_ROOT, HERE] + [p for p in [env.get("PYTHONPATH")]
                                                             if p])
    env.update(ENV)
    out = tmp_path / "out"
    out.mkdir()
    cmd = [sys.executable, "-m", "kungfu.cmd", "-w", "-np", str(np_), "-H", f"127.0.0.1:{np_}",
           "-builtin-config-port", str(free_ports(1)[0]), "-port-range", free_port_range(np_),
           "-timeout", f"{int(timeout) - 10}s", "-replace=false",
           sys.executable, os.path.join(HERE, "_w_keras_2.py"), "--out", str(out), *args]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO_ROOT,
                       timeout=timeout, check=False)
    return r, [json.loads(f.read_text()) for f in sorted(out.glob("*.json"))]


@pytest.mark.timeout(200)
def test_a_guide_train_step_survives_a_kill_in_the_hooks_agreement(tmp_path):
    # Rank 1 dies after its step 3, before the Hook's agreement of it: the survivor fails in
    # that agreement, trains step 3 again and takes its logs (the compiled metrics' entry of
    # this step's logs is a dict).
    r, results = _elastic(tmp_path, 2, "--kill-rank", "1", "--kill-step", "3")
    log = r.stdout[-3000:] + r.stderr[-6000:]
    assert r.returncode == 0, log
    assert "survived" in r.stderr, log
    [survivor] = results
    assert survivor["size"] == 1 and survivor["recoveries"] == 1, survivor
    # 256 samples an epoch: 2 steps of 2 x 16, then steps of 16 alone (the failed step too),
    # and a second epoch of 16 steps.
    assert survivor["step"] == 2 + 12 + 16, survivor


def test_csv_logger_and_tensorboard_write_once(spawn, tmp_path):
    r0, r1 = spawn(2, w.csv_and_tensorboard, str(tmp_path), env=ENV, timeout=150)
    assert r0["shared"] == r1["shared"] and r0["events"] == r1["events"]
    # One header and a row per epoch (two ranks appending gave four rows), one event file.
    assert [row[0] for row in r0["shared"]] == ["epoch", "0", "1"], r0["shared"]
    assert len(r0["events"]) == 1, r0["events"]
    # A file per worker stays each worker's, and so does a callback only rank 0 was given.
    for key in ("own", "first"):
        assert [row[0] for row in r0[key]] == ["epoch", "0", "1"], r0[key]


def test_backup_and_restore_writes_on_rank_0_and_restores_every_rank(spawn, tmp_path):
    r0, r1 = spawn(2, w.backup_and_restore, str(tmp_path), env=ENV, timeout=150)
    assert r0["wrote"] and r1["wrote"] == [], (r0["wrote"], r1["wrote"])
    assert "shutil.rmtree" in r0["wrote"]  # the second fit's end deletes the backup
    for r in (r0, r1):  # the second fit went on from the backup's epoch 2
        assert (r["first"], r["second"], r["left"]) == (2, 2, False), r
    assert r0["weights"] == r1["weights"]


def _totals(printed: str):
    """The epochs ("Epoch e/E") and, for each, the count of the progress bar's last line (its
    total at the epoch's end, "n/n" when the bar's total was the epoch's steps)."""
    import re

    printed = re.sub(r"\x1b\[[0-9;]*m", "", printed)  # the bar's colours
    parts = re.split(r"(Epoch \d+/\d+)", printed)[1:]
    return parts[0::2], [re.findall(r"(\d+/\d+) ", body)[-1] for body in parts[1::2]]


def test_the_progress_bar_after_a_resume_counts_the_jobs_epochs_and_steps(spawn, tmp_path):
    printed, _ = spawn(2, w.resumed_progress, str(tmp_path), env=ENV, timeout=150)
    # The resumed job goes on in epoch 2 of 3 (the first job stopped 3 steps into it): 7 steps
    # left there, then 10 (before: "Epoch 1/3", and the last epoch counted 7 steps).
    assert _totals(printed) == (["Epoch 2/3", "Epoch 3/3"], ["7/7", "10/10"]), printed


@pytest.mark.timeout(200)
def test_a_model_keras_builds_on_its_first_batch_resumes(spawn, tmp_path):
    """Horovod's example model (a Sequential without keras.Input) resumes from its checkpoint:
    it is built from a sample of kf.ElasticData first. The checkpoint's folder was made; the
    checkpoint's per-worker batch size (4) wins over the script's (8), and the resume says so.
    Over plain arrays (nothing to build it from) the error says how to build it."""
    ckpt = tmp_path / "runs" / "one" / "train.ckpt"
    outs = spawn(2, w.resume_unbuilt, str(tmp_path), env=ENV, timeout=170)
    for rank, out in enumerate(outs):
        assert out["resumed"] == outs[0]["written"] == out["written"], (rank, out)
        assert out["step"] == 8 and out["batch"] == 4, (rank, out)
        assert f"kungfu: resumed from {ckpt} at step 5 (epoch 0, 40 samples into it); batch " \
               "size 4 per worker, the checkpoint's (the script's 8 is not used" \
               in out["printed"], (rank, out["printed"])
        assert out["plain"].startswith("kungfu: this model has 0 variables to sync, the "
                                       f"checkpoint {ckpt} has 26: build the same model and "
                                       "optimizer (Keras builds this model's variables on its "
                                       "first batch"), (rank, out["plain"])
        assert "keras.Input(shape)" in out["plain"] and "kf.ElasticData" in out["plain"]


@pytest.mark.timeout(200)
def test_the_progress_bar_after_a_resize_counts_each_epochs_steps(tmp_path):
    # 256 samples: 3 steps of 2 x 16, then (shrunk to 1 worker) 10 of 16; then 16 (before:
    # the second epoch's bar kept the first epoch's 13).
    r, results = _elastic(tmp_path, 2, "--kill-rank", "-1", "--shrink-at", "3")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    [stayed] = results
    assert stayed["step"] == 3 + 10 + 16, stayed
    assert _totals(stayed["printed"]) == (["Epoch 1/2", "Epoch 2/2"], ["13/13", "16/16"]), \
        stayed["printed"]


@pytest.mark.parametrize("hook", [True, False])
def test_uneven_shards_fail_at_once_naming_each_workers_steps(spawn, hook):
    """A worker with a batch more waited in its last step until the op deadline; now model.fit
    fails before the first step, on every worker, saying who has how many steps."""
    outs = spawn(2, w.uneven_shards, hook, env={**ENV, "KUNGFU_OP_TIMEOUT": "60s"}, timeout=120)
    for o in outs:
        assert "different numbers of steps per epoch (rank 0: 4, rank 1: 5)" in o["error"]
        assert o["seconds"] < 30


def test_learning_rates_that_drift_apart_fail_every_worker_at_once(spawn):
    """A rate changed on one worker only would train each to other weights, silently: the
    workers agree on their rates after each epoch end and fail together, naming them."""
    outs = spawn(2, w.drifting_learning_rate, env=ENV, timeout=120)
    for o in outs:
        assert o["error"] is not None and "the workers' learning rates differ (0.1 on rank 0; " \
            "0.05 on rank 1)" in o["error"], o
        # 4 steps an epoch: the check after epoch 2's first step (the Hook's, before the
        # others' on_train_batch_end).
        assert o["steps"] == 8 and o["seconds"] < 30, o


def test_validation_shares_cover_the_validation_set_once(spawn):
    outs = spawn(2, w.validation_shares, env=ENV, timeout=120)
    assert [o["rows"] for o in outs] == [list(range(19)), list(range(19, 37))]
    for o in outs:
        assert o["val_loss"] == pytest.approx(o["whole"], rel=1e-5)
