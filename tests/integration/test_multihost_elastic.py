"""An elastic job across two "hosts" (two network namespaces joined by veth, as in
test_multihost.py, whose helpers this reuses): one kungfu-run -w in each, host a hosting the
builtin config store, host b using it through -config-server.

The job starts with 1 worker (on a) and elastic_train.py resizes it to 3 (a worker starts on b)
and back to 1 (b's worker detaches and exits 0). Needs root and iproute2; skips where a network
namespace cannot be created.
"""
from __future__ import annotations

import json

import pytest

pytest.importorskip("tensorflow")

# two_hosts is a fixture: importing it makes it available here.
from conftest import sizes_of, steps_of  # noqa: E402
from test_multihost import REPO, PY, run_on_both, two_hosts  # noqa: E402,F401

SCRIPT = REPO / "tests" / "integration" / "elastic_train.py"
PORTS = (10000, 10001)  # fresh namespaces: every port is free
STORE_PORT = 10100
JOB_TIMEOUT = 100  # seconds, each launcher's -timeout; the test's own deadline is above it


@pytest.fixture
def hosts(request):
    """test_multihost's two_hosts, but a skip (not a failure) where namespaces are unavailable."""
    try:
        return request.getfixturevalue("two_hosts")
    except pytest.fail.Exception as e:
        pytest.skip(f"multi-host elastic test needs network namespaces: {e.msg}")


@pytest.mark.timeout(150)
def test_elastic_grow_to_second_host_and_shrink(hosts, tmp_path, monkeypatch):
    monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "3")
    out = tmp_path / "records"
    out.mkdir()
    a, b = hosts.ip
    common = ["-w", "-np", "1", "-H", f"{a}:2,{b}:2", "-port-range", f"{PORTS[0]}-{PORTS[1]}",
              "-timeout", f"{JOB_TIMEOUT}s"]
    # A resize whose joiner never comes is abandoned after KUNGFU_RESIZE_TIMEOUT (120 s by
    # default); shorter here so that such a failure shows within the test's deadline.
    # (The launchers drop KUNGFU_* from their own environment, so it goes on the command.)
    worker = ["env", "KUNGFU_RESIZE_TIMEOUT=60s", PY, str(SCRIPT), "--schedule", "3,1",
              "--out", str(out)]
    results = run_on_both(hosts, [
        [*common, "-self", a, "-builtin-config-port", str(STORE_PORT), *worker],
        [*common, "-self", b, "-config-server", f"http://{a}:{STORE_PORT}", *worker],
    ], timeout=JOB_TIMEOUT + 15)
    (rc_a, out_a, err_a), (rc_b, out_b, err_b) = results
    records = {f.stem: [json.loads(line) for line in f.read_text().splitlines()]
               for f in out.glob("*.jsonl")}
    report = (f"launcher a: exit {rc_a}\n{err_a[-4000:]}\nlauncher b: exit {rc_b}\n"
              f"{err_b[-4000:]}\nrecords: { {k: len(v) for k, v in records.items()} }")
    a0, a1, b0 = (f"{a}:{PORTS[0]}", f"{a}:{PORTS[1]}", f"{b}:{PORTS[0]}")
    # The launcher on b has no worker in version 0: it must keep watching the store until the
    # resize to 3 gives it one (not exit at once because version 0 lists nothing for it).
    assert f"version 1: started worker 2 ({b0})" in err_b, (
        "launcher b never started its worker for the resize to 3\n" + report)
    assert rc_a == 0, report
    assert rc_b == 0, report
    name = {spec: spec.replace(":", "_") for spec in (a0, a1, b0)}
    assert sorted(records) == sorted(name.values()), report
    assert f"config store at http://{a}:{STORE_PORT}" in err_a
    assert f"version 0: started worker 0 ({a0})" in err_a
    assert f"version 1: started worker 1 ({a1})" in err_a
    assert "elastic job finished" in err_a and "elastic job finished" in err_b, report

    # Sizes, by the number of workers that trained each step: 1, then 3, then 1 again.
    steps = steps_of(records)
    assert sizes_of(steps) == [1, 3, 1], steps

    # b's worker trained as rank 2 of 3, then detached: it stopped before the end, with exit 0
    # (a detached worker leaves without a "done" record; its record of the step at which it
    # detached is written after the switch, so it no longer shows rank 2 of 3).
    on_b = records[name[b0]]
    assert on_b and all("done" not in row for row in on_b), on_b[-3:]
    assert [(row["rank"], row["size"]) for row in on_b[:-1]] == [(2, 3)] * (len(on_b) - 1)
    trained_b = [row["step"] for row in on_b]
    assert trained_b == list(range(trained_b[0], trained_b[-1] + 1))  # consecutive steps
    assert len(trained_b) >= 3  # --gap 3 at size 3 before the shrink
    last = max(steps)
    assert trained_b[-1] < last
    assert all(len(steps[s]) == 1 for s in range(trained_b[-1] + 1, last + 1))
    # The same holds for a's second worker; the first one trained every step and finished.
    on_a1 = records[name[a1]]
    assert "done" not in on_a1[-1] and [r["step"] for r in on_a1] == trained_b
    on_a0 = records[name[a0]]
    assert on_a0[-1] == {"done": True, "step": last, "size": 1, "recoveries": []}, on_a0[-1]
    assert [r["step"] for r in on_a0[:-1]] == list(steps)
    # Training did something: the loss fell.
    losses = [steps[s][0]["loss"] for s in steps]
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3


