"""Changing an elastic job's membership from outside: a PUT of a new cluster to kungfu-run's
builtin config store, in KungFu's JSON, as KungFu's config server takes it. A real
`kungfu-run -w` job (a numpy custom loop, _w_custom_resize.py in mode "outside") is grown from 2 to 3 workers and
shrunk to 1 by PUTs from the test; requests that kf.resize's checks refuse get a clear HTTP
error and change nothing."""
from __future__ import annotations

import contextlib
import json
import os
import secrets
import subprocess
import sys
import time
import types
import urllib.error
import urllib.request
from collections import defaultdict
from pathlib import Path

import pytest

from conftest import sizes_of, steps_of
from kungfu._ports import free_port_range, free_ports

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
TOKEN = secrets.token_hex(16)
LOCALHOST = 2130706433  # 127.0.0.1 as KungFu's IPv4 integer


def put(url: str, body, token: str = TOKEN):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method="PUT")
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def get(url: str):
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())


def workers(*ports):
    return {"Runners": [], "Workers": [{"IPv4": LOCALHOST, "Port": p} for p in ports]}


def rows_of(out: Path):
    return [[json.loads(line) for line in f.read_text().splitlines() if line.strip()]
            for f in sorted(out.glob("*.jsonl"))]


def wait_for(what: str, cond, proc, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        if proc.poll() is not None:
            raise AssertionError(f"the job ended ({proc.returncode}) before {what}")
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


@contextlib.contextmanager
def launched(tmp_path, np_: int, slots: int, script: list, timeout: int):
    """kungfu-run -w with a builtin config store, for the with-block: a namespace of proc, out
    (the OUT folder), url (/config), first (the first worker port); text (the launcher's
    output) once the block ends, when the job is also killed if it still runs."""
    out = tmp_path / "out"
    out.mkdir()
    port = free_ports(1)[0]
    first = int(free_port_range(slots).split("-")[0])
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUNGFU_")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in [env.get("PYTHONPATH")] if p])
    env["KUNGFU_RESIZE_TIMEOUT"] = "120"
    env["KUNGFU_JOB_TOKEN"] = TOKEN
    cmd = [sys.executable, "-m", "kungfu.cmd", "-w", "-np", str(np_), "-H", f"127.0.0.1:{slots}",
           "-builtin-config-port", str(port), "-port-range", f"{first}-{first + slots - 1}",
           "-timeout", f"{timeout}s", sys.executable, str(HERE / script[0]),
           *[str(out) if a == "OUT" else a for a in script[1:]]]
    log = open(tmp_path / "launcher.log", "w+")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=str(REPO))
    job = types.SimpleNamespace(proc=proc, out=out, url=f"http://127.0.0.1:{port}/config",
                                first=first, text="")
    try:
        yield job
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.seek(0)
        job.text = log.read()


