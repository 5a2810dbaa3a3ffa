"""kf.resize without kf.Hook: a custom loop (numpy only, _w_custom_resize.py) that grows and
shrinks under kungfu-run -w through kungfu.python.resize(n), or propose_new_size(n) then
resize(), and syncs its own state the KungFu way."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from conftest import free_port_block, free_port_range, free_ports  # noqa: E402

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


def run(tmp_path, mode: str, schedule: str, np_: int = 2, slots: int = 3, flags=(), ports=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUNGFU_")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in [env.get("PYTHONPATH")] if p])
    env["KUNGFU_RESIZE_TIMEOUT"] = "60"
    cmd = [sys.executable, "-m", "kungfu.cmd", "-w", "-np", str(np_), "-H", f"127.0.0.1:{slots}",
           "-builtin-config-port", str(free_ports(1)[0]),
           "-port-range", ports or free_port_range(slots),
           "-timeout", "100s", *flags, sys.executable, str(HERE / "_w_custom_resize.py"),
           str(tmp_path), mode, schedule]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=str(REPO), timeout=120,
                       check=False)
    workers = [[json.loads(line) for line in f.read_text().splitlines()]
               for f in tmp_path.glob("*.jsonl")]
    return r, workers


def check_grow_then_shrink(r, workers):
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    assert len(workers) == 3, (workers, r.stderr[-5000:])  # 2 initial workers and 1 joiner
    by_step = defaultdict(list)
    for rows in workers:
        for row in rows[:-1]:
            by_step[row["step"]].append(row)
    # Every step ran once on each member, at the size the schedule gives, and the state (w)
    # is the same on every worker: +1 per step whatever the size, so the joiner took it.
    assert sorted(by_step) == list(range(12))
    for step, rows in by_step.items():
        size = 2 if step < 3 else 3 if step < 8 else 1
        assert len(rows) == size and {row["size"] for row in rows} == {size}, (step, rows)
        assert sorted(row["rank"] for row in rows) == list(range(size)), (step, rows)
        assert {row["w"] for row in rows} == {step + 1.0}, (step, rows)
    joiner = [rows for rows in workers if rows[0]["step"] != 0]
    assert len(joiner) == 1 and joiner[0][0]["step"] == 3
    ends = sorted(rows[-1]["end"] for rows in workers)
    assert ends == ["detached", "detached", "done"], ends
    done = next(rows[-1] for rows in workers if rows[-1]["end"] == "done")
    assert done == {"end": "done", "w": 12.0, "size": 1}


@pytest.mark.timeout(150)
def test_custom_loop_resizes_without_a_hook(tmp_path):
    check_grow_then_shrink(*run(tmp_path, "resize", "3:3,8:1"))


@pytest.mark.timeout(150)
def test_propose_new_size_then_resize(tmp_path):
    check_grow_then_shrink(*run(tmp_path, "propose", "3:3,8:1"))


@pytest.mark.timeout(150)
def test_a_joiner_that_cannot_listen_fails_before_the_switch(tmp_path):
    """The joiner cannot listen (its address's local socket is taken: its TCP port the launcher
    holds for it): it fails before it reports itself ready, so the resize is abandoned and the
    others go on at their size (before, it reported ready first, the others switched to it and
    waited for it until the connect deadline)."""
    base = free_port_block(3)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as taken:
        taken.bind(f"\0kungfu-127.0.0.1:{base + 2}")  # the joiner's slot (net.cc, UnixAddress)
        taken.listen()
        r, workers = run(tmp_path, "resize", "3:3,8:1", ports=f"{base}-{base + 2}")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    assert f"cannot listen on the local socket of 127.0.0.1:{base + 2}" in r.stderr
    assert "before the cluster switched to it; its resize will be abandoned" in r.stderr
    started = [rows for rows in workers if rows]
    assert len(workers) == 3 and len(started) == 2  # the joiner logged nothing
    sizes = {row["step"]: row["size"] for rows in started for row in rows[:-1]}
    assert sizes == {step: 2 if step < 8 else 1 for step in range(12)}
    assert sorted(rows[-1]["end"] for rows in started) == ["detached", "done"]


def test_a_taken_port_of_a_later_slot_stops_the_launch_at_once(tmp_path):
    """A port of -port-range that a later version would use is taken before the launch: the
    elastic launcher, which holds every slot's port of its host for the whole job, refuses to
    start, naming it, before any worker runs (rather than a joiner failing there later)."""
    base = free_port_block(3)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", base + 2))
        taken.listen()
        r, workers = run(tmp_path, "resize", "3:3,8:1", ports=f"{base}-{base + 2}")
    assert r.returncode == 2, r.stdout[-3000:] + r.stderr[-5000:]
    assert f"cannot listen on 127.0.0.1:{base + 2}" in r.stderr and "-port-range" in r.stderr
    assert workers == []


@pytest.mark.timeout(150)
def test_workers_that_ask_for_different_sizes_are_refused_together(tmp_path):
    r, workers = run(tmp_path, "disagree", "3:2")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    assert len(workers) == 2
    for rows in workers:
        assert [row["step"] for row in rows[:-1]] == [0, 1, 2]
        assert rows[-1]["end"].startswith("refused: kf.resize outside kf.Hook is a collective"), rows


@pytest.mark.timeout(150)
def test_a_worker_is_replaced_by_a_new_one_even_rank_0(tmp_path):
    """kf.resize(size, leave=[0]) after step 4: a new worker joins, then rank 0 leaves; the
    other becomes rank 0 and hands the state to the new one."""
    r, workers = run(tmp_path, "replace", "4:0")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    assert len(workers) == 3
    first = {rows[0]["rank"]: rows for rows in workers if rows[0]["step"] == 0}
    [joiner] = [rows for rows in workers if rows[0]["step"] != 0]
    assert [row["step"] for row in first[0][:-1]] == [0, 1, 2, 3]
    assert first[0][-1]["end"] == "detached"
    assert [row["step"] for row in joiner[:-1]] == list(range(4, 12))
    assert [row["rank"] for row in joiner[:-1]] == [1] * 8  # after the old rank 1, now rank 0
    assert [row["rank"] for row in first[1][:-1]] == [1] * 4 + [0] * 8
    for rows in (first[1], joiner):
        assert [row["w"] for row in rows[:-1]] == [float(s + 1) for s in
                                                   range(rows[0]["step"], 12)]
        assert rows[-1] == {"end": "done", "w": 12.0, "size": 2}
