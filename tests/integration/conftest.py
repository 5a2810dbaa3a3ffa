"""The `spawn` fixture: run a function in N real worker processes on 127.0.0.1.

    def test_sum(spawn):
        values = spawn(3, _w_collectives.some_body, arg1, arg2)   # one value per rank

Each worker gets its identity the way kungfu-run gives it (KUNGFU_SELF_SPEC, KUNGFU_INIT_PEERS,
KUNGFU_INIT_CLUSTER_VERSION) on free loopback ports, runs `fn(*args)` through _worker.py and
sends back the return value (pickled through a file). `spawn(...)` returns the values in rank
order and raises WorkerError carrying the traceback of the rank that failed first. Every spawn
has a deadline (`timeout`, 60 s by default): a worker still running then gets SIGUSR1 (its
Python stacks go to stderr and into the error) and is killed. `spawn.run(...)` returns a Run
with every rank's outcome instead of raising, for tests where ranks are meant to die or fail.
Whatever is still running when the test ends is killed.

The function must be importable by its module path in a fresh interpreter (the directory of this
file and the repository root are on sys.path); pass it as a function object or "module:qualname".
"""
from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Union

import pytest

from kungfu import _env
from kungfu._ports import free_port_block, free_port_range, free_ports  # noqa: F401 - for the tests

HERE = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(os.path.dirname(HERE))
if HERE not in sys.path:  # the worker-body modules (_w_*.py) next to this file
    sys.path.insert(0, HERE)
WORKER = os.path.join(HERE, "_worker.py")
DEFAULT_TIMEOUT = 60.0
# A rank that fails takes the job down: the others get this long to finish (they usually fail at
# once with PeerFailedError), then are killed, so one broken rank cannot cost the whole deadline.
FAILURE_GRACE = 10.0
_PORT_ERRORS = ("cannot listen on", "Address already in use")
# Errors that a rank raises because another rank failed first.
_CONSEQUENCES = ("PeerFailedError", "CancelledError")


def _undone(records) -> Callable[[str, dict], bool]:
    """Whether a worker's step record was undone by a recovery: the survivors rolled back to
    the recovery's step, so a record of a later step is not part of the training if a survivor
    wrote it before it failed, or if the process of a worker lost there wrote it (a stopped
    worker may finish its step when it wakes up; a replacement at its address is another
    process). A step's agreement may complete on one worker and fail on another when a peer
    stops in the middle of it: the first has recorded the step, at the old size, and is then
    rolled back with the others. Keras sees one step per call, so the step it trains again is
    not recorded a second time."""
    recoveries: Dict[int, list] = {}  # version -> [(worker, its recovery)]
    for worker, rows in records.items():
        if rows and "done" in rows[-1]:
            for rec in rows[-1]["recoveries"]:
                recoveries.setdefault(rec["version"], []).append((worker, rec))
    survived: List[tuple] = []  # (worker, step rolled back to, it failed at this time)
    lost: List[tuple] = []  # (worker, its process, step rolled back to)
    for survivors in recoveries.values():
        step = survivors[0][1]["step"]
        agreed = min(rec["agreed_at"] for _, rec in survivors)
        survived += [(worker, step, rec["failed_at"]) for worker, rec in survivors]
        for worker in (w.replace(":", "_") for w in survivors[0][1]["lost"]):
            lost += [(worker, row["pid"], step) for row in records.get(worker, [])
                     if "pid" in row and row["t"] < agreed]

    def undone(worker: str, row: dict) -> bool:
        return any(worker == w and row["step"] > step and row["t"] < failed
                   for w, step, failed in survived) or \
            any((worker, row.get("pid")) == (w, pid) and row["step"] > step
                for w, pid, step in lost)
    return undone


def steps_of(records):
    """The per-step records of elastic runs (elastic_train.py: {worker: [row per step]}) as
    {step: [the row of every worker that trained it]}, in step order, without the records
    that a recovery undid (_undone)."""
    undone = _undone(records)
    by_step: Dict[int, list] = {}
    for worker, rows in records.items():
        for row in rows:
            if "done" not in row and "fault" not in row and "begin" not in row and \
                    not undone(worker, row):
                by_step.setdefault(row["step"], []).append(row)
    return dict(sorted(by_step.items()))