@pytest.mark.timeout(180)
def test_a_put_grows_and_shrinks_a_running_job(tmp_path):
    with launched(tmp_path, 2, 3, ["_w_custom_resize.py", "OUT", "outside", "0:0"], 150) as job:
        proc, out, url, first = job.proc, job.out, job.url, job.first
        wait_for("step 2", lambda: any(r and r[-1].get("step", -1) >= 2 for r in rows_of(out)),
                 proc)
        assert get(url)["Version"] == 0
        assert [w["Port"] for w in get(url)["Workers"]] == [first, first + 1]

        # Refused, with the reason, and nothing changes.
        refused = [
            (put(url, workers(first, first + 1, first + 2, first + 3)), 400,
             "cannot resize to 4 workers: the job has 1 to 3 slots"),
            (put(url, {"Workers": [{"IPv4": LOCALHOST, "Port": first},
                                   {"IPv4": 2130706434, "Port": first}]}), 400,
             f"127.0.0.2:{first} is not a slot of this job"),
            (put(url, dict(workers(first, first + 1, first + 2), Version=5)), 409,
             "version 5 is not the next one: the stored cluster is version 0 (expected 1)"),
            (put(url, workers(first + 2, first)), 400, "the first worker (rank 0) must be a "
             "current one"),
            (put(url, workers(first, first + 1)), 400, "version 0 has these workers already"),
            (put(url, workers(first, first)), 400, "listed twice"),
            (put(url, b"{not json"), 400, "the body is not JSON"),
            (put(url, workers(first, first + 1, first + 2), token=""), 401, "job token"),
        ]
        for (code, body), want_code, want in refused:
            assert code == want_code and want in body["error"], (code, body, want)
        assert get(url)["Version"] == 0 and get(url)["Request"] is None

        # Grow to 3: KungFu's PUT, no version (the next one).
        code, body = put(url, workers(first, first + 1, first + 2))
        assert code == 200 and body["Version"] == 1 and body["state"] == "pending", body
        code, body = put(url, workers(first, first + 1, first + 2))  # the same again, at once
        assert code == 409 and "a request for version 1 is pending" in body["error"], body
        wait_for("3 workers", lambda: any(row.get("size") == 3 for rows in rows_of(out)
                                          for row in rows), proc)
        got = get(url)
        assert got["Version"] == 1 and got["Request"]["state"] == "accepted", got
        assert [w["Port"] for w in got["Workers"]] == [first, first + 1, first + 2]

        # Shrink to rank 0 alone, with the version given (it must be the next one).
        code, body = put(url, dict(workers(first), Version=2))
        assert code == 200, body
        wait_for("1 worker", lambda: any(row.get("size") == 1 for rows in rows_of(out)
                                         for row in rows), proc)
        assert get(url)["Version"] == 2
        (out / "stop").write_text("")
        proc.wait(timeout=60)
    assert proc.returncode == 0, job.text[-5000:]
    everyone = rows_of(out)
    assert len(everyone) == 3, job.text[-3000:]  # 2 initial workers and 1 joiner
    by_step = defaultdict(list)
    for rows in everyone:
        for row in rows[:-1]:
            by_step[row["step"]].append(row)
    sizes = [len(by_step[s]) for s in sorted(by_step)]
    # 2 workers, then 3, then 1, each step once per member, in rank order, the state synced
    # (+1 per step whatever the size: the joiner took it).
    assert sorted(by_step) == list(range(len(by_step)))
    changes = [s for i, s in enumerate(sizes) if i == 0 or s != sizes[i - 1]]
    assert changes == [2, 3, 1], sizes
    for step, rows in by_step.items():
        assert sorted(r["rank"] for r in rows) == list(range(len(rows))), (step, rows)
        assert {r["size"] for r in rows} == {len(rows)} and {r["w"] for r in rows} == {step + 1.0}
    ends = sorted(rows[-1]["end"] for rows in everyone)
    assert ends == ["detached", "detached", "done"], ends


@pytest.mark.timeout(240)
def test_a_put_grows_and_shrinks_model_fit(tmp_path):
    """The same under kf.Hook (elastic_train.py, model.fit): rank 0 takes the request at a step
    boundary; after each switch every worker's weights are identical at every step."""
    def records():
        return {f.stem: [json.loads(x) for x in f.read_text().splitlines() if x.strip()]
                for f in out.glob("*.jsonl")}

    def sizes_seen():
        return {row.get("size") for rows in records().values() for row in rows if "step" in row}

    # Versions 0 (1 worker), 1 (2), 2 (1 again): the job stops 60 steps (3 s) into version 2.
    with launched(tmp_path, 1, 2, ["elastic_train.py", "--schedule", "1", "--tail", "100000",
                                   "--max-steps", "1200", "--step-sleep", "0.05",
                                   "--stop-at-version", "2:60", "--out", "OUT"],
                  220) as job:
        proc, out, url, first = job.proc, job.out, job.url, job.first
        wait_for("step 3", lambda: any(row.get("step", -1) >= 3 for rows in records().values()
                                       for row in rows), proc, timeout=120)
        code, body = put(url, workers(first, first + 1))
        assert code == 200, body
        wait_for("2 workers", lambda: 2 in sizes_seen(), proc, timeout=150)
        code, body = put(url, workers(first))
        assert code == 200, body
        wait_for("1 worker again", lambda: max(
            (row["step"] for rows in records().values() for row in rows
             if row.get("size") == 1 and "digest" in row), default=-1) > max(
            (row["step"] for rows in records().values() for row in rows
             if row.get("size") == 2 and "digest" in row), default=10 ** 9), proc, timeout=60)
        got = get(url)
        assert got["Version"] == 2 and got["Request"]["state"] == "accepted", got
        proc.wait(timeout=200)
    assert proc.returncode == 0, job.text[-5000:]
    steps = steps_of(records())
    assert sizes_of(steps) == [1, 2, 1]  # every step's workers hold the same weights
    assert list(steps) == list(range(1, len(steps) + 1))
