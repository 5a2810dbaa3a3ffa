"""How long a resize of an elastic job interrupts training, against checkpoint + restart.

One command runs everything (it starts kungfu-run itself, three jobs one after the other):

    python benchmarks/resize_latency.py

Every worker (benchmarks/_resize_worker.py) trains the same model with model.fit: Dense layers
1024 -> 4096 -> 4096 -> 1024 -> 1 (25,176,065 parameters at --width 4096; the default optimizer
SGD with momentum adds one slot per weight), batch --batch-size (8) per worker on synthetic
regression data (kf.ElasticData), gradients averaged by kf.Optimizer. All workers run on this
host, so their time.time() stamps are comparable; each appends one JSON record per event (its
start-up phases, every step, rank 0's kf.resize calls, the checkpoint it saved) to a file in a
temporary directory, and this driver reads them.

1. elastic job: `kungfu-run -w -np SMALL -H 127.0.0.1:BIG -builtin-config-port P`. A policy in
   kf.Hook on rank 0 calls kf.resize(BIG) after --warm steps, kf.resize(SMALL) --gap steps after
   that switch, --cycles round trips; --tail steps later rank 0 writes a checkpoint (model
   weights and optimizer state, tf.train.Checkpoint) and the job stops. A grow after a shrink
   also waits --min-gap-seconds, so that the workers the shrink left out have exited.
2. restart to BIG: a new, non-elastic `kungfu-run -np BIG` job whose workers all read that
   checkpoint and train --restart-steps steps; rank 0 then writes a checkpoint and it stops.
3. restart to SMALL: `kungfu-run -np SMALL` from the second checkpoint, --restart-steps steps.

Measurements (rank 0's records unless said otherwise; "step end" is on_train_batch_end, taken
before kf.Hook's own after_step, where a resize is applied):

(a) pause: how long a switch holds the existing workers up. On rank 0, the boundary interval
    runs from the end of the last step before a switch to the end of the first step after it:
    kf.Hook's work at that boundary (agreeing on the switch, swapping the native peer, with
    joiners handing them rank 0's weights and optimizer state) plus one step at the new size
    (which waits for the joiners' first step). pause = boundary - the normal step time at the
    new size (median of rank 0's step-to-step intervals at that size, leaving out the steps
    during which joiners were starting and the first step after a switch). Targets: pause < 1 s
    growing, < 0.2 s shrinking.
(b) resize to first step: from rank 0's kf.resize call to the end of the joiners' first training
    step (the last joiner's), with its parts: ask -> the first joiner's process starts (the
    launcher sees the new cluster version), -> the last joiner is ready (imports, model,
    model.fit, then kf.Hook rehearses the training step alone and reports it ready), -> rank
    0's step end after which the workers switch (the next step boundary once all are ready),
    -> the joiners' first step end (state sync, the joiners' first step). When shrinking there
    are no joiners: to rank 0's first step end at the new size. The existing workers keep training meanwhile
    (pending_steps of them, pending_step_s each).
    Target: (b) <= a fresh worker's start-up + the pause of the same switch, where the fresh
    start-up is the median over the elastic job's initial workers of process start to the end
    of their first step.
(c) checkpoint + restart: from the moment rank 0 starts writing the checkpoint to the end of the
    restarted job's first step (its last worker's), with its parts: save, stop (save done -> the
    old launcher exited), relaunch (-> the first new worker process started), start-up (-> first
    step end: imports, model, checkpoint read, tracing, the first step).

Output: one JSON object per measurement on stdout (also --json PATH), then a table. Keys:
  {"measure": "fresh_startup", "np", "startup_s" (median), "per_worker_s", "import_s",
   "model_s", "fit_to_first_step_s"}                                      (elastic job's start)
  {"measure": "pause", "change": "2->4", "cycle", "pause_s", "boundary_s", "step_old_s",
   "step_new_s", "step_new_iqr_s" (25th and 75th percentile of the normal steps at the new
   size: the pause cannot be resolved more finely than their spread), "hook_s" (kf.Hook's after_step at the switch on rank 0: agreeing, swapping the
   native peer, syncing joiners), "hook_normal_s" (the same on a normal step: the agreement
   round), "first_step_after_s" (the rest of the boundary: rank 0's first step at the new
   size, which waits for the joiners' first step), "switch_step", "target_s",
   "within_target"}
  {"measure": "resize_to_first_step", "change", "cycle", "time_s", "ask_step", "switch_step",
   "pending_steps", "pending_step_s", "joiners", "launch_s" (ask -> first joiner process),
   "joiner_startup_s" (each joiner: process start -> model.fit), "rehearse_s" (each joiner:
   model.fit -> ready, kf.Hook running the training step alone), "all_ready_s" (ask -> the
   last joiner ready), "ready_to_switch_s" (-> end of rank 0's step
   at which the others switch), "switch_to_first_step_s" (-> the joiners' first step end),
   "joiner_sync_s" (switch -> the last joiner holds rank 0's state), "fresh_startup_s",
   "pause_s", "target_s", "within_target"}
  {"measure": "restart", "change", "time_s", "save_s", "stop_s", "relaunch_s", "startup_s",
   "restore_s", "checkpoint_bytes", "restarted_step_s"}
  {"measure": "timeline", "step", "size", "t_end_s", "step_s", "asks"} rank 0's steps in the
   elastic job, as columns: step number, cluster size during the step, its end (seconds since
   the elastic job's launch), the interval since the previous step's end (null for the first);
   asks: [{"t_s", "step", "to"}], its kf.resize calls                    (for --plot)
  {"measure": "run", "wall_s", "loadavg_before", "loadavg_after", "cpus", "params",
   "elastic_steps", "epoch_boundaries" (epochs the elastic job crossed; 0 by default: at an
   epoch boundary model.fit's tf.data iterator is rebuilt, which can stall a worker for
   seconds, see the README), ...}
Times are seconds. --plot PNG draws rank 0's timeline (cluster size and step times, the pause
of each switch marked) and (a), (b), (c) per change as bars (needs matplotlib); --from-json PATH
prints the table and draws the plot of a saved --json file without running anything. On a machine with few cores the workers share them, so everything here
depends on the load: the joiners' start-up competes with the training workers for the cores
(pending_step_s shows it), and 4 workers on 2 cores step more slowly than 2. Run it more than
once before drawing conclusions.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
if REPO not in sys.path:  # run from a checkout: this repository's kungfu
    sys.path.insert(0, REPO)

from kungfu._ports import free_port_range, free_ports  # noqa: E402

from _common import JsonLines, read_json_lines  # noqa: E402
from _plot import pyplot, save  # noqa: E402
WORKER = os.path.join(HERE, "_resize_worker.py")

TARGET_PAUSE_OUT = 1.0
TARGET_PAUSE_IN = 0.2


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter,
                     argparse.RawDescriptionHelpFormatter):
    pass


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description="Pause and latency of an elastic resize (kungfu-run -w, kf.resize in "
                    "model.fit) against checkpoint + restart, on one host. Runs three "
                    "kungfu-run jobs itself; prints one JSON line per measurement and a table "
                    "(the measurements are defined below the flags).",
        epilog=__doc__, formatter_class=_HelpFormatter)
    p.add_argument("--small", type=int, default=2, help="workers before growing / after shrinking")
    p.add_argument("--big", type=int, default=4, help="workers after growing (also the slots)")
    p.add_argument("--cycles", type=int, default=3,
                   help="SMALL -> BIG -> SMALL round trips in the elastic job")
    p.add_argument("--warm", type=int, default=5,
                   help="steps at SMALL before the first resize (tracing, normal step time)")
    p.add_argument("--gap", type=int, default=5, help="steps after a switch before the next resize")
    p.add_argument("--tail", type=int, default=5,
                   help="steps at SMALL after the last switch before the checkpoint")
    p.add_argument("--min-gap-seconds", type=float, default=3.0,
                   help="at least this long after a shrink before growing again (the "
                        "workers the shrink left out exit first)")
    p.add_argument("--restart-steps", type=int, default=4,
                   help="steps each restarted job trains")
    p.add_argument("--batch-size", type=int, default=8, help="samples per step per worker")
    p.add_argument("--samples", type=int, default=8192,
                   help="samples in the synthetic data set (an epoch); keep epochs longer than "
                        "the run: see epoch_boundaries")
    p.add_argument("--width", type=int, default=4096,
                   help="units of the two wide Dense layers (4096: 25.2M parameters)")
    p.add_argument("--optimizer", choices=["sgd", "momentum", "adam"], default="momentum",
                   help="the wrapped Keras optimizer (state synced to joiners / checkpointed)")
    p.add_argument("--threads", type=int, default=1, help="TensorFlow intra-op threads per worker")
    p.add_argument("--restart-broadcast", action="store_true",
                   help="restarted jobs also broadcast rank 0's state at the start "
                        "(BroadcastGlobalVariablesCallback); by default every worker only "
                        "reads the checkpoint")
    p.add_argument("--plain-exit", action="store_true",
                   help="workers end with a normal interpreter exit instead of os._exit(0) "
                        "after model.fit: adds TensorFlow's teardown (up to a minute, see the "
                        "README) to the stop part of (c)")
    p.add_argument("--no-restart", action="store_true", help="skip (c), the restart jobs")
    p.add_argument("--spares", type=int, default=0,
                   help="the elastic job keeps this many warm spares (kungfu-run -spares K): "
                        "a grow takes them instead of starting its joiners")
    p.add_argument("--resize-timeout", type=float, default=120.0,
                   help="KUNGFU_RESIZE_TIMEOUT: seconds a resize waits for its joiners")
    p.add_argument("--timeout", type=float, default=360.0,
                   help="seconds one kungfu-run job may take before it is stopped")
    p.add_argument("--json", metavar="PATH", help="also write the JSON lines to PATH")
    p.add_argument("--plot", metavar="PNG",
                   help="draw rank 0's resize timeline and the (a)/(b)/(c) bars to PNG "
                        "(needs matplotlib)")
    p.add_argument("--from-json", metavar="PATH",
                   help="run nothing: print the table (and --plot) of a saved --json file")
    p.add_argument("--keep", metavar="DIR",
                   help="keep the records, checkpoints and launcher logs in DIR")
    args = p.parse_args(argv)
    if not 1 <= args.small < args.big:
        p.error("need 1 <= --small < --big")
    for k in ("cycles", "warm", "gap", "tail", "restart_steps", "batch_size", "samples", "width",
              "threads"):
        if getattr(args, k) < 1:
            p.error(f"--{k.replace('_', '-')} must be at least 1")
    return args


# -- launching ----------------------------------------------------------------------------------


def worker_env(args) -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUNGFU_")}
    env["PYTHONPATH"] = os.pathsep.join([REPO] + [p for p in [env.get("PYTHONPATH")] if p])
    env["TF_CPP_MIN_LOG_LEVEL"] = "3"
    env["KUNGFU_RESIZE_TIMEOUT"] = f"{args.resize_timeout:g}"
    return env


def worker_args(args, mode: str, tag: str, out: str) -> List[str]:
    return [sys.executable, WORKER, "--mode", mode, "--tag", tag, "--out", out,
            "--small", str(args.small), "--big", str(args.big), "--cycles", str(args.cycles),
            "--warm", str(args.warm), "--gap", str(args.gap), "--tail", str(args.tail),
            "--min-gap-seconds", str(args.min_gap_seconds),
            "--steps", str(args.restart_steps), "--batch-size", str(args.batch_size),
            "--samples", str(args.samples),
            "--width", str(args.width), "--optimizer", args.optimizer,
            "--threads", str(args.threads)] + (["--plain-exit"] if args.plain_exit else [])


class JobFailed(RuntimeError):
    pass


def run_job(args, name: str, launcher: List[str], worker: List[str], log_path: str) -> dict:
    """Runs one kungfu-run job to its end; returns when it was launched and when it exited."""
    cmd = [sys.executable, "-m", "kungfu.cmd", *launcher, "-timeout",
           f"{int(args.timeout)}s", *worker]
    with open(log_path, "w") as log:
        t_launch = time.time()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                                env=worker_env(args))
        try:
            rc = proc.wait(timeout=args.timeout + 30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)
            rc = None
        t_exit = time.time()
    if rc != 0:
        with open(log_path) as f:
            tail = f.read()[-4000:]
        raise JobFailed(f"{name}: kungfu-run exited with {rc}\n  {' '.join(cmd)}\n{tail}")
    return {"t_launch": t_launch, "t_exit": t_exit, "wall_s": t_exit - t_launch}


# -- reading the records ------------------------------------------------------------------------


class Proc:
    """One worker process's records."""

    def __init__(self, rows: List[dict]):
        self.info = next((r for r in rows if r["ev"] == "proc"), {})
        self.steps = sorted((r for r in rows if r["ev"] == "step"), key=lambda r: r["step"])
        self.asks = [r for r in rows if r["ev"] == "ask"]
        self.saves = [r for r in rows if r["ev"] == "save"]
        self.abandoned = [r for r in rows if r["ev"] == "abandoned"]
        self.joined = next((r["t"] for r in rows if r["ev"] == "joined"), None)
        # A joiner reports ready once kf.Hook has rehearsed its step (or, without a rehearsal,
        # when it enters model.fit).
        self.ready = next((r["t1"] for r in rows if r["ev"] == "rehearsed"),
                          self.info.get("t_fit"))

    @property
    def joining(self) -> bool:
        return bool(self.info.get("joining"))

    def first_step(self) -> Optional[dict]:
        return self.steps[0] if self.steps else None


