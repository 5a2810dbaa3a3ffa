"""examples/keras_callbacks.py run as a user runs it: `kungfu-run -np 2`, and `kungfu-run -w -np 3`
with a worker killed (SIGKILL) in the middle of an epoch.

Each run checks what the example promises: exit code 0, the same final weights on every rank
that finished, one CSV file with one row per epoch, one TensorBoard run, the ModelCheckpoint file,
the BackupAndRestore backup removed at the end, and the same ReduceLROnPlateau and EarlyStopping
decisions on every rank.
"""
from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import free_port_range, free_ports  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "examples" / "keras_callbacks.py"

pytestmark = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("tensorflow", "keras", "sklearn")),
    reason="the example needs tensorflow, keras and scikit-learn")

# Small enough for a loaded 2-core machine; lr 0.1 per worker makes the validation loss stall,
# so that ReduceLROnPlateau (patience 1) lowers the rate at least once.
ARGS = ("--epochs", "10", "--lr", "0.1", "--patience", "1")
FINAL = re.compile(r"rank (\d+): final weights digest ([0-9a-f]{16}), learning rates ([0-9.e,-]+),"
                   r" then ([0-9.e-]+), early stop at epoch (\w+)")


def run(out: Path, launcher: list, *args: str, timeout: float = 170):
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUNGFU_")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in [env.get("PYTHONPATH")] if p])
    env["TF_CPP_MIN_LOG_LEVEL"] = "3"
    env["PYTHONUNBUFFERED"] = "1"
    cmd = [sys.executable, "-m", "kungfu.cmd", *launcher, "-timeout", f"{int(timeout) - 10}s",
           sys.executable, str(SCRIPT), "--out", str(out), *ARGS, *args]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=str(REPO),
                       timeout=timeout, check=False)
    assert r.returncode == 0, f"{cmd} exited with {r.returncode}\n{r.stdout[-4000:]}\n" \
                              f"{r.stderr[-6000:]}"
    return r


def check_run(out: Path, stdout: str, ranks: int) -> list:
    """The checks every run shares; returns the learning rate of every epoch and the one
    after training, and the epoch EarlyStopping stopped at ("none")."""
    finals = FINAL.findall(stdout)
    assert len(finals) >= ranks, f"fewer than {ranks} ranks printed their result:\n{stdout}"
    assert len({f[1] for f in finals}) == 1, f"the final weights differ: {finals}"
    # A worker that joined later has the last epochs only: every rank's rates end the same.
    rates = max((f[2].split(",") for f in finals), key=len)
    for _, _, mine, last, stopped in finals:
        mine = mine.split(",")
        assert mine == rates[len(rates) - len(mine):], f"learning rates differ: {finals}"
        assert (last, stopped) == finals[0][3:], f"the callbacks decided differently: {finals}"
    csvs = list(out.glob("*.csv"))
    assert [p.name for p in csvs] == ["training.csv"], csvs
    rows = csvs[0].read_text().splitlines()
    assert rows[0].startswith("epoch,") and [r.split(",")[0] for r in rows[1:]] == [
        str(e) for e in range(len(rates))], rows
    runs = sorted(p.relative_to(out / "tensorboard").as_posix()
                  for p in (out / "tensorboard").rglob("events.out.tfevents.*"))
    assert [os.path.dirname(p) for p in runs] == ["train", "validation"], runs
    assert (out / "best.keras").is_file() and (out / "best.keras").stat().st_size > 0
    assert not (out / "backup").exists(), "BackupAndRestore leaves no backup after training"
    return [float(x) for x in rates] + [float(finals[0][3])], finals[0][4]


@pytest.mark.timeout(200)
def test_two_workers(tmp_path):
    r = run(tmp_path, ["-np", "2", "-port-range", free_port_range(2)])
    rates, stopped = check_run(tmp_path, r.stdout, 2)
    # lr 0.1 x 2, lowered by ReduceLROnPlateau; EarlyStopping stops before the 10th epoch.
    assert rates[0] == pytest.approx(0.2) and rates[-1] < rates[0], rates
    assert stopped != "none" and len(rates) - 1 < 10, (rates, stopped)


# 1437 samples, 3 x 32 a step: 15 steps per epoch. Killed after step 30, the last of epoch 2:
# the survivors find it gone while they combine the epoch's metrics, and recover there, before
# the callbacks decide. (Killed in the middle of an epoch: the warm spare's test below.)
@pytest.mark.timeout(200)
def test_three_workers_one_killed_at_an_epochs_end(tmp_path):
    kill = "2@30"
    launcher = ["-w", "-np", "3", "-H", "127.0.0.1:3", "-port-range", free_port_range(3),
                "-builtin-config-port", str(free_ports(1)[0])]
    r = run(tmp_path, launcher, "--kill-self", kill)
    assert f"worker {kill[0]} (127.0.0.1:" in r.stderr and "killed by SIGKILL" in r.stderr, \
        r.stderr
    assert "metrics not combined" not in r.stderr, r.stderr
    assert "survived" in r.stderr, r.stderr[-3000:]
    rates, _ = check_run(tmp_path, r.stdout, 2)
    assert rates[0] == pytest.approx(0.3), rates
    assert (tmp_path / "killed").exists()


@pytest.mark.timeout(200)
def test_a_replacement_from_a_warm_spare_ends_with_the_same_weights(tmp_path):
    """Worker 1 killed after step 20, in the middle of epoch 2; the survivors go on, and a warm
    spare (-spares 1) takes its place and trains to the end. The joiner gets rank 0's weights
    and callback counters (ReduceLROnPlateau's wait and best): its BackupAndRestore must not
    restore an older backup over them, nor its callbacks start over. Every rank, the
    replacement too, ends with the same weights and learning rates."""
    launcher = ["-w", "-np", "3", "-H", "127.0.0.1:4", "-port-range", free_port_range(4),
                "-builtin-config-port", str(free_ports(1)[0]), "-spares", "1"]
    r = run(tmp_path, launcher, "--kill-self", "1@20", "--patience", "30", "--epochs", "16")
    assert re.search(r"spare 0, started [\d.]+s ago, is worker \d \(127\.0\.0\.1:\d+\) in "
                     r"place of the lost one", r.stderr), r.stderr[-3000:]
    assert "worker 1 (127.0.0.1:" in r.stderr and "killed by SIGKILL" in r.stderr, r.stderr
    assert "metrics not combined" not in r.stderr, r.stderr
    assert "survived" in r.stderr, r.stderr[-3000:]
    rates, _ = check_run(tmp_path, r.stdout, 3)  # the replacement's result too
    assert rates[0] == pytest.approx(0.3), rates
    assert (tmp_path / "killed").exists()
