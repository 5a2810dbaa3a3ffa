"""The seeds' adaptation policies on an emulated cluster of accelerators (8-16 workers on a
machine of 2 cores): each experiment against its baseline, in one run.

    python benchmarks/adaptation/emulated.py --experiment EXPERIMENT

(EXPERIMENT: calibration, autoscaler, bound, straggler, lbbsp, gns, spot, arbiter.)

Every worker is a real kungfu worker (kungfu-run, the runtime, the gradients' allreduce, resize,
recovery, warm spares, checkpoints, kungfu's policies) whose compute is an emulated accelerator
that sleeps (_emulator.Device, _emu_worker.py); progress is counted by Pollux's statistical
efficiency fed by the measured gradient noise scale, and an arm ends when it reaches the
target. One JSON line per arm: experiment, arm, jct_s (wall seconds from the first step to the
step that reached the target), worker_s (the workers held over that time), steps,
target_reached, and what the experiment measures besides. The parameters and where they come
from: benchmarks/README.md, "The emulated cluster".
"""
from __future__ import annotations

import argparse
import json
import os
import random
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(HERE))

from _arbiter import Curve, decide, goodput, resized_peers  # noqa: E402
from _emulator import Device, Link, fit_device  # noqa: E402
from kungfu._ports import free_port_range, free_ports  # noqa: E402
from kungfu.store import connect  # noqa: E402

# An emulated V100 training ResNet-50, from the KungFu README's chart (16 V100 in 2 DGX-1,
# KungFu sync-SGD, global batch 256/1024/4096 = per GPU 16/64/256: 1361, 4433, 5504 img/s):
# t(64) = 0.231 s and t(256) = 0.744 s give 60 ms + 2.67 ms a sample; t(16) = 0.188 s, more than
# 60 + 16 x 2.67 ms, is the device not full below 48 samples (LB-BSP's non-linear GPU curve).
V100_RESNET50 = "0.0599,0.002673,48"
# ResNet-50's gradients (214 float32 tensors, benchmarks/resnet50_sizes.json) over the links
# measured here: one host, np 2: 20 ms for the fused set (docs: notes of #38, 19.7-20.8 ms), so
# 5.1 GB/s inside a host; across hosts 10 Gbit/s at the 1.28x of the limit that AUTO measured
# on 16 cores (benchmarks/README.md, multihost.py: 103-106 ms against 81.9 ms), so 0.78 GB/s.
# Four accelerators a host (Or et al.'s P100 nodes).
RESNET50_LINK = "102334368,5.1e9,7.8e8,4"


def worker_cmd(args, extra):
    return [sys.executable, str(HERE / "_emu_worker.py"), "--scale", str(args.scale), *extra]


def launch(launcher, worker, env_extra=None, timeout=900, log=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUNGFU_")}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1",
               MKL_NUM_THREADS="1")
    env.update(env_extra or {})
    cmd = [sys.executable, "-m", "kungfu.cmd", "-q", "-timeout", f"{timeout}s", *launcher,
           *worker]
    out = subprocess.PIPE if log is None else log  # a log: a job polled, not read at the end
    return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.PIPE if log is None else
                            subprocess.STDOUT, text=True, start_new_session=True)


def finish(proc, what, timeout=900):
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
    return proc.returncode, out, err


def read(path):
    p = Path(path)
    if not p.exists():
        return []
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]


def summary(experiment, arm, rows, extra=None, t0=None, held=None):
    """The arm's JSON line from rank 0's records (step rows, then the done row)."""
    steps = [r for r in rows if "step" in r]
    done = next((r for r in rows if r.get("done")), None)
    first = steps[0]["t"] if t0 is None else t0
    end = steps[-1]["t"]
    worker_s = sum((b["t"] - a["t"]) * a["size"] for a, b in zip(steps, steps[1:]))
    if held is not None:
        worker_s += held
    out = {"experiment": experiment, "arm": arm, "jct_s": round(end - first, 2),
           "worker_s": round(worker_s, 1), "steps": steps[-1]["step"],
           "target_reached": bool(done and done["reached"]),
           "final_size": steps[-1]["size"], "accuracy": done and done["accuracy"]}
    out.update(extra or {})
    return out