def read_procs(out: str, tag: str) -> List[Proc]:
    procs = []
    for name in sorted(os.listdir(out)):
        if name.startswith(tag + "-") and name.endswith(".jsonl"):
            rows = read_json_lines(os.path.join(out, name))
            if rows:
                procs.append(Proc(rows))
    return procs


def rank0(procs: List[Proc]) -> Proc:
    for p in procs:
        if not p.joining and p.steps and p.steps[0].get("rank") == 0:
            return p
    raise JobFailed("no records of rank 0")


def _median(xs) -> Optional[float]:
    xs = list(xs)
    return statistics.median(xs) if xs else None


def _iqr(xs) -> Optional[List[float]]:
    """[25th, 75th percentile] of xs: how much a normal step varies."""
    if not xs or len(xs) < 2:
        return None
    q = statistics.quantiles(xs, n=4)
    return [_r(q[0]), _r(q[2])]


def _r(x: Optional[float], nd: int = 3) -> Optional[float]:
    return None if x is None else round(x, nd)


def startup_parts(procs: List[Proc]) -> dict:
    """Process start -> first step end of the given (fresh) workers, and its phases."""
    ps = [p for p in procs if p.steps and p.info]
    per = [p.steps[0]["t_end"] - p.info["t_proc"] for p in ps]
    return {
        "startup_s": _r(_median(per)),
        "per_worker_s": [_r(x) for x in per],
        "import_s": _r(_median(p.info["t_imported"] - p.info["t_proc"] for p in ps)),
        "model_s": _r(_median(p.info["t_model"] - p.info["t_imported"] for p in ps)),
        "restore_s": _r(_median(p.info["t_built"] - p.info["t_model"] for p in ps)),
        "fit_to_first_step_s": _r(_median(p.steps[0]["t_end"] - p.info["t_fit"] for p in ps)),
    }


