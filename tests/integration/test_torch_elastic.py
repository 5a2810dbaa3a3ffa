"""kungfu.torch.ElasticTrainer in real elastic jobs (kungfu-run -w, _w_torch_elastic.py): a
PyTorch loop that grows and shrinks by a policy's kf.resize, and one that loses a worker
(SIGKILL) and goes on with the survivors. Each run checks what a user is promised: exit code 0,
every step trained once by every member with bit-identical weights after it, every sample of
every epoch trained exactly once across the resizes and the failure."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="kungfu.torch needs torch (pip install kungfu[torch])")

from conftest import free_port_range, free_ports, sizes_of, steps_of  # noqa: E402

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
SAMPLES = 240


def run(tmp_path, np_: int, slots: int, *args: str, launcher_args=()):
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUNGFU_")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in [env.get("PYTHONPATH")] if p])
    out = tmp_path / "records"
    out.mkdir()
    cmd = [sys.executable, "-m", "kungfu.cmd", "-w", "-np", str(np_), "-H", f"127.0.0.1:{slots}",
           "-builtin-config-port", str(free_ports(1)[0]), "-port-range", free_port_range(slots),
           "-timeout", "150s", *launcher_args, sys.executable, str(HERE / "_w_torch_elastic.py"),
           str(out), *args]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=str(REPO), timeout=170,
                       check=False)
    records = {f.stem: [json.loads(line) for line in f.read_text().splitlines()]
               for f in out.glob("*.jsonl")}
    return r, records


def check_training(r, records):
    """Exit 0; steps 1..N each trained by its members with the same weights after it; each
    epoch's steps trained every sample exactly once. Returns (steps, the "done" rows)."""
    log = r.stdout[-3000:] + r.stderr[-6000:]
    assert r.returncode == 0, log
    steps = steps_of(records)
    assert sorted(steps) == list(range(1, len(steps) + 1)), log
    sizes_of(steps)  # the same digest on every member of each step
    by_epoch = {}
    for rows in steps.values():
        assert len({row["epoch"] for row in rows}) == 1, rows
        assert {row["size"] for row in rows} == {len(rows)}, rows
        by_epoch.setdefault(rows[0]["epoch"], []).extend(i for row in rows for i in row["served"])
    assert sorted(by_epoch) == [0, 1, 2], sorted(by_epoch)
    for epoch, served in by_epoch.items():
        assert sorted(served) == list(range(SAMPLES)), f"epoch {epoch}"
    done = [rows[-1] for rows in records.values() if rows and "done" in rows[-1]]
    last = steps[len(steps)]
    for d in done:
        assert d["step"] == len(steps) and d["epoch"] == 3 and d["digest"] == last[0]["digest"]
    return steps, done


@pytest.mark.timeout(200)
def test_a_torch_loop_grows_and_shrinks_by_its_policy(tmp_path):
    r, records = run(tmp_path, 2, 3, "--schedule", "3,2", "--gap", "3")
    steps, done = check_training(r, records)
    assert sizes_of(steps) == [2, 3, 2], r.stderr[-3000:]
    # The joiner took rank 0's model and optimizer state: its first step's weights are the
    # others' (checked above), and it trained from the step after the switch on.
    joiner = [rows for rows in records.values() if rows[0]["step"] > 1]
    assert len(joiner) == 1 and joiner[0][0]["size"] == 3
    assert len(done) == 2 and {d["size"] for d in done} == {2}  # one left at the shrink
    assert all(d["recoveries"] == [] for d in done)
    assert done[0]["logs"]["cluster_size"] == 2 and "samples_per_sec" in done[0]["logs"]


@pytest.mark.timeout(200)
def test_a_torch_loop_survives_a_killed_worker(tmp_path):
    r, records = run(tmp_path, 3, 3, "--kill", "1@5", launcher_args=("-replace=false",))
    steps, done = check_training(r, records)
    assert sizes_of(steps) == [3, 2], r.stderr[-3000:]
    assert len(done) == 2, r.stderr[-3000:]
    for d in done:
        [rec] = d["recoveries"]
        assert len(rec["lost"]) == 1 and rec["size"] == 2 and rec["step"] == 4, rec
    assert "survived" in r.stderr