def sizes_of(steps) -> List[int]:
    """The cluster sizes a run went through, by how many workers trained each step (steps_of);
    each step's workers must end it with the same weights."""
    sizes: List[int] = []
    for step, rows in steps.items():
        assert len({row["digest"] for row in rows}) == 1, f"step {step}: {rows}"
        if not sizes or sizes[-1] != len(rows):
            sizes.append(len(rows))
    return sizes


SAMPLES = 240  # the samples of elastic_train.py's and elastic_numpy.py's data


def check_epochs(steps, samples: int = SAMPLES):
    """Every sample of every epoch trained exactly once (steps: steps_of's): the steps' slices
    of the epoch's order (kf.ElasticData, seed 2) follow each other from 0 to the end, and in
    each step the workers trained the parts of its slice split among them (how many they were
    is read from the parts: a record is written after the trainer, which may just have
    switched). A worker lost in a step may have trained its part without recording it (it died
    between its step and its record): then the others trained that step at the old size and
    recorded only their parts."""
    import numpy as np

    ends: Dict[int, int] = {}  # epoch -> end of its last step's slice
    for step, rows in steps.items():
        epoch, (start, length) = rows[0]["epoch"], rows[0]["slice"]
        assert all((r["epoch"], r["slice"]) == (epoch, [start, length]) for r in rows), rows
        assert start == ends.get(epoch, 0), f"step {step}: slice {start} after {ends.get(epoch)}"
        ends[epoch] = start + length
        piece = np.random.default_rng([2, epoch]).permutation(samples)[start:start + length]
        served = [sorted(r["served"]) for r in rows]
        trained = [m for m in served if m]  # a worker with an empty part trains no sample
        assert len({str(m) for m in trained}) == len(trained), f"step {step}: a part twice"
        splits = [n for n in range(len(rows), 9) if all(
            any(sorted(p.tolist()) == mine for p in np.array_split(piece, n)) for mine in served)]
        assert splits, f"step {step}: the parts are no split of the step's slice: {served}"
    for epoch in list(ends)[:-1]:
        assert ends[epoch] == samples, f"epoch {epoch} ended at sample {ends[epoch]}"


def run_elastic(tmp_path, np_: int, slots: int, *args: str, timeout: float = 240,
                env_extra=None, launcher_args=(), store=None, script: str = "elastic_train.py"):
    """Runs `script` (next to this file: elastic_train.py, TensorFlow, or elastic_numpy.py)
    under kungfu-run -w, with the builtin store or `store` (a -config-server URL); returns the
    launcher's result and every worker's records ({host_port: [row]})."""
    import json

    env = {k: v for k, v in os.environ.items() if not k.startswith("KUNGFU_")}
    env["PYTHONPATH"] = os.pathsep.join([REPO_ROOT] + [p for p in [env.get("PYTHONPATH")] if p])
    env["TF_CPP_MIN_LOG_LEVEL"] = "3"
    env.update(env_extra or {})
    out = tmp_path / "records"
    out.mkdir()
    cmd = [sys.executable, "-m", "kungfu.cmd", "-w", "-np", str(np_), "-H", f"127.0.0.1:{slots}",
           *(["-config-server", store] if store else
             ["-builtin-config-port", str(free_ports(1)[0])]),
           "-port-range", free_port_range(slots),
           "-timeout", f"{int(timeout) - 10}s", *launcher_args,
           sys.executable, os.path.join(HERE, script),
           "--out", str(out), "--samples", str(SAMPLES), *args]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO_ROOT,
                       timeout=timeout, check=False)
    records = {}
    for f in out.glob("*.jsonl"):
        records[f.stem] = [json.loads(line) for line in f.read_text().splitlines()]
    return r, records