def steady_steps(r0: Proc, exclude: set) -> Dict[int, List[float]]:
    """{size: rank 0's step-to-step intervals}, leaving out the steps in `exclude`."""
    by_step = {s["step"]: s for s in r0.steps}
    out: Dict[int, List[float]] = {}
    for s in r0.steps:
        prev = by_step.get(s["step"] - 1)
        if prev is None or s["step"] in exclude:
            continue
        if prev["size"] == prev["size_after"] == s["size"]:
            out.setdefault(s["size"], []).append(s["t_end"] - prev["t_end"])
    return out


def analyse_elastic(args, procs: List[Proc]):
    """(rows, rank 0's records)"""
    r0 = rank0(procs)
    steps = {s["step"]: s for s in r0.steps}
    switches = [s for s in r0.steps if s["size_after"] != s["size"] and not s.get("detached")]
    asks = sorted(r0.asks, key=lambda a: a["t"])
    fresh = [p for p in procs if not p.joining]
    fresh_row = {"measure": "fresh_startup", "np": args.small, **startup_parts(fresh)}
    # Steps that are not "normal": those run while joiners were starting, and the first step
    # after each switch (the pause).
    exclude, pending_of = set(), {}
    for sw in switches:
        ask = max((a for a in asks if a["step"] <= sw["step"] and a["to"] == sw["size_after"]),
                  key=lambda a: a["step"], default=None)
        pending = list(range(ask["step"] + 1, sw["step"] + 1)) if ask else []
        pending_of[sw["step"]] = (ask, pending)
        exclude.update(pending)
        exclude.add(sw["step"] + 1)
    normal = steady_steps(r0, exclude)
    normal_s = {n: _median(v) for n, v in normal.items()}
    busy = {sw["step"] for sw in switches} | {a["step"] for a in asks} | exclude
    hook_normal = _median(s["t_hook"] - s["t_end"] for s in r0.steps if s["step"] not in busy)
    rows = [fresh_row]
    count: Dict[str, int] = {}
    for sw in switches:
        old, new = sw["size"], sw["size_after"]
        change = f"{old}->{new}"
        count[change] = count.get(change, 0) + 1
        nxt = steps.get(sw["step"] + 1)
        if nxt is None:
            continue
        boundary = nxt["t_end"] - sw["t_end"]
        target = TARGET_PAUSE_OUT if new > old else TARGET_PAUSE_IN
        step_new = normal_s.get(new)
        pause = None if step_new is None else boundary - step_new
        rows.append({
            "measure": "pause", "change": change, "cycle": count[change],
            "pause_s": _r(pause), "boundary_s": _r(boundary), "step_old_s": _r(normal_s.get(old)),
            "step_new_s": _r(step_new), "step_new_iqr_s": _iqr(normal.get(new)),
            "hook_s": _r(sw["t_hook"] - sw["t_end"]), "hook_normal_s": _r(hook_normal),
            "first_step_after_s": _r(nxt["t_end"] - sw["t_hook"]), "switch_step": sw["step"],
            "target_s": target, "within_target": None if pause is None else pause < target})
        ask, pending = pending_of[sw["step"]]
        if ask is None:
            continue
        pending_dt = [steps[i]["t_end"] - steps[i - 1]["t_end"] for i in pending
                      if i in steps and i - 1 in steps]
        row = {"measure": "resize_to_first_step", "change": change, "cycle": count[change],
               "ask_step": ask["step"], "switch_step": sw["step"],
               "pending_steps": len(pending), "pending_step_s": _r(_median(pending_dt))}
        joiners = [p for p in procs if p.joining and p.steps
                   and p.steps[0]["step"] == sw["step"] + 1]
        if new > old:
            if not joiners:
                raise JobFailed(f"{change} at step {sw['step']}: no records of its joiners")
            first_end = max(p.steps[0]["t_end"] for p in joiners)
            ready = max(p.ready for p in joiners)
            row.update({
                "time_s": _r(first_end - ask["t"]),
                "joiners": len(joiners),
                "launch_s": _r(min(p.info["t_proc"] for p in joiners) - ask["t"]),
                "joiner_startup_s": [_r(p.info["t_fit"] - p.info["t_proc"]) for p in joiners],
                "rehearse_s": [_r(p.ready - p.info["t_fit"]) for p in joiners],
                "all_ready_s": _r(ready - ask["t"]),
                "ready_to_switch_s": _r(sw["t_end"] - ready),
                "switch_to_first_step_s": _r(first_end - sw["t_end"]),
                "joiner_sync_s": _r(max(p.joined for p in joiners) - sw["t_end"]),
            })
        else:
            row.update({"time_s": _r(nxt["t_end"] - ask["t"]), "joiners": 0})
        fs = fresh_row["startup_s"]
        row["fresh_startup_s"] = fs
        row["pause_s"] = _r(pause)
        row["target_s"] = _r(fs + pause) if fs is not None and pause is not None else None
        row["within_target"] = (row["time_s"] <= row["target_s"]
                                if row["target_s"] is not None else None)
        rows.append(row)
    return rows, r0


