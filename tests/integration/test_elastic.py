"""Elastic training: kungfu-run -w, kf.resize from a policy in model.fit, real processes.

elastic_train.py (next to this file) resizes through a schedule of sizes and records every
worker's steps; the tests read the records.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

pytest.importorskip("tensorflow")

from conftest import SAMPLES, run_elastic, sizes_of, steps_of  # noqa: E402

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


@pytest.fixture(scope="module")
def schedule_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("elastic")


@pytest.fixture(scope="module")
def schedule_run(schedule_dir):
    """Sizes 1 -> 2 -> 4 -> 3 -> 1 -> 4 in 4 slots. The joiners are warm spares (-spares 3: the
    launcher keeps one started in every free slot), so no grow waits for a TensorFlow start-up;
    joiners started cold are tested below, in tests/integration/test_recovery.py and in
    test_torch_elastic.py."""
    return run_elastic(schedule_dir, 1, 4, "--schedule", "2,4,3,1,4", "--bad-requests",
                       launcher_args=("-timeline", str(schedule_dir / "timeline"),
                                      "-spares", "3"))


@pytest.mark.timeout(300)
def test_schedule_runs_to_the_end(schedule_run):
    r, records = schedule_run
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    assert "elastic job finished" in r.stderr
    steps = steps_of(records)
    sizes = []
    for rows in steps.values():
        # Every worker that trained a step saw the same cluster size... after the step: the
        # record is written after the Hook, which may just have switched; take rank 0's.
        size = len(rows)
        if not sizes or sizes[-1] != size:
            sizes.append(size)
    assert sizes == [1, 2, 4, 3, 1, 4], sizes
    finals = [rows[-1] for rows in records.values() if rows and "done" in rows[-1]]
    assert len(finals) == 4 and {f["size"] for f in finals} == {4}


@pytest.mark.timeout(300)
def test_launcher_prints_the_progress_of_each_growth(schedule_run):
    """Sizes 1 -> 2 -> 4 -> 3 -> 1 -> 4: three versions add workers; for each the launcher says
    when it saw the joiners, when they were ready and when the cluster switched, in that order."""
    r, _ = schedule_run
    lines = [line for line in r.stderr.splitlines() if line.startswith("kungfu-run: version ")]
    grows = [re.match(r"kungfu-run: version (\d+): (\d+) -> (\d+) workers; waiting for (\d+) "
                      r"joiners? to start and be ready$", line) for line in lines]
    grows = [m.groups() for m in grows if m]
    assert [(a, b, n) for _, a, b, n in grows] == [("1", "2", "1"), ("2", "4", "2"),
                                                    ("1", "4", "3")], r.stderr
    for version, _, size, n in grows:
        mine = [line for line in lines if line.startswith(f"kungfu-run: version {version}: ")]
        ready = [i for i, line in enumerate(mine)
                 if re.search(rf": {n} of {n} joiners ready after \d+\.\ds$", line)]
        switched = [i for i, line in enumerate(mine)
                    if re.search(rf": switched to {size} workers \d+\.\ds after the version was "
                                 r"written, \d+\.\ds after the last joiner was ready$", line)]
        assert len(ready) == 1 and len(switched) == 1 and ready[0] < switched[0], mine


@pytest.mark.timeout(300)
def test_timeline_shows_every_membership_phase(schedule_run, schedule_dir):
    """The merged timeline (kungfu-run -timeline) has each worker's membership states as spans
    on its "elastic" track: the first worker switches once per resize (5), the joiners join,
    the workers the shrinks left out are detached."""
    r, _ = schedule_run
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    with open(schedule_dir / "timeline" / "timeline.json") as f:
        events = json.load(f)
    phases = defaultdict(list)
    for e in events:
        if e.get("cat") == "elastic":
            assert e["ph"] == "X" and e["dur"] >= 0
            phases[e["pid"]].append(e)
    assert len(phases) == 7  # 1 first worker, 1 + 2 + 3 joiners
    names = {e["name"] for spans in phases.values() for e in spans}
    assert {"joining", "training", "proposing", "waiting for joiners", "switching",
            "detached"} <= names, names
    first = [pid for pid, spans in phases.items()
             if min(spans, key=lambda e: e["ts"])["name"] == "training"]
    assert len(first) == 1
    spans = sorted(phases[first[0]], key=lambda e: e["ts"])
    assert sum(e["name"] == "switching" for e in spans) == 5, [e["name"] for e in spans]
    for a, b in zip(spans, spans[1:]):  # one state at a time, each ending where the next begins
        assert a["ts"] + a["dur"] <= b["ts"] + 1
    # Joiners' collectives are there too, in the same trace.
    assert {e["pid"] for e in events if e.get("cat") == "allreduce"} >= set(phases)


def test_weights_identical_after_every_step(schedule_run):
    _, records = schedule_run
    for step, rows in steps_of(records).items():
        assert len({row["digest"] for row in rows}) == 1, f"step {step}: {rows}"


@pytest.mark.timeout(300)
def test_monitoring_follows_the_cluster_size(schedule_run):
    """The gradient statistics count the workers of the step they ran in (read live, never
    captured when the step was traced), and every worker gets the same noise scale."""
    _, records = schedule_run
    for step, rows in steps_of(records).items():
        assert {row["monitor_n"] for row in rows} == {float(len(rows))}, f"step {step}"
        assert len({repr(row["gns"]) for row in rows}) == 1, f"step {step}"


@pytest.mark.timeout(300)
def test_joiners_trace_their_step_before_the_switch(schedule_run):
    """A joiner runs its training step alone before it reports ready (kf.Hook's rehearsal), and
    model.fit then uses that trace: every process traces its step function exactly once."""
    r, records = schedule_run
    assert "could not rehearse" not in r.stderr
    first = next(rows for rows in records.values() if rows[0]["step"] == 1)
    for rows in records.values():
        steps = [row for row in rows if "done" not in row]
        assert all(row["traces"] == 1 for row in steps), [row["traces"] for row in steps]
        if rows is not first:
            assert all(row["rehearsed"] for row in steps)
    assert not any(row.get("rehearsed") for row in first)


def _every_sample_once_per_epoch(records) -> int:
    """Checks that every finished epoch trained each sample once and the last none twice;
    returns the number of epochs."""
    by_epoch = defaultdict(list)
    for rows in steps_of(records).values():
        for row in rows:
            by_epoch[row["epoch"]].extend(row["served"])
    last = max(by_epoch)
    for epoch, served in by_epoch.items():
        if epoch == last:  # training stopped during it: no sample twice
            assert len(served) == len(set(served))
        else:
            assert sorted(served) == list(range(SAMPLES)), f"epoch {epoch}"
    return len(by_epoch)


@pytest.mark.timeout(300)
def test_every_sample_once_per_epoch(schedule_run):
    _, records = schedule_run
    assert _every_sample_once_per_epoch(records) >= 3


@pytest.fixture(scope="module")
def tfrecord_files(tmp_path_factory) -> Path:
    """The samples in 3 TFRecord files, written once for the tests that read them (by a
    process of its own: elastic_train.py writes them from its arrays)."""
    files = tmp_path_factory.mktemp("tfrecord")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUNGFU_")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in [env.get("PYTHONPATH")] if p])
    subprocess.run([sys.executable, str(HERE / "elastic_train.py"), "--write-tfrecord",
                    str(files), "--samples", str(SAMPLES), "--out", str(files)],
                   check=True, env=env, timeout=120, capture_output=True)
    assert len(list(files.glob("*.tfrecord"))) == 3
    return files


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stream", [False, True], ids=["by-position", "tf.data-stream"])
def test_elastic_data_over_tfrecord_files(tmp_path, tfrecord_files, stream):
    """kf.ElasticData over 3 TFRecord files, never loaded whole: by position (kf.RecordFiles),
    or as a tf.data.TFRecordDataset stream that every worker reads in order. Resizes mid-epoch
    (1 -> 2 -> 3 -> 2) keep every sample once per epoch, and each batch equals the arrays the
    files were written from (checked in the workers). The joiners are warm spares (-spares 2),
    so that no resize waits for TensorFlow's start-up."""
    r, records = run_elastic(tmp_path, 1, 3, "--schedule", "2,3,2", "--gap", "4", "--tail",
                             "40", "--tfrecord", str(tfrecord_files),
                             *(["--stream"] if stream else []), launcher_args=("-spares", "2"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    steps = steps_of(records)
    assert sizes_of(steps) == [1, 2, 3, 2]
    assert all(row["from_files"] for rows in steps.values() for row in rows)
    assert _every_sample_once_per_epoch(records) >= 2


@pytest.mark.timeout(300)
def test_loss_decreases_and_bad_requests_are_refused(schedule_run):
    """Sizes below 1 and non-integers raise ResizeError in the policy; more workers than the
    job's slots is refused (False and a warning naming the limit): training goes on."""
    r, records = schedule_run
    steps = steps_of(records)
    losses = [rows[0]["loss"] for rows in steps.values()]
    assert sum(losses[-10:]) / 10 < sum(losses[:10]) / 10 / 2
    errors = next(rows[-2]["errors"] for rows in records.values() if len(rows) > 2)
    assert len(errors) == 4
    assert "cannot resize to 0" in errors[0] and "1 to 4" in errors[0]
    assert "cannot resize to -1" in errors[1] and errors[2] == "refused 99"
    assert "integer" in errors[3]
    assert "kf.resize(99) refused: cannot resize to 99 workers: the job has 1 to 4" in (
        r.stdout + r.stderr)


@pytest.mark.timeout(200)
def test_a_joiner_whose_model_differs_fails_everyone_at_once(tmp_path):
    """The joiner learns rank 0's variables before any transfer; one that cannot take them
    (another hidden width) fails with a message naming the variable, and so does every other
    worker at once, instead of waiting in the sync until a deadline."""
    r, records = run_elastic(tmp_path, 1, 2, "--schedule", "2", "--joiner-width", "17",
                             timeout=150, env_extra={"KUNGFU_OP_TIMEOUT": "60s"})
    assert r.returncode != 0
    assert "float32[8, 17] in this joiner, but rank 0's" in r.stderr, r.stderr[-5000:]
    assert "a joiner's variables do not match rank 0's" in r.stderr, r.stderr[-5000:]
    assert "DeadlineExceeded" not in r.stderr and "before the deadline" not in r.stderr


@pytest.mark.timeout(200)
def test_a_joiner_that_fails_is_given_up_and_training_goes_on(tmp_path):
    # The launcher tells the workers (cluster/failed/...): they give the resize up at once, not
    # after KUNGFU_RESIZE_TIMEOUT.
    # (The launcher's and the Loop's protocol: numpy workers, a second to start.)
    r, records = run_elastic(tmp_path, 1, 2, "--schedule", "2", "--fail-joiner",
                             "--max-steps", "80", timeout=150, script="elastic_numpy.py",
                             env_extra={"KUNGFU_RESIZE_TIMEOUT": "300s"})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    assert "before the cluster switched to it" in r.stderr and "abandoned" in r.stderr
    assert "failed; training goes on with 1" in r.stderr, r.stderr[-5000:]
    steps = steps_of(records)
    assert len(steps) == 80 and all(len(rows) == 1 and rows[0]["size"] == 1
                                     for rows in steps.values())


@pytest.mark.timeout(300)
def test_warm_spares_become_joiners_and_leave_when_the_job_ends(tmp_path):
    """kungfu-run -spares 1: the grow 1 -> 3 takes the spare for one joiner and starts the other
    afresh; the shrink to 2 frees a slot, so the launcher starts another spare, which the job's
    end stops. Every step's workers agree on the weights, every sample is trained once per
    epoch, and no process of the job outlives the launcher. (The launcher's and the Loop's
    protocol: numpy workers, a second to start; the spares of a TensorFlow job are
    schedule_run's.)"""
    r, records = run_elastic(tmp_path, 1, 3, "--schedule", "3,2", "--gap", "40", "--tail", "10",
                             "--max-steps", "100000", launcher_args=("-spares", "1"),
                             script="elastic_numpy.py")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    log = r.stderr
    assert "1 warm spare here" in log and "spare 0 started" in log, log[-3000:]
    took = re.findall(r"version 1: spare 0, started \d+\.\ds ago, is worker (\d) \(", log)
    fresh = re.findall(r"version 1: started worker (\d) \(", log)
    assert len(took) == 1 and len(fresh) == 1 and {took[0], fresh[0]} == {"1", "2"}, log[-3000:]
    # (a shrink's switch is not announced: it waits for no one)
    assert log.index("switched to 3 workers") < log.index("spare 1 started"), log[-3000:]
    assert "elastic job finished" in log and "before it was needed" not in log
    assert sizes_of(steps_of(records)) == [1, 3, 2]
    assert _every_sample_once_per_epoch(records) >= 1
    # The spare wrote its records under the address it was given (none before: "single").
    assert len(records) == 3 and "single" not in records, sorted(records)
    left = subprocess.run(["pgrep", "-f", str(tmp_path / "records")], capture_output=True,
                          text=True)
    assert left.stdout.strip() == "", f"processes of the job still running: {left.stdout}"