def run_recovered(tmp_path, np_: int, n_steps: int, *args: str, env=None, expect_lost: int = 1,
                  steps_after: bool = True, steps_before: bool = True, replace: bool = False,
                  script: str = "elastic_train.py", timeout: float = 240,
                  max_recoveries: int = 1):
    """run_elastic of `np_` workers in `np_` slots for `n_steps` steps, with `args` (the faults),
    that goes on with the survivors (-replace=false unless `replace`): it finishes, says what
    it survived, trains every sample of every epoch once with equal weights on every worker
    after every step, and each finisher recovered once (up to `max_recoveries` times where the
    faults may be seen apart), without the lost ones. Returns the launcher's result, the records
    and the finishers' last records."""
    # A hung worker that the survivors left out is stopped after 4 s, not the default 10 s: the
    # faults here leave none that would exit on its own later (the test that wakes one up sets
    # its own).
    env = {"KUNGFU_LEAVE_GRACE": "4s", **(env or {})}
    r, records = run_elastic(tmp_path, np_, np_, "--max-steps", str(n_steps), "--step-sleep",
                             "0.02", *args, env_extra=env, script=script, timeout=timeout,
                             launcher_args=() if replace else ("-replace=false",))
    log = r.stdout[-3000:] + r.stderr[-6000:]
    assert r.returncode == 0, log
    assert "survived" in r.stderr or expect_lost == 0, log
    steps = steps_of(records)
    assert sorted(steps) == list(range(1, n_steps + 1)), log
    for step, rows in steps.items():
        assert len({row["digest"] for row in rows}) == 1, f"step {step}: {rows}"
    check_epochs(steps)
    finals = [rows[-1] for rows in records.values() if rows and "done" in rows[-1]]
    assert len(finals) == np_ - expect_lost, log
    for f in finals:
        assert f["size"] == np_ - expect_lost and f["step"] == n_steps, f
        recs = f["recoveries"]
        assert 1 <= len(recs) <= max_recoveries, recs
        lost = [p for rec in recs for p in rec["lost"]]
        assert len(set(lost)) == len(lost) == expect_lost, recs
        assert recs[-1]["size"] == np_ - expect_lost, recs
    sizes = [len(rows) for rows in steps.values()]
    assert sizes[0] == (np_ if steps_before else np_ - expect_lost), sizes
    if steps_after:  # the survivors trained on after the loss
        assert sizes[-1] == np_ - expect_lost, sizes
    return r, records, finals


class WorkerError(AssertionError):
    """A worker raised, crashed, or did not finish in time."""


@dataclass
class RankOutcome:
    rank: int
    peer: str
    returncode: Optional[int] = None  # None: still running at the deadline (then killed)
    status: str = "missing"  # "ok", "error" or "missing" (no result file: crashed or killed)
    value: Any = None
    error_type: Optional[str] = None
    error_message: Optional[str] = None
    traceback: Optional[str] = None
    exception: Optional[BaseException] = None
    error_time: Optional[float] = None  # wall clock, taken in the worker
    exit_time: Optional[float] = None  # wall clock, when the fixture saw the exit
    stdout: str = ""
    stderr: str = ""

    @property
    def ok(self) -> bool:
        return self.status == "ok" and self.returncode == 0

    def describe(self) -> str:
        head = f"rank {self.rank} ({self.peer})"
        if self.returncode is None:
            what = "did not finish before the deadline"
        elif self.returncode < 0:
            sig = signal.Signals(-self.returncode).name
            what = f"was killed by signal {-self.returncode} ({sig})"
        else:
            what = f"exited with code {self.returncode}"
        text = f"{head} {what}"
        if self.status == "error":
            text += f"\n{self.traceback}"
        elif self.status == "missing":
            text += " without a result"
        if self.stderr.strip():
            text += "\n--- stderr (tail) ---\n" + self.stderr[-6000:]
        return text