def timeline_row(r0: Proc, t0: float) -> dict:
    """Rank 0's steps as columns, times in seconds since t0 (the elastic job's launch)."""
    ends = [s["t_end"] for s in r0.steps]
    return {"measure": "timeline", "step": [s["step"] for s in r0.steps],
            "size": [s["size"] for s in r0.steps], "t_end_s": [_r(t - t0) for t in ends],
            "step_s": [None] + [_r(b - a) for a, b in zip(ends, ends[1:])],
            "asks": [{"t_s": _r(a["t"] - t0), "step": a["step"], "to": a["to"]}
                     for a in sorted(r0.asks, key=lambda a: a["t"])]}


def analyse_restart(change: str, saved: dict, old_job: dict, new_job: dict,
                    procs: List[Proc]) -> dict:
    ps = [p for p in procs if p.steps and p.info]
    if not ps:
        raise JobFailed(f"restart {change}: no records")
    first_end = max(p.steps[0]["t_end"] for p in ps)
    first_proc = min(p.info["t_proc"] for p in ps)
    r0 = rank0(procs)
    dts = [b["t_end"] - a["t_end"] for a, b in zip(r0.steps[1:], r0.steps[2:])]
    parts = startup_parts(ps)
    return {
        "measure": "restart", "change": change,
        "time_s": _r(first_end - saved["t0"]),
        "save_s": _r(saved["t1"] - saved["t0"]),
        "stop_s": _r(old_job["t_exit"] - saved["t1"]),
        "relaunch_s": _r(first_proc - old_job["t_exit"]),
        "startup_s": _r(first_end - first_proc),
        "import_s": parts["import_s"], "model_s": parts["model_s"],
        "restore_s": parts["restore_s"], "fit_to_first_step_s": parts["fit_to_first_step_s"],
        "checkpoint_bytes": saved.get("bytes"),
        "restarted_step_s": _r(_median(dts)),
        "np": len(ps),
    }