def run_arm(args, launcher, worker, env=None):
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rank0.jsonl"
        proc = launch(launcher, worker_cmd(args, [*worker, "--out", str(out)]), env)
        rc, so, se = finish(proc, "arm")
        rows = read(out)
        if rc != 0 or not any(r.get("done") for r in rows):
            log = Path(tempfile.mkstemp(prefix="kungfu-emulated-", suffix=".log")[1])
            log.write_text(so + "\n--- stderr ---\n" + se)
            raise RuntimeError(f"an arm failed (rc {rc}; output in {log}):\n{se[-2000:]}")
        return rows


def static(n):
    return ["-np", str(n), "-port-range", free_port_range(n)]


def elastic(n, slots, spares=0, more=()):
    return ["-w", "-np", str(n), "-H", f"127.0.0.1:{slots}", "-builtin-config-port",
            str(free_ports(1)[0]), "-port-range", free_port_range(slots + spares),
            "-spares", str(spares), *more]


def emit(line):
    print(json.dumps(line), flush=True)
    return line


def common(args, batch, target, device=V100_RESNET50, link=RESNET50_LINK, base=None):
    out = ["--device", device, "--batch-size", str(batch), "--target", str(target),
           "--base-batch", str(base or batch), "--seed", str(args.seed)]
    return out + (["--link", link] if link else [])


def exp_autoscaler(args):
    """Or et al.: the autoscaler (kf.policy.ScalingAutoscaler, S = 0.1, from 4 workers, probing
    4 more at a time: Or's spawn size, one host; 4 warm spares) against every static size of
    4-16. --scaling strong (default): the global batch fixed at 1024 (Or's CIFAR-10 batch), each
    worker's part 1024 / n; weak: each worker's batch fixed at 64, the global batch 64 n."""
    strong = args.scaling == "strong"

    def work(n):
        if strong:
            return common(args, 1024 // n, args.target or 1024 * 150, base=1024) + [
                "--global-batch", "1024"]
        return common(args, 64, args.target or 60000, base=256)

    lines = []
    for n in (4, 8, 12, 16):
        lines.append(emit(summary("autoscaler", f"static:{n}", run_arm(args, static(n),
                                                                       work(n)),
                                  {"scaling": args.scaling})))
    rows = run_arm(args, elastic(4, 16, spares=4),
                   work(4) + ["--policy", "autoscaler:0.1", "--probe-step", "4",
                              "--startup", "20"])
    done = next(r for r in rows if r.get("done"))
    lines.append(emit(summary("autoscaler", "autoscaler", rows, {
        "scaling": args.scaling, "trace": [
            {k: (round(v, 3) if isinstance(v, float) else v) for k, v in t.items()}
            for t in done["decisions"].get("ScalingAutoscaler") or []]})))
    best = min(lines[:-1], key=lambda r: r["jct_s"])
    auto, small = lines[-1], lines[0]
    emit({"experiment": "autoscaler", "check": {
        "scaling": args.scaling, "best_static": best["arm"],
        "jct_vs_best": round(auto["jct_s"] / best["jct_s"], 3),
        "worker_s_vs_best": round(auto["worker_s"] / best["worker_s"], 3),
        "jct_vs_smallest": round(auto["jct_s"] / small["jct_s"], 3),
        "met": auto["jct_s"] <= 1.05 * best["jct_s"] and auto["worker_s"] <= 0.8 * best[
            "worker_s"] and auto["jct_s"] <= 0.6 * small["jct_s"]}})