@pytest.mark.timeout(200)
def test_a_host_that_loses_all_its_workers(hosts, tmp_path, monkeypatch):
    """-np 4 over a:2,b:2; both of b's workers (ranks 2 and 3) are killed after step 5. The
    workers on a recover without them and go on; b's launcher, which keeps watching, starts
    replacements in the freed slots, which join (together, in one version). Both launchers
    exit 0 listing what the job survived."""
    monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "3")
    out = tmp_path / "records"
    out.mkdir()
    a, b = hosts.ip
    common = ["-w", "-np", "4", "-H", f"{a}:2,{b}:2", "-port-range", f"{PORTS[0]}-{PORTS[1]}",
              "-timeout", f"{JOB_TIMEOUT + 40}s"]
    # Versions: 0 (4 workers), 1 (the 2 survivors), 2 (both replacements in): the job stops
    # 5 steps into version 2.
    worker = [PY, str(SCRIPT), "--schedule", "4", "--tail", "100000", "--max-steps", "90",
              "--step-sleep", "0.25", "--kill", "2@5+", "--kill", "3@5+",
              "--stop-at-version", "2:5", "--out", str(out)]
    results = run_on_both(hosts, [
        [*common, "-self", a, "-builtin-config-port", str(STORE_PORT), *worker],
        [*common, "-self", b, "-config-server", f"http://{a}:{STORE_PORT}", *worker],
    ], timeout=JOB_TIMEOUT + 55)
    (rc_a, _, err_a), (rc_b, _, err_b) = results
    records = {f.stem: [json.loads(line) for line in f.read_text().splitlines()]
               for f in out.glob("*.jsonl")}
    report = f"launcher a: exit {rc_a}\n{err_a[-4000:]}\nlauncher b: exit {rc_b}\n{err_b[-4000:]}"
    assert rc_a == 0 and rc_b == 0, report
    assert err_b.count("in place of the lost one") == 2, report
    assert err_b.count("survived: worker") == 2, report
    steps = steps_of(records)
    assert sizes_of(steps) == [4, 2, 4], steps
    finals = [rows[-1] for rows in records.values() if rows and "done" in rows[-1]]
    assert len(finals) == 4 and {f["size"] for f in finals} == {4}, finals