# -- output -------------------------------------------------------------------------------------


def _f(x, nd=2) -> str:
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "NO"
    return f"{x:.{nd}f}"


def change_sizes(change: str) -> Tuple[int, int]:
    """'2->4' -> (2, 4)"""
    old, new = change.split("->")
    return int(old), int(new)


def normal_steps(rows: List[dict]) -> Dict[int, float]:
    """{size: rank 0's normal step time}, as the pause rows give it (old and new size)."""
    out: Dict[int, float] = {}
    for r in rows:
        if r["measure"] == "pause":
            old, new = change_sizes(r["change"])
            out.update({n: v for n, v in ((old, r["step_old_s"]), (new, r["step_new_s"]))
                        if v is not None})
    return out


def print_table(rows: List[dict]) -> None:
    run = next(r for r in rows if r["measure"] == "run")
    normal_s = normal_steps(rows)
    print()
    print(f"resize latency, {run['params']:,} parameters, batch {run['batch_size']}/worker, "
          f"{run['cpus']} cpus, load average {run['loadavg_before'][0]:.2f} before, "
          f"{run['loadavg_after'][0]:.2f} after, {run['wall_s']:.0f} s in all")
    fresh = next(r for r in rows if r["measure"] == "fresh_startup")
    print("normal step (rank 0, median): " + ", ".join(
        f"np={n}: {_f(v)} s" for n, v in sorted(normal_s.items()) if v is not None)
        + f"; fresh worker start-up (np={fresh['np']}, process start -> first step end): "
          f"{_f(fresh['startup_s'])} s (import {_f(fresh['import_s'])}, model "
          f"{_f(fresh['model_s'])}, fit -> first step {_f(fresh['fit_to_first_step_s'])})")
    print()
    head = ["change", "#", "boundary", "= switch", "+ step", "normal step old/new",
            "new p25-p75", "(a) pause",
            "target (a)", "ok", "(b) ask->1st step", "pending steps", "target (b)", "ok"]
    table = []
    pauses = {(r["change"], r["cycle"]): r for r in rows if r["measure"] == "pause"}
    lat = {(r["change"], r["cycle"]): r for r in rows if r["measure"] == "resize_to_first_step"}
    for key in sorted(pauses, key=lambda k: pauses[k]["switch_step"]):
        a, b = pauses[key], lat.get(key, {})
        table.append([key[0], str(key[1]), _f(a["boundary_s"]), _f(a["hook_s"]),
                      _f(a["first_step_after_s"]),
                      f"{_f(a['step_old_s'])}/{_f(a['step_new_s'])}",
                      "-".join(_f(x) for x in a["step_new_iqr_s"] or [None]),
                      _f(a["pause_s"]),
                      f"< {_f(a['target_s'], 1)}", _f(a["within_target"]),
                      _f(b.get("time_s")),
                      f"{b.get('pending_steps', '-')} x {_f(b.get('pending_step_s'))}",
                      f"<= {_f(b.get('target_s'))}", _f(b.get("within_target"))])
    _print_rows(head, table)
    for r in rows:
        if r["measure"] == "resize_to_first_step" and r.get("joiners"):
            launch = (f"ask -> first joiner process {_f(r['launch_s'])}" if r["launch_s"] >= 0
                      else f"first joiner process (a warm spare) {_f(-r['launch_s'])} before "
                           "the ask")
            print(f"  (b) {r['change']} #{r['cycle']}: {launch}, -> all joiners ready (in model.fit, step rehearsed) "
                  f"{_f(r['all_ready_s'])}, -> switch (rank 0's step end) "
                  f"+{_f(r['ready_to_switch_s'])}, -> joiners' first step end "
                  f"+{_f(r['switch_to_first_step_s'])} (joiners synced "
                  f"+{_f(r['joiner_sync_s'])} after the switch); joiner start-up "
                  f"(process -> model.fit) {', '.join(_f(x) for x in r['joiner_startup_s'])}"
                  f", rehearsal {', '.join(_f(x) for x in r['rehearse_s'])}")
    restarts = [r for r in rows if r["measure"] == "restart"]
    if restarts:
        print()
        head = ["change", "(c) save->1st step", "save", "stop", "relaunch", "start-up",
                "(of it: import/model/restore/fit->step)", "checkpoint", "step after"]
        table = []
        for r in restarts:
            table.append([r["change"], _f(r["time_s"]), _f(r["save_s"]), _f(r["stop_s"]),
                          _f(r["relaunch_s"]), _f(r["startup_s"]),
                          "/".join(_f(r[k]) for k in ("import_s", "model_s", "restore_s",
                                                       "fit_to_first_step_s")),
                          f"{(r['checkpoint_bytes'] or 0) / 2**20:.0f} MiB",
                          _f(r["restarted_step_s"])])
        _print_rows(head, table)
    print()
    hooks = [r["hook_normal_s"] for r in rows if r["measure"] == "pause"]
    print("seconds; boundary: from rank 0's last step end before the switch to its first step "
          "end after it = kf.Hook's work at the switch (agree, swap peers, sync joiners; "
          f"{_f(hooks[0] if hooks else None, 3)} on a normal step) + the first step at the new "
          "size (it waits for the joiners' first step); (a) pause = boundary - normal step at "
          "the new size: how long the switch held training up; (b) from rank 0's kf.resize call to the joiners' first "
          "step end (shrinking: rank 0's); (c) from the start of the checkpoint save to the "
          "restarted job's first step end.")