@dataclass
class Run:
    np: int
    peers: List[str]
    outcomes: List[RankOutcome]
    timed_out: bool
    elapsed: float
    fn: str = ""
    attempts: int = 1
    notes: List[str] = field(default_factory=list)

    @property
    def values(self) -> List[Any]:
        return [o.value for o in self.outcomes]

    def first_failure(self) -> Optional[RankOutcome]:
        """The likely cause: a rank that crashed or raised something other than a peer failure
        (which is usually the consequence of another rank's failure); the earliest one."""
        bad = [o for o in self.outcomes if not o.ok]
        if not bad:
            return None

        def key(o):
            consequence = o.error_type in _CONSEQUENCES
            when = o.error_time if o.status == "error" else o.exit_time
            return (consequence, when if when is not None else float("inf"), o.rank)

        return min(bad, key=key)

    def check(self) -> List[Any]:
        """The values in rank order, or WorkerError describing what went wrong."""
        if self.timed_out:
            stuck = [o for o in self.outcomes if o.returncode is None]
            parts = [f"{self.fn} on {self.np} workers ran past its deadline "
                     f"({self.elapsed:.1f} s); still running: {[o.rank for o in stuck]}"]
            first = self.first_failure()
            if first is not None and first.status == "error":
                parts.append("first failure:\n" + first.describe())
            parts += [o.describe() for o in stuck]
            raise WorkerError("\n\n".join(parts))
        first = self.first_failure()
        if first is not None:
            others = [o.rank for o in self.outcomes if not o.ok and o is not first]
            raise WorkerError(f"{self.fn} on {self.np} workers failed first on "
                              f"{first.describe()}\n(other failing ranks: {others})")
        return self.values


def _fn_spec(fn: Union[str, Callable]) -> tuple:
    if isinstance(fn, str):
        module, _, qualname = fn.partition(":")
        if not qualname:
            raise ValueError(f"expected 'module:qualname', got {fn!r}")
        return module, qualname
    module, qualname = fn.__module__, fn.__qualname__
    if module == "__main__" or "<locals>" in qualname:
        raise ValueError(f"{fn!r} is not importable by name; define it at module level")
    return module, qualname


