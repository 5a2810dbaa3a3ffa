"""kungfu.timeline without peers: the writer's file, spans and phases, load and merge."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kungfu import timeline

pytestmark = pytest.mark.timeout(60)
REPO = Path(__file__).resolve().parents[2]


def run_python(code: str, **env) -> subprocess.CompletedProcess:
    e = {k: v for k, v in os.environ.items() if not k.startswith("KUNGFU_")}
    e["PYTHONPATH"] = str(REPO)
    e.update(env)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=e, timeout=50,
                          capture_output=True, text=True, check=False)


PHASES = """
    import os, time
    from kungfu import timeline
    assert timeline.enabled() == bool(os.environ.get("KUNGFU_TIMELINE"))
    timeline.phase("elastic", "training", version=0)
    with timeline.span("load data", rows=10):
        time.sleep(0.02)
    timeline.phase("elastic", "switching")
    time.sleep(0.03)
    timeline.phase("elastic", "detached")  # still open at exit
    print(os.getpid())
"""


@pytest.mark.parametrize("ending", ["exit", "os._exit after close()"])
def test_spans_and_phases_end_up_in_a_strict_json_file(tmp_path, ending):
    code = PHASES + ("" if ending == "exit" else
                     "    timeline.close()\n    os._exit(0)\n")
    r = run_python(code, KUNGFU_TIMELINE=str(tmp_path))
    assert r.returncode == 0, r.stderr
    pid = int(r.stdout)
    (path,) = tmp_path.glob(f"*-{pid}.trace.json")
    with open(path) as f:
        events = json.load(f)  # closed: strict JSON
    spans = {e["name"]: e for e in events if e["ph"] == "X"}
    assert set(spans) == {"training", "load data", "switching", "detached"}
    assert spans["load data"]["args"] == {"rows": 10} and spans["load data"]["cat"] == "python"
    assert spans["training"]["args"] == {"version": 0}
    assert 20000 <= spans["load data"]["dur"] < 2e6
    assert 30000 <= spans["switching"]["dur"] < 2e6
    t, s, d = spans["training"], spans["switching"], spans["detached"]
    assert t["ts"] + t["dur"] == s["ts"] and s["ts"] + s["dur"] == d["ts"]  # back to back
    assert t["tid"] == s["tid"] == d["tid"] != spans["load data"]["tid"]
    assert {e["pid"] for e in events} == {pid}
    tracks = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert tracks == {t["tid"]: "elastic", spans["load data"]["tid"]: "python"}


def test_nothing_is_written_without_the_variable(tmp_path):
    r = run_python(PHASES, HOME=str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert list(tmp_path.iterdir()) == []


def test_load_tolerates_a_crashed_worker(tmp_path):
    p = tmp_path / "h-1.trace.json"
    p.write_text('[{"name":"a","ph":"X","ts":1,"dur":2,"pid":1,"tid":1},\n'
                 '{"name":"b","ph":"X","ts":3,"dur":2,"pid":1,"tid":1},\n{"name":"c","ph')
    assert [e["name"] for e in timeline.load(str(p))] == ["a", "b"]
    (tmp_path / "h-2.trace.json").write_text(
        '[{"name":"d","ph":"X","ts":1,"dur":2,"pid":2,"tid":1}\n]\n')
    (tmp_path / "notes.json").write_text("not a trace")
    out, n = timeline.merge(str(tmp_path))
    assert n == 2 and out == str(tmp_path / "timeline.json")
    with open(out) as f:
        assert sorted(e["name"] for e in json.load(f)) == ["a", "b", "d"]
    os.utime(tmp_path / "h-1.trace.json", (1, 1))  # an earlier job's file
    out, n = timeline.merge(str(tmp_path), since=1000)
    with open(out) as f:
        assert n == 1 and [e["name"] for e in json.load(f)] == ["d"]


def test_an_unwritable_directory_warns_and_training_goes_on(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    r = run_python("from kungfu import timeline\nprint(timeline.enabled())\n",
                   KUNGFU_TIMELINE=str(blocker / "sub"))
    assert r.returncode == 0 and r.stdout == "False\n", r.stderr
    assert "kungfu: no timeline: cannot write to KUNGFU_TIMELINE=" in r.stderr