def _print_rows(head: List[str], table: List[List[str]]) -> None:
    widths = [max(len(head[i]), *(len(row[i]) for row in table)) if table else len(head[i])
              for i in range(len(head))]
    print("  ".join(h.ljust(w) for h, w in zip(head, widths)))
    for row in table:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)))


# -- plot (--plot) -----------------------------------------------------------------------------


def plot(rows: List[dict], path: str) -> None:
    """Rank 0's timeline on the left; (a), (b) and (c) per change as bars on the right."""
    timeline = next((r for r in rows if r["measure"] == "timeline"), None)
    if timeline is None:
        raise SystemExit("--plot: the records hold no timeline (written since --plot exists)")
    plt = pyplot()
    fig, (ax, bars) = plt.subplots(1, 2, figsize=(13, 4.6), width_ratios=[2.2, 1])
    plot_timeline(ax, timeline, [r for r in rows if r["measure"] == "pause"])
    plot_latencies(bars, rows)
    run = next((r for r in rows if r["measure"] == "run"), None)
    if run:
        fig.suptitle(f"resize of an elastic job: {run['params']:,} parameters, batch "
                     f"{run['batch_size']}/worker, {run['optimizer']}, {run['cpus']} cpus")
    save(fig, path)


def plot_timeline(ax, timeline: dict, pauses: List[dict]) -> None:
    """Cluster size over time (steps) with each step's duration as a point on a second axis;
    every switch's boundary shaded and labelled with its pause, the kf.resize calls dotted."""
    t, size = timeline["t_end_s"], timeline["size"]
    ax.step(t, size, where="pre", color="C0", label="cluster size")
    sizes = sorted(set(size))
    ax.set_yticks(sizes)
    ax.set_ylim(min(sizes) - 0.5, max(sizes) + 0.5)
    ax.set_xlabel("time since the elastic job's launch (s), at rank 0's step ends")
    ax.set_ylabel("cluster size (workers)", color="C0")
    at = {st: i for i, st in enumerate(timeline["step"])}
    for p in pauses:
        i = at.get(p["switch_step"])
        if i is None or i + 1 >= len(t):
            continue
        ax.axvspan(t[i], t[i + 1], color="C3", alpha=0.25, linewidth=0)
        # a grow's label at the top right of its span, a shrink's at the bottom left: a short
        # --gap puts the two close together
        old, new = change_sizes(p["change"])
        grow = new > old
        ax.annotate(f"{p['change']}\npause {p['pause_s']:.2f} s" if p["pause_s"] is not None
                    else p["change"], (t[i + 1] if grow else t[i],
                                       max(sizes) + 0.45 if grow else min(sizes) - 0.45),
                    fontsize=7, va="top" if grow else "bottom", ha="left" if grow else "right",
                    color="C3")
    for a in timeline["asks"]:
        ax.axvline(a["t_s"], color="gray", linestyle=":", linewidth=1)
    durations = ax.twinx()
    pts = [(x, d) for x, d in zip(t, timeline["step_s"]) if d is not None]
    durations.plot(*zip(*pts), "o", color="C1", markersize=3, label="step time")
    durations.set_ylabel("step time: interval between step ends (s)", color="C1")
    durations.set_ylim(bottom=0)
    ax.set_title("rank 0: size (line), step times (dots), switch boundaries (shaded), "
                 "kf.resize calls (dotted)", fontsize=9)