class Spawner:
    def __init__(self, workdir: str):
        self.workdir = workdir
        self._procs: List[subprocess.Popen] = []
        self._count = 0

    def __call__(self, np: int, fn, *args, env: Optional[Dict[str, Optional[str]]] = None,
                 rank_env=None, timeout: float = DEFAULT_TIMEOUT,
                 kwargs: Optional[dict] = None) -> List[Any]:
        return self.run(np, fn, *args, env=env, rank_env=rank_env, timeout=timeout,
                        kwargs=kwargs, fail_fast=True).check()

    def run(self, np: int, fn, *args, env: Optional[Dict[str, Optional[str]]] = None,
            rank_env=None, timeout: float = DEFAULT_TIMEOUT, kwargs: Optional[dict] = None,
            fail_fast: bool = False) -> Run:
        """Runs fn(*args, **kwargs) on np workers and returns every rank's outcome.

        env: extra variables for every worker (None removes one); rank_env: {rank: {...}} or a
        function rank -> dict, for variables that differ per rank. fail_fast: once a rank fails,
        kill the others after FAILURE_GRACE seconds.
        """
        module, qualname = _fn_spec(fn)
        attempts = 0
        while True:
            attempts += 1
            run = self._run_once(np, module, qualname, args, kwargs or {}, env, rank_env,
                                 timeout, fail_fast)
            run.attempts = attempts
            # Another process may grab a port between free_ports() and the worker's bind.
            port_clash = any(
                o.status == "error" and any(m in (o.error_message or "") for m in _PORT_ERRORS)
                for o in run.outcomes)
            if not port_clash or attempts >= 3:
                return run

    def _run_once(self, np, module, qualname, args, kwargs, env, rank_env, timeout, fail_fast):
        self._count += 1
        tag = f"spawn{self._count}"
        job = os.path.join(self.workdir, f"{tag}.job")
        with open(job, "wb") as f:
            pickle.dump((module, qualname, tuple(args), dict(kwargs)), f)
        peers = [f"127.0.0.1:{p}" for p in free_ports(np)]
        base = {k: v for k, v in os.environ.items() if not k.startswith("KUNGFU_")}
        base["PYTHONPATH"] = os.pathsep.join(
            [REPO_ROOT, HERE] + [p for p in [os.environ.get("PYTHONPATH")] if p])
        base["PYTHONUNBUFFERED"] = "1"
        base["PYTHONFAULTHANDLER"] = "1"
        base["KUNGFU_CONNECT_TIMEOUT"] = "30s"
        for k, v in (env or {}).items():
            if v is None:
                base.pop(k, None)
            else:
                base[k] = str(v)
        procs, outs, files = [], [], []
        start = time.monotonic()
        for r in range(np):
            e = dict(base)
            _env.set_worker_env(e, _env.worker_env(peers[r], peers, 0))
            extra = rank_env(r) if callable(rank_env) else (rank_env or {}).get(r, {})
            for k, v in (extra or {}).items():
                if v is None:
                    e.pop(k, None)
                else:
                    e[k] = str(v)
            result = os.path.join(self.workdir, f"{tag}.rank{r}.result")
            out = open(os.path.join(self.workdir, f"{tag}.rank{r}.stdout"), "w+b")
            err = open(os.path.join(self.workdir, f"{tag}.rank{r}.stderr"), "w+b")
            p = subprocess.Popen([sys.executable, WORKER, job, result], env=e, cwd=REPO_ROOT,
                                 stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                 start_new_session=True)
            self._procs.append(p)
            procs.append(p)
            files.append((out, err, result))
            outs.append(RankOutcome(rank=r, peer=peers[r]))
        deadline = start + timeout
        timed_out = False
        failed_at = None
        while True:
            running = 0
            for o, p in zip(outs, procs):
                if o.returncode is not None:
                    continue
                rc = p.poll()
                if rc is None:
                    running += 1
                else:
                    o.returncode, o.exit_time = rc, time.time()
                    if rc != 0 and failed_at is None:
                        failed_at = time.monotonic()
            if running == 0:
                break
            now = time.monotonic()
            if now >= deadline:
                timed_out = True
                break
            if fail_fast and failed_at is not None and now - failed_at > FAILURE_GRACE:
                break
            time.sleep(0.02)
        alive = [p for o, p in zip(outs, procs) if o.returncode is None]
        if alive:
            for p in alive:
                _signal_group(p, signal.SIGUSR1)
            time.sleep(0.5)
            for p in alive:
                _signal_group(p, signal.SIGKILL)
            for p in alive:
                p.wait()
        elapsed = time.monotonic() - start
        for o, (out, err, result) in zip(outs, files):
            out.seek(0)
            err.seek(0)
            o.stdout = out.read().decode(errors="replace")
            o.stderr = err.read().decode(errors="replace")
            out.close()
            err.close()
            if os.path.exists(result):
                with open(result, "rb") as f:
                    payload = pickle.load(f)
                o.status = payload[0]
                if o.status == "ok":
                    o.value = payload[1]
                else:
                    (o.error_type, o.error_message, o.traceback, o.exception,
                     o.error_time) = payload[1:]
        return Run(np=np, peers=peers, outcomes=outs, timed_out=timed_out, elapsed=elapsed,
                   fn=f"{module}:{qualname}")

    def cleanup(self):
        for p in self._procs:
            if p.poll() is None:
                _signal_group(p, signal.SIGKILL)
                p.wait()
        self._procs.clear()


def _signal_group(p: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(p.pid, sig)  # each worker leads its own session (start_new_session)
    except ProcessLookupError:
        pass


@pytest.fixture
def spawn(tmp_path):
    s = Spawner(str(tmp_path))
    yield s
    s.cleanup()


@pytest.fixture(scope="session")
def session_spawn(tmp_path_factory):
    """A Spawner that lives for the whole session, for results shared by many tests."""
    s = Spawner(str(tmp_path_factory.mktemp("spawn")))
    yield s
    s.cleanup()