def exp_bound(args):
    """Whether the autoscaler's three targets can be met together at all in this model (strong
    scaling, the sizes 4-16, the V100 device and the ResNet-50 link), by an oracle that runs at
    the right size from the first step and resizes for free: for each global batch B, the
    emulated step time of every static size, and the sizes m that would meet "within 5% of
    the fastest static size's time at <= 0.8x its worker-seconds" and ">= 40% less time than
    static 4". No training: arithmetic on the models that the other experiments run."""
    device, link = Device.parse(V100_RESNET50), Link.parse(RESNET50_LINK)
    sizes = (4, 8, 12, 16)
    met = []
    for batch in range(64, 65536 + 1, 64):
        t = {n: device.step_time(batch // n) + link.allreduce_time(n) for n in sizes}
        best = min(sizes, key=t.get)
        near = [m for m in sizes if t[m] <= 1.05 * t[best] and m * t[m] <= 0.8 * best * t[best]]
        faster = [m for m in sizes if t[m] <= 0.6 * t[4]]
        both = sorted(set(near) & set(faster))
        if both:
            met.append(batch)
        if batch & (batch - 1) == 0:  # powers of two: the table
            emit({"experiment": "bound", "global_batch": batch,
                  "step_s": {n: round(t[n], 4) for n in sizes}, "fastest": best,
                  "within_5pct_at_0.8x_worker_s": near, "40pct_less_than_4": faster,
                  "both": both})
    emit({"experiment": "bound", "check": {"batches": "64-65536, every 64",
                                           "batches_where_an_oracle_meets_all": met,
                                           "met": bool(met)}})


def step_median(rows, own=False, skip=5):
    """The median step time (the step's compute and allreduce) of rank 0's records; `own`: with
    the compute counted in CPU seconds (what it takes with a core to itself), the rest as
    measured (the allreduce, waits for the other workers)."""
    rows = [r for r in rows if "step" in r and r["step"] > skip]
    if own:
        # the compute before the allreduce as the clock saw it, replaced by its CPU seconds
        return statistics.median(r["cpu"] + r["step_time"] - r["compute"] for r in rows)
    return statistics.median(r["step_time"] for r in rows)


def compute_median(rows, own=False, skip=5):
    """The median of rank 0's compute before the allreduce (CPU seconds with `own`): what the
    device model stands for. A fit on whole steps would count the allreduce and the update
    twice, in the device's fixed part and again when the emulated worker runs them."""
    rows = [r for r in rows if "step" in r and r["step"] > skip]
    return statistics.median(r["cpu"] if own else r["compute"] for r in rows)


def exp_calibration(args):
    """The device model against a real model: the digits MLP (64-1024-1024-10, numpy, one
    thread) at 1 worker on 16 and 64 samples gives (fixed, per_sample) from its compute before
    the allreduce; then at 1 and 2 workers
    on 32 samples a step of the real model and of the emulated device (running the same
    model's allreduce for real) are compared, each round fitting afresh, the arms interleaved.
    Two readings: wall (the real compute as the clock saw it: on a machine loaded by others it
    waits for a core) and own (the real compute in CPU seconds, the fit too: what it takes
    with a core to itself; allreduce and waits as measured). Errors of the rounds' medians."""
    real = ["--real", "--hidden", "1024,1024", "--target", "1e12", "--max-steps",
            str(args.steps), "--seed", str(args.seed)]
    got = {(n, k): [] for n in (1, 2) for k in ("wall", "own", "emu_wall", "emu_own")}
    for r in range(args.rounds):
        fits = {b: run_arm(args, static(1), real + ["--batch-size", str(b)]) for b in (16, 64)}
        devs = {own: fit_device(list(fits), [compute_median(x, own) for x in fits.values()])
                for own in (False, True)}
        specs = {own: f"{d.fixed:.6f},{d.per_sample:.8f}" for own, d in devs.items()}
        for n in (1, 2):
            rows = run_arm(args, static(n), real + ["--batch-size", "32"])
            got[n, "wall"].append(step_median(rows))
            got[n, "own"].append(step_median(rows, own=True))
            for own, key in ((False, "emu_wall"), (True, "emu_own")):
                got[n, key].append(step_median(run_arm(
                    args, static(n), [a for a in real if a != "--real"]
                    + ["--batch-size", "32", "--device", specs[own], "--scale", "1",
                       "--no-compute"])))
            emit({"experiment": "calibration", "arm": f"np:{n}", "round": r,
                  "device_wall": specs[False], "device_own": specs[True],
                  **{k: round(got[n, k][-1], 5) for k in ("wall", "emu_wall", "own",
                                                           "emu_own")}})
    for n in (1, 2):
        med = {k: statistics.median(got[n, k]) for k in ("wall", "own", "emu_wall", "emu_own")}
        err_wall = med["emu_wall"] / med["wall"] - 1
        err_own = med["emu_own"] / med["own"] - 1
        emit({"experiment": "calibration", "arm": f"np:{n}", "rounds": args.rounds,
              "measured_step_s": round(med["own"], 5), "emulated_step_s": round(
                  med["emu_own"], 5), "error": round(err_own, 3),
              "within_10pct": abs(err_own) <= 0.10, "measured_wall_s": round(med["wall"], 5),
              "emulated_wall_s": round(med["emu_wall"], 5), "error_wall": round(err_wall, 3)})


def exp_straggler(args):
    """Or et al.'s straggler replacement (kf.policy.StragglerReplacement) against keeping the
    straggler: 8 workers, one slot and one warm spare more; the worker that started as rank 3
    runs 2x (then, in other arms, 4x) slower from step 30."""
    onset = 30
    work = common(args, 64, args.target or 512 * 200, link="", base=512) + ["--startup", "20"]
    for factor in (2, 4):
        for arm in ("none", "stragglers"):
            rows = run_arm(args, elastic(8, 9, spares=1, more=["-max-restarts", "0"]),
                           work + ["--policy", arm, "--speeds", f"3:{factor}@{onset}"])
            done = next(r for r in rows if r.get("done"))
            steps = [r for r in rows if "step" in r]
            asked = done["decisions"].get("StragglerReplacement") or []
            switch = next((r["step"] for r in steps if r["version"] > steps[0]["version"]),
                          None)
            emit(summary("straggler", f"{arm}:{factor}x", rows, {
                "onset_step": onset,
                "decided_step": asked[0]["step"] if asked else None,
                "replaced_rank": asked[0]["rank"] if asked else None,
                "switched_step": switch,
                "replaced_within_steps": None if switch is None else switch - onset,
                "rate_before": rate(steps, 10, onset), "rate_slowed": rate(
                    steps, onset + 5, (asked[0]["step"] if asked else onset + 40)),
                "rate_after": rate(steps, (switch or 10 ** 9) + 5, 10 ** 9)}))


def rate(steps, first, last):
    """Samples a second over the steps first..last of the records (None: too few)."""
    sel = [r for r in steps if first <= r["step"] <= last]
    if len(sel) < 3:
        return None
    return round(sum(r["batch"] for r in sel[1:]) / (sel[-1]["t"] - sel[0]["t"]), 1)


def exp_lbbsp(args):
    """LB-BSP (kf.policy.LoadBalancing, EWMA predictor) against BSP (equal split): 8 workers,
    the global batch fixed at 1024, the workers that started as ranks 1 and 2 twice as slow
    all along. The ideal speed-up of balancing is sum(v) / (n min v) = 7 / 4 = 1.75. Throughput:
    samples/s from step 20 on, and from step 60 (the split has settled); step_overhead_s: the
    time between steps outside the step itself (the Loop's round, the records), which no split
    balances."""
    work = common(args, 128, args.target or 1024 * 120, link="", base=1024) + [
        "--speeds", "1:2,2:2"]
    out = {}
    for arm, policy in (("bsp", "none"), ("lbbsp", "lbbsp:ewma")):
        rows = run_arm(args, static(8), work + ["--policy", policy])
        steps = [r for r in rows if "step" in r]
        out[arm] = emit(summary("lbbsp", arm, rows, {
            "samples_per_s": rate(steps, 20, 10 ** 9),
            "samples_per_s_steady": rate(steps, 60, 10 ** 9),
            "step_overhead_s": round(statistics.median(
                b["t"] - a["t"] - b["step_time"] for a, b in zip(steps[20:], steps[21:])), 4),
            "final_split": steps[-1]["sizes"]}))
    speedup = out["lbbsp"]["samples_per_s"] / out["bsp"]["samples_per_s"]
    steady = out["lbbsp"]["samples_per_s_steady"] / out["bsp"]["samples_per_s_steady"]
    emit({"experiment": "lbbsp", "check": {
        "speedup": round(speedup, 3), "speedup_steady": round(steady, 3),
        "jct_ratio": round(out["bsp"]["jct_s"] / out["lbbsp"]["jct_s"], 3), "ideal": 1.75,
        "met": speedup >= 1.6}})


def exp_gns(args):
    """GNS batch growth (kf.policy.GNSBatchGrowth: double every worker's batch while the noise
    scale exceeds the global batch, checked every 10 steps, learning rate by the square-root
    rule; and goodput=True, which moves to the batch of the highest measured or predicted
    goodput) from 32 a worker against every fixed batch of 32-256 a worker: 8 workers on 2
    hosts (ResNet-50's allreduce over the measured link model), progress by Pollux's
    efficiency."""
    target = args.target or 60000
    lines = []
    for b in (32, 64, 128, 256):
        work = common(args, b, target, base=256)
        lines.append(emit(summary("gns", f"fixed:{b}", run_arm(args, static(8), work))))
    for arm in ("gns", "gns-goodput"):
        rows = run_arm(args, static(8), common(args, 32, target, base=256)
                       + ["--policy", f"{arm}:256"])
        done = next(r for r in rows if r.get("done"))
        lines.append(emit(summary("gns", arm, rows, {"growth": [
            (d["step"], d["batch"], d["why"], round(d["gns"]))
            for d in done["decisions"].get("GNSBatchGrowth", [])]})))
    best = min(lines[:-2], key=lambda r: r["jct_s"])
    emit({"experiment": "gns", "check": {"best_fixed": best["arm"], **{
        f"{r['arm']}_vs_best": round(r["jct_s"] / best["jct_s"], 3) for r in lines[-2:]},
        "met": {r["arm"]: r["target_reached"] and r["jct_s"] <= best["jct_s"]
                for r in lines[-2:]}}})


def alive(pid):
    try:
        os.kill(pid, 0)
        return True
    except OSError:
        return False


def first_step_time(path):
    """The time of the first step record in `path`, or None (none yet)."""
    try:
        with open(path) as f:
            line = f.readline()
    except OSError:
        return None
    return json.loads(line)["t"] if line.endswith("\n") else None


def spot_arm(args, arm, work, trace):
    """One arm of the spot experiment: runs (and, for restart, reruns) the job, revoking a
    random worker (SIGKILL) at each of the trace's times after the first step."""
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        out, pids = Path(tmp) / "rank0.jsonl", Path(tmp) / "pids"
        pids.mkdir()
        extra = ["--out", str(out), "--pid-dir", str(pids)]
        if arm == "restart":
            extra += ["--checkpoint", str(Path(tmp) / "ckpt"), "--checkpoint-every",
                      str(args.checkpoint_every)]
        pending, t0, launches, killed = list(trace), None, 0, []
        while launches <= len(trace) + 1:
            launches += 1
            # Every emulated worker is an instance of its own: a revocation says nothing of the
            # (one, real) host, which kungfu-run would otherwise cool down after two failures.
            launcher = (elastic(8, 8, more=["-max-restarts", str(len(trace) + 1),
                                            "-host-cooldown", "0"])
                        if arm == "elastic" else static(8))
            proc = launch(launcher, worker_cmd(args, work + extra))
            while proc.poll() is None:
                time.sleep(0.1)
                t0 = t0 or first_step_time(out)
                if t0 and pending and time.time() >= t0 + pending[0] * args.scale:
                    pending.pop(0)
                    live = sorted(int(p.name) for p in pids.iterdir() if alive(int(p.name)))
                    if live:
                        os.kill(rng.choice(live), signal.SIGKILL)
                        killed.append(time.time() - t0)
            rc, so, se = finish(proc, arm)
            rows = read(out)
            if any(r.get("done") for r in rows):
                break
            if arm == "elastic" or rc == 0:
                log = Path(tempfile.mkstemp(prefix="kungfu-emulated-", suffix=".log")[1])
                log.write_text(so + "\n--- stderr ---\n" + se)
                raise RuntimeError(f"the {arm} arm failed (rc {rc}; output in {log})")
        done = next(r for r in rows if r.get("done"))
        steps = [r for r in rows if "step" in r]
        sizes = [(round(b["t"] - t0, 1), b["size"]) for a, b in zip(steps, steps[1:])
                 if a["size"] != b["size"]]
        return summary("spot", arm, rows, {
            "revoked_at_s": [round(k, 1) for k in killed if k <= done["t"] - t0],
            "size_changes": sizes, "launches": launches,
            "steps_run": sum(1 for r in rows if "step" in r),
            "recoveries": done["recoveries"]})


def exp_spot(args):
    """Revocations of spot instances from a trace: elastic kungfu (kungfu-run -w: the survivors
    recover and go on, the launcher starts a worker in the lost one's place, which joins after
    its start-up) against restart from a checkpoint (the job stops at each revocation and
    starts again with a new worker, every worker paying its start-up, from the last checkpoint,
    written every --checkpoint-every steps). 8 workers, 20 s of start-up (emulated)."""
    trace = [float(t) for t in args.trace.split(",")]
    work = common(args, 64, args.target or 512 * 500, link="", base=512) + ["--startup", "20"]
    out = {arm: emit(spot_arm(args, arm, work, trace)) for arm in ("elastic", "restart")}
    emit({"experiment": "spot", "check": {
        "speedup": round(out["restart"]["jct_s"] / out["elastic"]["jct_s"], 3),
        "met": out["elastic"]["target_reached"]
        and out["restart"]["jct_s"] >= 1.5 * out["elastic"]["jct_s"]}})


# The arbiter's jobs (strong scaling, ResNet-50 on the V100 device and link models): "wide", a
# global batch of 2048 (its step is mostly compute: it scales, 0.9 s a step at 8 workers, 0.72 at
# 12), and "narrow", a global batch of 256 (at 8 workers 32 a worker, under the device's
# saturation, with 161 ms of allreduce across 2 hosts: 0.35 s a step, slower than 0.26 s at 4).
ARBITER_JOBS = (("wide", 2048, 2048 * 150), ("narrow", 256, 256 * 460))


def arbitrate(arm, jobs, pool, step, settle, window_s):
    """Polls the jobs' records until every job has ended; in the "arbiter" arm, moves workers
    between them (_arbiter.decide) through their config stores. Returns the moves."""
    curves = {j: Curve() for j in range(len(jobs))}
    moves, deadline, rows = [], time.time() + 900, {}
    while any(job["proc"].poll() is None for job in jobs) and time.time() < deadline:
        time.sleep(0.25)
        rows = {j: read(job["out"]) for j, job in enumerate(jobs)}
        if arm != "arbiter":
            continue
        sizes, ready = {}, True
        for j, job in enumerate(jobs):
            steps = [r for r in rows[j] if "step" in r]
            if job["proc"].poll() is not None or any(r.get("done") for r in rows[j]):
                continue  # ended: its accelerators are free
            size = steps[-1]["size"] if steps else None
            sizes[j] = job["want"]
            g = goodput(rows[j], size, settle, window_s) if size == job["want"] else None
            if g is None:
                ready = False
            else:
                curves[j].points[size] = g
        if not ready or not sizes:
            continue
        move = decide(sizes, curves, pool, step)
        if move is None:
            continue
        t0 = min(r["t"] for rs in rows.values() for r in rs if "step" in r)
        donor = None if move.donor is None else jobs[move.donor]["name"]
        moves.append({"t": round(time.time() - t0, 1), "from": donor,
                      "to": jobs[move.receiver]["name"], "workers": move.workers,
                      "why": move.why, "gain": round(move.gain, 3),
                      "loss": round(move.loss, 3),
                      "sizes": {jobs[j]["name"]: k for j, k in sizes.items()}})
        for j, k in ((move.donor, -move.workers), (move.receiver, move.workers)):
            if j is None:
                continue
            cfg, _ = jobs[j]["store"].config()
            jobs[j]["store"].request_cluster(resized_peers(cfg.peers, jobs[j]["slots"],
                                                           sizes[j] + k))
            jobs[j]["want"] = sizes[j] + k
    return moves


def arbiter_arm(args, arm, pool=16, step=4, settle=3, window_s=5.0):
    """The jobs of ARBITER_JOBS started at once on an even split of `pool` accelerators, each
    under kungfu-run -w with `pool` slots; in the "arbiter" arm, _arbiter.decide moves workers
    between them through each job's config store (the outside resize) from their goodput
    measured in their records; in "even", nothing moves."""
    token = secrets.token_hex(32)
    even = pool // len(ARBITER_JOBS)
    jobs, used = [], set()
    specs = ARBITER_JOBS[::-1] if args.reverse_jobs else ARBITER_JOBS
    with tempfile.TemporaryDirectory() as tmp:
        for j, (name, batch, target) in enumerate(specs):
            while True:
                a = int(free_port_range(pool).split("-")[0])
                if not used & set(range(a - pool, a + pool)):
                    break
            used.add(a)
            cport = free_ports(1)[0]
            out, log = Path(tmp) / f"{name}.jsonl", open(Path(tmp) / f"{name}.log", "w+")
            work = common(args, batch // even, target, base=batch) + [
                "--global-batch", str(batch), "--startup", "20", "--out", str(out)]
            launcher = ["-w", "-np", str(even), "-H", f"127.0.0.1:{pool}",
                        "-builtin-config-port", str(cport), "-port-range", f"{a}-{a + pool - 1}"]
            jobs.append({"name": name, "out": out, "log": log, "want": even, "proc": launch(
                launcher, worker_cmd(args, work), {"KUNGFU_JOB_TOKEN": token}, log=log),
                "store": connect(f"http://127.0.0.1:{cport}", token),
                "slots": [f"127.0.0.1:{p}" for p in range(a, a + pool)]})
        try:
            moves = arbitrate(arm, jobs, pool, step, settle, window_s)
        finally:  # whatever happened, no job outlives its arm
            for job in jobs:
                if job["proc"].poll() is None:
                    os.killpg(job["proc"].pid, signal.SIGKILL)
                job["proc"].wait()
        failed = []
        for job in jobs:
            job["log"].seek(0)
            if job["proc"].returncode != 0 or not any(r.get("done") for r in read(job["out"])):
                failed.append((job["name"], job["proc"].returncode, job["log"].read()[-3000:]))
        if failed:
            raise RuntimeError(f"the {arm} arm failed: {failed}")
        rows = {j: read(job["out"]) for j, job in enumerate(jobs)}
    t0 = min(r["t"] for rs in rows.values() for r in rs if "step" in r)
    lines = [emit(summary("arbiter", f"{arm}:{job['name']}", rows[j], {
        "sizes": [(round(b["t"] - t0, 1), b["size"]) for a, b in zip(
            [r for r in rows[j] if "step" in r], [r for r in rows[j] if "step" in r][1:])
                  if a["size"] != b["size"]]}, t0=t0)) for j, job in enumerate(jobs)]
    return emit({"experiment": "arbiter", "arm": arm, "pool": pool,
                 "avg_jct_s": round(statistics.mean(x["jct_s"] for x in lines), 2),
                 "makespan_s": round(max(x["jct_s"] for x in lines), 2),
                 "worker_s": round(sum(x["worker_s"] for x in lines), 1), "moves": moves})


def exp_arbiter(args):
    """Two jobs sharing 16 emulated accelerators (ARBITER_JOBS): an arbiter moving workers
    between them by their measured marginal goodput (_arbiter.py) against the even split (8
    and 8, fixed); each job's time from the first step of either job to its end. The arbiter's
    first probe moves workers to the first job listed (--reverse-jobs: to "narrow", the wrong
    way, which its measurements then undo)."""
    even = arbiter_arm(args, "even")
    arb = arbiter_arm(args, "arbiter")
    emit({"experiment": "arbiter", "check": {
        "avg_jct_vs_even": round(arb["avg_jct_s"] / even["avg_jct_s"], 3),
        "makespan_vs_even": round(arb["makespan_s"] / even["makespan_s"], 3),
        "met": arb["avg_jct_s"] < even["avg_jct_s"] and arb["makespan_s"] <= even[
            "makespan_s"]}})


EXPERIMENTS = {"arbiter": exp_arbiter, "autoscaler": exp_autoscaler, "bound": exp_bound,
               "calibration": exp_calibration,
               "straggler": exp_straggler, "lbbsp": exp_lbbsp, "gns": exp_gns,
               "spot": exp_spot}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--experiment", required=True, choices=sorted(EXPERIMENTS))
    p.add_argument("--scale", type=float, default=0.5,
                   help="wall seconds per emulated second (default 0.5: twice as fast)")
    p.add_argument("--target", type=float, default=0,
                   help="progress to reach, in base-batch samples (default: the experiment's)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--steps", type=int, default=60, help="calibration: steps per run")
    p.add_argument("--scaling", choices=("strong", "weak"), default="strong",
                   help="autoscaler: the global batch fixed (strong) or each worker's (weak)")
    p.add_argument("--trace", default="30,70,110,150",
                   help="spot: revocations, emulated seconds after the first step")
    p.add_argument("--checkpoint-every", type=int, default=50,
                   help="spot: the restart arm's checkpoint interval in steps (default 50)")
    p.add_argument("--reverse-jobs", action="store_true",
                   help="arbiter: list the narrow job first (the first probe grows it)")
    p.add_argument("--rounds", type=int, default=3, help="calibration: rounds (default 3)")
    args = p.parse_args()
    t = time.time()
    EXPERIMENTS[args.experiment](args)
    print(f"# {args.experiment}: {time.time() - t:.0f} s, load average "
          f"{os.getloadavg()[0]:.1f}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