def plot_latencies(ax, rows: List[dict]) -> None:
    """Per change: the median (a) pause and (b) resize -> first step over the cycles, and (c)
    checkpoint + restart stacked by its parts."""
    changes = list(dict.fromkeys(r["change"] for r in rows if r["measure"] == "pause"))
    width = 0.27
    for i, change in enumerate(changes):
        for k, (measure, key, label) in enumerate((("pause", "pause_s", "(a) pause"),
                                                   ("resize_to_first_step", "time_s",
                                                    "(b) resize -> first step"))):
            v = _median(r[key] for r in rows if r["measure"] == measure
                        and r["change"] == change and r.get(key) is not None)
            if v is not None:
                ax.bar(i + (k - 1) * width, v, width, color=f"C{k + 3}",
                       label=label if i == 0 else None)
                ax.annotate(f"{v:.2f}", (i + (k - 1) * width, v), ha="center", va="bottom",
                            fontsize=7)
        restart = next((r for r in rows if r["measure"] == "restart" and r["change"] == change),
                       None)
        if restart:
            bottom = 0.0
            for j, part in enumerate(("save_s", "stop_s", "relaunch_s", "startup_s")):
                ax.bar(i + width, restart[part], width, bottom=bottom, color=f"C{j + 6}",
                       label=f"(c) {part[:-2]}" if i == 0 else None)
                bottom += restart[part]
            ax.annotate(f"{restart['time_s']:.2f}", (i + width, bottom), ha="center",
                        va="bottom", fontsize=7)
    ax.set_xticks(range(len(changes)), changes)
    ax.set_xlabel("change of cluster size")
    ax.set_ylabel("seconds (median over cycles)")
    ax.set_title("(a) pause, (b) resize -> first step, (c) checkpoint + restart", fontsize=9)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=7)


