"""kungfu-run -timeline DIR: every worker writes a Chrome trace of its collectives, and the
launcher merges them into DIR/timeline.json when the job ends."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from kungfu import timeline
from kungfu._ports import free_port_range

from test_launcher import PY, run_launcher, write_script  # noqa: E402 (conftest's sys.path)

pytestmark = pytest.mark.timeout(120)

# Rank 1 arrives 0.5 s late at the first allreduce: rank 0 waits for it, and says so.
WORKER = """
    import os, sys, time
    import numpy as np
    import kungfu as kf

    r = kf.rank()
    kf.barrier()
    if r == 1:
        time.sleep(0.5)
    for i in range(5):
        x = np.ones(10 ** i, dtype=np.float32)
        y = kf.allreduce(x, name=f"grad{i}")
        assert y[0] == 2.0
    b = kf.broadcast(np.arange(6, dtype=np.int64) * (r + 1), name="weights")
    assert b.tolist() == list(range(6))
    with kf.timeline.span("my-phase", step=3):
        time.sleep(0.05)
    kf.barrier(name="end")
    print("pid", os.getpid())
"""


def _ops(events, pid):
    return [e for e in events
            if e.get("ph") == "X" and e["pid"] == pid and e.get("cat") != "python"]


def test_two_workers_write_one_merged_timeline(tmp_path):
    out = tmp_path / "tl"
    ports = free_port_range(2)
    t0 = time.time()
    r = run_launcher("-np", "2", "-port-range", ports, "-timeline", str(out), PY,
                     write_script(tmp_path, "w.py", WORKER))
    t1 = time.time()
    assert r.returncode == 0, r.stdout + r.stderr
    merged = out / "timeline.json"
    assert f"timeline: {merged} (2 worker traces" in r.stderr
    with open(merged) as f:
        events = json.load(f)  # strict JSON
    pids = {int(line.split()[-1]) for line in r.stdout.splitlines() if " pid " in line}
    assert len(pids) == 2
    assert {e["pid"] for e in events} == pids
    # Each worker's own file is complete (closed at exit) and holds what the merge has.
    files = sorted(out.glob("*.trace.json"))
    assert len(files) == 2
    for p in files:
        with open(p) as f:
            assert len(json.load(f)) == len(timeline.load(str(p)))
    assert len(events) == sum(len(timeline.load(str(p))) for p in files)

    waits = {}
    for pid in pids:
        ops = _ops(events, pid)
        by_name = {e["name"]: e for e in ops}
        for i in range(5):
            e = by_name[f"grad{i}"]
            assert e["cat"] == "allreduce"
            assert e["args"]["bytes"] == 4 * 10 ** i
            assert e["args"]["strategy"] == "AUTO"
            assert e["args"]["status"] == "OK"
            assert e["args"]["seq"] == 0
        assert by_name["weights"]["cat"] == "broadcast"
        assert by_name["weights"]["args"]["bytes"] == 48
        barriers = [e for e in ops if e["cat"] == "barrier"]
        assert {e["name"] for e in barriers} == {"kungfu::barrier", "end"}
        for e in ops:
            assert t0 * 1e6 <= e["ts"] and e["ts"] + e["dur"] <= t1 * 1e6
            assert 0 <= e["dur"] < (t1 - t0) * 1e6
            assert 0 <= e["args"]["wait_us"] <= e["dur"] and e["args"]["queue_us"] >= 0
        # Events of one track never overlap.
        by_tid = {}
        for e in ops:
            by_tid.setdefault(e["tid"], []).append(e)
        for track in by_tid.values():
            track.sort(key=lambda e: e["ts"])
            for a, b in zip(track, track[1:]):
                assert a["ts"] + a["dur"] <= b["ts"]
        span = [e for e in events if e["pid"] == pid and e.get("name") == "my-phase"]
        assert len(span) == 1 and span[0]["args"] == {"step": 3}
        assert 40000 <= span[0]["dur"] < 5e6
        names = [e for e in events if e["pid"] == pid and e.get("ph") == "M"
                 and e["name"] == "process_name"]
        assert names and names[-1]["args"]["name"].startswith("worker rank ")
        # grad0 is fused (tensor fusion): it waits for the late worker in the fusion queue.
        g = by_name["grad0"]["args"]
        waits[names[-1]["args"]["name"].split()[2]] = g["queue_us"] + g["wait_us"]
    # Rank 0 waited for rank 1, 0.5 s late; rank 1 found rank 0's op there already.
    assert waits["0"] >= 300000, waits
    assert waits["1"] < 200000, waits


def test_no_timeline_without_the_flag(tmp_path):
    ports = free_port_range(2)
    script = write_script(tmp_path, "w.py", """
        import os, kungfu as kf
        kf.barrier()
        print(sorted(k for k in os.environ if k == "KUNGFU_TIMELINE"))
    """)
    r = run_launcher("-np", "2", "-port-range", ports, PY, script)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "[0] []" in r.stdout and "kungfu-run: timeline" not in r.stderr


@pytest.mark.timeout(150)
def test_events_survive_resizes(tmp_path):
    """A job that grows 2 -> 3 and shrinks to 1 (test_custom_resize's loop): each resize
    replaces the native peer, and no event of the old one is lost."""
    from test_custom_resize import check_grow_then_shrink, run  # noqa: E402

    out = tmp_path / "tl"
    r, workers = run(tmp_path, "resize", "3:3,8:1", flags=("-timeline", str(out)))
    check_grow_then_shrink(r, workers)
    with open(out / "timeline.json") as f:
        events = json.load(f)
    pids = {e["pid"] for e in events}
    assert len(pids) == 3
    grads = [e for e in events if e.get("name") == "grad" and e.get("ph") == "X"]
    # Steps 0-2 at size 2, 3-7 at size 3, 8-11 at size 1: one allreduce per member and step.
    assert len(grads) == 2 * 3 + 3 * 5 + 1 * 4
    assert all(e["args"]["status"] == "OK" and e["args"]["bytes"] == 32 for e in grads)
    survivor = max(pids, key=lambda p: sum(e["pid"] == p for e in grads))
    mine = sorted((e for e in grads if e["pid"] == survivor), key=lambda e: e["ts"])
    assert len(mine) == 12
    # Each version's peer numbers the name from 0 again: 3 steps, 5, then 4.
    assert [e["args"]["seq"] for e in mine] == [0, 1, 2, 0, 1, 2, 3, 4, 0, 1, 2, 3]
    labels = [e["args"]["name"] for e in events
              if e["pid"] == survivor and e.get("name") == "process_name"]
    assert [lab.split("(version ")[1].split(",")[0] for lab in labels] == ["0", "1", "2"], labels


def test_a_failed_job_is_merged_too(tmp_path):
    """Rank 1 fails after one allreduce: kungfu-run exits with its code, and still merges what
    the workers wrote (rank 1's file, closed by its exit handlers, has the allreduce)."""
    out = tmp_path / "tl"
    ports = free_port_range(2)
    script = write_script(tmp_path, "w.py", """
        import os, sys, time
        import numpy as np
        import kungfu as kf

        kf.allreduce(np.ones(3, dtype=np.float64), name="before")
        print("pid", os.getpid())
        if kf.rank() == 1:
            sys.exit(3)
        time.sleep(30)
    """)
    r = run_launcher("-np", "2", "-port-range", ports, "-timeline", str(out), PY, script)
    assert r.returncode == 3, r.stdout + r.stderr
    assert f"timeline: {out / 'timeline.json'}" in r.stderr
    with open(out / "timeline.json") as f:
        events = json.load(f)
    (line,) = [line for line in r.stdout.splitlines() if line.startswith("[1] pid")]
    pid1 = int(line.split()[-1])
    (before,) = [e for e in _ops(events, pid1) if e["name"] == "before"]
    assert before["cat"] == "allreduce" and before["args"]["bytes"] == 24
    assert before["args"]["status"] == "OK"