# -- main -----------------------------------------------------------------------------------------


def params_of(width: int) -> int:
    return 1024 * width + width + width * width + width + width * 1024 + 1024 + 1024 + 1


def replay(args) -> int:
    """--from-json: the table (and --plot) of a saved run."""
    rows = read_json_lines(args.from_json)
    print_table(rows)
    if args.plot:
        plot(rows, args.plot)
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.plot:
        pyplot()  # without matplotlib, stop before the jobs run
    if args.from_json:
        return replay(args)
    out = args.keep or tempfile.mkdtemp(prefix="resize_latency.")
    os.makedirs(out, exist_ok=True)
    report = JsonLines(args.json)
    rows, emit = report.rows, report.emit

    load_before = os.getloadavg()
    t0 = time.time()
    try:
        ckpt_a = os.path.join(out, "ckpt-a", "ckpt")
        ckpt_b = os.path.join(out, "ckpt-b", "ckpt")
        elastic = run_job(
            args, "elastic job",
            ["-w", "-np", str(args.small), "-H", f"127.0.0.1:{args.big}",
             "-builtin-config-port", str(free_ports(1)[0]), "-port-range",
             free_port_range(args.big), "-spares", str(args.spares)],
            worker_args(args, "elastic", "elastic", out) + ["--save", ckpt_a],
            os.path.join(out, "elastic.log"))
        procs = read_procs(out, "elastic")
        erows, r0 = analyse_elastic(args, procs)
        for row in erows + [timeline_row(r0, elastic["t_launch"])]:
            emit(row)
        expected = 2 * args.cycles
        got = sum(1 for r in erows if r["measure"] == "pause")
        if got != expected:
            why = (f"a resize to {args.big} was abandoned at step {r0.abandoned[0]['step']} "
                   "(its joiners were not ready within --resize-timeout)" if r0.abandoned
                   else "")
            raise JobFailed(f"elastic job: {got} switches, expected {expected}; {why} "
                            f"(launcher log: {os.path.join(out, 'elastic.log')}, kept with "
                            "--keep)")
        if not args.no_restart:
            saved_a = r0.saves[-1]
            extra = ["--broadcast"] if args.restart_broadcast else []
            big = run_job(
                args, f"restart np={args.big}",
                ["-np", str(args.big), "-H", f"127.0.0.1:{args.big}", "-port-range",
                 free_port_range(args.big)],
                worker_args(args, "restart", "big", out) + ["--restore", saved_a["path"],
                                                            "--save", ckpt_b] + extra,
                os.path.join(out, "restart-big.log"))
            big_procs = read_procs(out, "big")
            emit(analyse_restart(f"{args.small}->{args.big}", saved_a, elastic, big, big_procs))
            saved_b = rank0(big_procs).saves[-1]
            small = run_job(
                args, f"restart np={args.small}",
                ["-np", str(args.small), "-H", f"127.0.0.1:{args.big}", "-port-range",
                 free_port_range(args.big)],
                worker_args(args, "restart", "small", out) + ["--restore", saved_b["path"]]
                + extra, os.path.join(out, "restart-small.log"))
            emit(analyse_restart(f"{args.big}->{args.small}", saved_b, big, small,
                                 read_procs(out, "small")))
        run = {"measure": "run", "wall_s": _r(time.time() - t0, 1),
               "loadavg_before": [round(x, 2) for x in load_before],
               "loadavg_after": [round(x, 2) for x in os.getloadavg()],
               "cpus": os.cpu_count(), "params": params_of(args.width),
               "optimizer": args.optimizer, "batch_size": args.batch_size,
               "small": args.small, "big": args.big, "cycles": args.cycles,
               "threads": args.threads, "restart_broadcast": args.restart_broadcast,
               "elastic_steps": r0.steps[-1]["step"],
               "epoch_boundaries": r0.steps[-1].get("epoch", 0) - r0.steps[0].get("epoch", 0)}
        emit(run)
        print_table(rows)
        if args.plot:
            plot(rows, args.plot)
        return 0
    except JobFailed as e:
        print(f"resize_latency: {e}", file=sys.stderr)
        return 1
    finally:
        report.close()
        if not args.keep:
            shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
