"""What gradient monitoring costs per training step: kf.Optimizer with and without monitor=...

One command runs everything (it starts the workers itself, through kungfu-run):

    python benchmarks/monitoring_overhead.py --np 2,4

For every worker count N, N workers train the small ResNet-style CNN of keras_throughput.py
(synthetic 32x32x3 images, one fixed batch of --batch-size per worker, 10 classes) with
`kf.Optimizer(keras.optimizers.SGD(0.01 * N, momentum=0.9))` in several configurations
(--configs), each its own model and optimizer in the same worker process, created in the same
order on every worker:

  off          no monitor (the baseline)
  gns          monitor="gns" (gradient noise scale), batch_size=--batch-size, every step
  variance     monitor="variance" (gradient variance), every step
  both         monitor=["gns", "variance"], every step
  NAME@k       the same with monitor_interval=k (e.g. variance@8)

The default is off,gns,variance,variance@8,both (add gns@8 with --configs; each configuration
adds a sixth or so to the run time).

Each configuration is warmed up with model.fit (tracing; rank 0's weights broadcast by
BroadcastGlobalVariablesCallback), then the configurations take turns step by step: a round is
one train_on_batch step of every configuration (the compiled training step that model.fit runs,
on the same batch), round i starting at configuration i mod C so that none always follows the
same one. A step's time is the slowest worker's. The rounds are grouped in --blocks blocks of
--steps consecutive rounds; a block's time per configuration is the sum of its --steps steps.
With monitor_interval=k the monitors run on the steps whose optimizer iteration is a multiple of
k, so --steps must be a multiple of every k (8 by default): then every block holds the same
number of monitored steps of each configuration.

overhead = median over the blocks of (time of the configuration / time of `off` in the same
block) - 1. The steps of a block interleave within seconds, so load on the machine that comes
and goes falls on all configurations alike, and the median drops the blocks that a burst of
load disturbed anyway. Also reported: overhead_of_medians (median block time / median block
time of off - 1) and overhead_best (fastest block / fastest block of off - 1).

--fit-rounds R adds a cross-check with model.fit itself: R rounds, in each one fit() of every
configuration (rotating the order), of 2 untimed lead-in steps and --steps steps timed as in
keras_throughput.py; fit_overhead is the median over the rounds of the same ratio. It is off by
default: on a 2-core machine every fit() call costs seconds of set-up outside the timed steps.

Targets, printed next to the figures: gns every step < 3%, variance every step < 5%,
variance every 8th step < 2%.

At the end each worker reads every configuration's estimates from its optimizer
(`optimizer.kungfu_monitor.value(...)`: kf.grad_noise_scale() and kf.grad_variance() read only
the most recently built monitor, and here there are several). The driver checks that they are
the same on every worker and finite (gns may stay NaN only while the EMA of |G|^2 is <= 0), and
that every model's trainable weights ended the same on every worker (it exits 1 otherwise).

Output: one JSON line per (N, configuration) on stdout (also written to --json PATH), then a
table. Keys: np, config, monitor, interval, batch_per_worker, steps (per block), blocks, step_s
(median block time / steps), step_s_min, step_s_max, overhead, overhead_of_medians,
overhead_quartiles (first and third quartile over the blocks of the same ratio - 1, the noise to
judge overhead by), overhead_best, target (null where none is set), within_target, gns,
grad_variance (null where not monitored; NaN is written as null too), gns_g2_ema (the EMA of
|G|^2), gns_stale (gns_g2_ema <= 0, so gns is the last valid estimate; marked * in the table),
monitored_steps (samples the estimator took, warm-up included), estimates_agree (the same on
every worker), threads, loadavg_before, loadavg_after (1-minute load average of this machine
around the run at N), wall_s (the run at N, process start-up included), rank0_phases_s (seconds
since rank 0's process started: models built, warm, fit rounds done, steps done); with
--fit-rounds also fit_step_s and fit_overhead.

On a machine with few cores the N workers share them: step times grow with N, and any other
load on the machine lands directly in the step times. Run it more than once before drawing
conclusions.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
import types
from typing import Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

from _common import JsonLines  # noqa: E402
from keras_throughput import (  # noqa: E402
    _T0,
    _clear_results,
    _configure_tf,
    _loadavg,
    _write_result,
    build_model,
    collect,
    compile_model,
    interleaved_steps,
    launch_kungfu,
    run_rounds,
    synthetic_dataset,
    trainable_digest,
)

DEFAULT_CONFIGS = "off,gns,variance,variance@8,both"
MONITORS = {"off": [], "gns": ["gns"], "variance": ["variance"], "both": ["gns", "variance"]}
# Overhead targets (fractions) by (monitors, interval).
TARGETS = {(("gns",), 1): 0.03, (("variance",), 1): 0.05, (("variance",), 8): 0.02}
RESULT_PREFIX = "monitor"


# ---------------------------------------------------------------------------------------------
# Arguments


def parse_config(text: str) -> dict:
    """"variance@8" -> {"label": "variance@8", "monitor": ["variance"], "interval": 8}."""
    name, _, interval = text.strip().lower().partition("@")
    if name not in MONITORS:
        raise ValueError(f"unknown configuration {text!r}: NAME or NAME@k with NAME one of "
                         f"{', '.join(MONITORS)}")
    try:
        k = int(interval) if interval else 1
    except ValueError:
        k = 0
    if k < 1:
        raise ValueError(f"configuration {text!r}: the interval must be a positive integer")
    if name == "off" and k != 1:
        raise ValueError("configuration 'off' takes no interval")
    return {"label": name if k == 1 else f"{name}@{k}", "monitor": MONITORS[name],
            "interval": k}


def parse_configs(text: str) -> List[dict]:
    configs, seen = [], set()
    for part in text.split(","):
        if part.strip():
            c = parse_config(part)
            if c["label"] not in seen:
                seen.add(c["label"])
                configs.append(c)
    if "off" not in seen:
        configs.insert(0, parse_config("off"))
    return configs


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description="Step time of Keras training with kf.Optimizer, with and without gradient "
                    "monitoring (gradient noise scale, gradient variance), the configurations "
                    "taking turns step by step. Starts the workers itself (kungfu-run). "
                    "overhead = median over blocks of (block time of a configuration / block "
                    "time of off) - 1. Targets: gns < 3%, variance < 5%, variance@8 < 2%. "
                    "Prints a JSON line per worker count and configuration, then a table.",
        epilog="Example: python benchmarks/monitoring_overhead.py --np 2,4   "
               "(the module docstring explains the measurement and every output key)")
    p.add_argument("--np", default="2,4",
                   help="worker counts, comma separated; each runs as its own kungfu-run job "
                        "(default 2,4; the estimates need at least 2 workers)")
    p.add_argument("--configs", default=DEFAULT_CONFIGS,
                   help="configurations, comma separated: off, gns, variance or both, each "
                        "optionally NAME@k for monitor_interval=k; 'off' (the baseline) is "
                        f"added when missing (default {DEFAULT_CONFIGS})")
    p.add_argument("--batch-size", type=int, default=64,
                   help="samples per step per worker, also the batch_size given to the "
                        "optimizer for the gradient noise scale (default 64)")
    p.add_argument("--steps", type=int, default=8,
                   help="timed steps of each configuration per block (a block: --steps "
                        "rounds of one step per configuration); must be a multiple of every "
                        "interval in --configs (default 8)")
    p.add_argument("--blocks", type=int, default=8,
                   help="timed blocks; the overhead is the median over them of the per-block "
                        "ratio to off (default 8)")
    p.add_argument("--warmup-steps", type=int, default=4,
                   help="untimed model.fit steps per configuration before the timed ones, the "
                        "first of which traces the step (default 4)")
    p.add_argument("--fit-rounds", type=int, default=0,
                   help="also time this many rounds of model.fit calls (one per configuration, "
                        "2 untimed + --steps timed steps each), for fit_overhead (default 0)")
    p.add_argument("--threads", type=int, default=0,
                   help="TensorFlow intra- and inter-op threads per worker; 0: the machine's "
                        "cores divided by N, at least 1 (default 0)")
    p.add_argument("--strategy", default=None,
                   help="kungfu allreduce strategy (kungfu-run -strategy; default: the "
                        "launcher's)")
    p.add_argument("--timeout", type=float, default=600,
                   help="seconds the run at one worker count may take before it is stopped "
                        "(default 600)")
    p.add_argument("--json", default=None, help="also write the JSON lines to this file")
    p.add_argument("--keep", default=None,
                   help="keep the workers' result files and log in this directory (default: a "
                        "temporary directory, removed at the end)")
    # Internal: the worker side.
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    try:
        args.config_list = parse_configs(args.configs)
    except ValueError as e:
        p.error(str(e))
    for name in ("batch_size", "steps", "blocks", "warmup_steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.fit_rounds < 0:
        p.error("--fit-rounds must be at least 0")
    uneven = [c["label"] for c in args.config_list if args.steps % c["interval"]]
    if uneven:
        p.error(f"--steps {args.steps} is not a multiple of the interval of "
                f"{', '.join(uneven)}: blocks would hold different numbers of monitored steps")
    return args


def threads_for(args, np_: int) -> int:
    return args.threads if args.threads > 0 else max(1, (os.cpu_count() or 1) // np_)


# ---------------------------------------------------------------------------------------------
# Worker side (imports TensorFlow)


def _finite_or_none(x: float) -> Optional[float]:
    return x if math.isfinite(x) else None


def estimates(optimizer) -> dict:
    """The monitor's latest estimates and state, as JSON values (NaN as None)."""
    monitor = optimizer.kungfu_monitor
    if monitor is None:
        return {}
    out = {"iterations": int(optimizer.iterations.numpy())}
    if "gns" in monitor.monitors:
        state = monitor.gns_state.numpy()
        out.update(gns=_finite_or_none(monitor.value("gns")),
                   gns_g2_ema=_finite_or_none(float(state[1])), gns_samples=int(state[2]))
    if "variance" in monitor.monitors:
        out.update(grad_variance=_finite_or_none(monitor.value("variance")),
                   variance_samples=int(monitor.variance_state.numpy()[1]))
    return out


def worker(args) -> None:
    import kungfu as kf

    rank, size = kf.rank(), kf.size()
    tf = _configure_tf(threads_for(args, size))
    import keras

    from kungfu.tensorflow import BroadcastGlobalVariablesCallback

    keras.utils.set_random_seed(1234 + rank)
    data = synthetic_dataset(tf, args.batch_size, seed=rank)
    entries, optimizers = [], {}
    for c in args.config_list:
        options = {}
        if c["monitor"]:
            options = {"monitor": c["monitor"], "monitor_interval": c["interval"],
                       "batch_size": args.batch_size}
        opt = kf.Optimizer(keras.optimizers.SGD(learning_rate=0.01 * size, momentum=0.9),
                           op_prefix=f"monitoring_overhead/{c['label']}", **options)
        model = build_model(keras)
        compile_model(keras, model, opt)
        entries.append((c["label"], model, [BroadcastGlobalVariablesCallback()]))
        optimizers[c["label"]] = opt
    phases: dict = {}
    # Warm-up fits, then --fit-rounds rounds of fit() calls.
    fit_args = types.SimpleNamespace(warmup_steps=args.warmup_steps, steps=args.steps,
                                     rounds=args.fit_rounds)
    fit_times = run_rounds(keras, entries, data, fit_args, phases, rotate=True)
    steps = interleaved_steps([(label, model) for label, model, _ in entries],
                              args.blocks * args.steps, args.batch_size, seed=rank)
    phases["steps_done_s"] = round(time.time() - _T0, 2)
    digest = hashlib.sha256()
    for _, model, _ in entries:
        digest.update(trainable_digest(model).encode())
    _write_result(args.out, f"{RESULT_PREFIX}-np{size}-rank{rank}", {
        "rank": rank, "np": size, "times": fit_times, "steps": steps,
        "params": entries[0][1].count_params(), "phases": phases,
        "digest": digest.hexdigest()[:16], "threads": threads_for(args, size),
        "estimates": {label: estimates(opt) for label, opt in optimizers.items()}})


# ---------------------------------------------------------------------------------------------
# Driver side (never imports TensorFlow)


def run_np(args, np_: int, out_dir: str) -> None:
    _clear_results(out_dir, RESULT_PREFIX, np_)
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--out", out_dir,
           "--configs", ",".join(c["label"] for c in args.config_list),
           "--batch-size", str(args.batch_size), "--steps", str(args.steps),
           "--blocks", str(args.blocks), "--warmup-steps", str(args.warmup_steps),
           "--fit-rounds", str(args.fit_rounds), "--threads", str(args.threads)]
    launch_kungfu(np_, cmd, os.path.join(out_dir, f"{RESULT_PREFIX}-np{np_}.log"),
                  args.strategy, args.timeout, f"monitoring_overhead at np={np_}")


def read_results(out_dir: str, np_: int) -> List[dict]:
    per_rank = []
    for r in range(np_):
        with open(os.path.join(out_dir, f"{RESULT_PREFIX}-np{np_}-rank{r}.json")) as f:
            per_rank.append(json.load(f))
    return per_rank


def block_times(per_rank: List[dict], label: str, steps: int) -> List[float]:
    """Seconds per block of `steps` consecutive steps, each step the slowest worker's."""
    slowest = [max(ts) for ts in zip(*(d["steps"][label] for d in per_rank))]
    return [sum(slowest[i:i + steps]) for i in range(0, len(slowest) - steps + 1, steps)]


def overhead(times: List[float], base: List[float]) -> float:
    """Median over paired blocks (or rounds) of times / base, minus 1."""
    return statistics.median(t / b for t, b in zip(times, base)) - 1


def quartiles(times: List[float], base: List[float]) -> List[float]:
    """First and third quartile of times / base - 1 over paired blocks: the noise to judge the
    median by."""
    ratios = [t / b - 1 for t, b in zip(times, base)]
    if len(ratios) < 2:
        return [ratios[0], ratios[0]]
    q = statistics.quantiles(ratios, n=4)
    return [q[0], q[2]]


def rows_for(args, np_: int, per_rank: List[dict], fit_times: Dict[str, List[float]],
             extra: dict) -> List[dict]:
    blocks = {c["label"]: block_times(per_rank, c["label"], args.steps)
              for c in args.config_list}
    off = blocks["off"]
    rows = []
    for c in args.config_list:
        label = c["label"]
        t = blocks[label]
        est = per_rank[0]["estimates"][label]
        target = TARGETS.get((tuple(c["monitor"]), c["interval"]))
        ovh = overhead(t, off)
        row = {
            "np": np_, "config": label, "monitor": c["monitor"], "interval": c["interval"],
            "batch_per_worker": args.batch_size, "steps": args.steps, "blocks": len(t),
            "step_s": round(statistics.median(t) / args.steps, 5),
            "step_s_min": round(min(t) / args.steps, 5),
            "step_s_max": round(max(t) / args.steps, 5),
            "overhead": round(ovh, 4),
            "overhead_quartiles": [round(q, 4) for q in quartiles(t, off)],
            "overhead_of_medians": round(statistics.median(t) / statistics.median(off) - 1, 4),
            "overhead_best": round(min(t) / min(off) - 1, 4),
            "target": target, "within_target": None if target is None else ovh < target,
            "gns": est.get("gns"), "grad_variance": est.get("grad_variance"),
            "gns_g2_ema": est.get("gns_g2_ema"),
            # The estimator keeps its last valid value while the EMA of |G|^2 is <= 0.
            "gns_stale": ("gns" in c["monitor"] and est.get("gns") is not None
                          and est.get("gns_g2_ema") is not None and est["gns_g2_ema"] <= 0),
            "monitored_steps": est.get("gns_samples", est.get("variance_samples")),
            "estimates_agree": (all(d["estimates"][label] == est for d in per_rank[1:])
                                if c["monitor"] else None),
            "threads": per_rank[0]["threads"],
        }
        if fit_times.get(label):
            row["fit_step_s"] = round(statistics.median(fit_times[label]) / args.steps, 5)
            row["fit_overhead"] = round(overhead(fit_times[label], fit_times["off"]), 4)
        row.update(extra)
        rows.append(row)
    return rows


def problems_of(row: dict) -> List[str]:
    where = f"np={row['np']} {row['config']}"
    if not row["monitor"]:
        return []
    out = []
    if row["estimates_agree"] is False:
        out.append(f"{where}: the workers' estimates differ")
    if row["np"] > 1:
        if "variance" in row["monitor"] and row["grad_variance"] is None:
            out.append(f"{where}: grad_variance is not a finite number")
        if "gns" in row["monitor"] and row["gns"] is None and not (
                row["gns_g2_ema"] is not None and row["gns_g2_ema"] <= 0):
            out.append(f"{where}: gns is not a finite number, and the EMA of |G|^2 is "
                       f"{row['gns_g2_ema']}")
    return out


def _fmt_value(row: dict, monitor: str, key: str) -> str:
    if monitor not in row["monitor"]:
        return "-"
    v = row[key]
    return "NaN" if v is None else f"{v:.4g}" + ("*" if row.get(f"{key}_stale") else "")


def _pct(x: Optional[float], width: int) -> str:
    return f"{'-':>{width}}" if x is None else f"{100 * x:>+{width - 1}.1f}%"


def print_table(rows: List[dict]) -> None:
    fit = any("fit_overhead" in r for r in rows)
    print()
    head = (f"{'np':>3} | {'config':<11} | {'step ms':>7} | {'overhead':>8} | {'target':>9} | "
            f"{'quartiles':>13} | {'of medians':>10} | {'best':>7} | ")
    head += f"{'fit':>7} | " if fit else ""
    head += f"{'gns':>11} | {'grad_variance':>13}"
    print(head)
    print("-" * len(head))
    for r in rows:
        base = r["config"] == "off"
        if r["target"] is None:
            target = "" if base else "-"
        else:
            target = f"<{100 * r['target']:.0f}% " + ("ok" if r["within_target"] else "MISS")
        cells = [f"{r['np']:>3}", f"{r['config']:<11}", f"{1000 * r['step_s']:>7.1f}",
                 f"{'(base)':>8}" if base else _pct(r["overhead"], 8), f"{target:>9}",
                 f"{'':>13}" if base else "{:+.1f}..{:+.1f}%".format(
                     *(100 * q for q in r["overhead_quartiles"])).rjust(13),
                 _pct(r["overhead_of_medians"], 10), _pct(r["overhead_best"], 7)]
        if fit:
            cells.append(_pct(r.get("fit_overhead"), 7))
        cells += [f"{_fmt_value(r, 'gns', 'gns'):>11}",
                  f"{_fmt_value(r, 'variance', 'grad_variance'):>13}"]
        print(" | ".join(cells))
    print()
    print("step ms: median block time / steps (slowest worker per step). overhead: median over "
          "blocks of (time / time of off in the same block) - 1; quartiles: the first and third "
          "quartile of that ratio - 1 over the blocks; of medians: ratio of the median block "
          "times - 1; best: ratio of the fastest blocks - 1"
          + ("; fit: the same as overhead, from model.fit rounds" if fit else "") + ".")
    if any(r.get("gns_stale") for r in rows):
        print("gns*: the last valid estimate, kept because the EMA of |G|^2 (gns_g2_ema) is <= 0 "
              "now: the averaged gradient is smaller than the spread of the workers' gradients.")
    print()


def driver(args) -> int:
    try:
        nps = [int(x) for x in args.np.split(",") if x.strip()]
    except ValueError:
        print(f"--np: worker counts separated by commas, got {args.np!r}", file=sys.stderr)
        return 2
    if not nps or min(nps) < 1:
        print("--np: at least one worker count, each at least 1", file=sys.stderr)
        return 2
    out_dir = args.keep or tempfile.mkdtemp(prefix="monitoring_overhead.")
    os.makedirs(out_dir, exist_ok=True)
    report = JsonLines(args.json)
    rows = report.rows
    problems: List[str] = []
    try:
        for n in nps:
            before = _loadavg()
            t0 = time.monotonic()
            run_np(args, n, out_dir)
            wall = time.monotonic() - t0
            after = _loadavg()
            # collect: the fit rounds (slowest worker per round); it also checks that every
            # worker ended with the same trainable weights.
            fit_times = collect(out_dir, RESULT_PREFIX, n)
            extra = {"loadavg_before": before, "loadavg_after": after, "wall_s": round(wall, 1),
                     "rank0_phases_s": fit_times["_phases"]}
            for row in rows_for(args, n, read_results(out_dir, n), fit_times, extra):
                report.emit(row)
                problems += problems_of(row)
    finally:
        report.close()
        if not args.keep:
            shutil.rmtree(out_dir, ignore_errors=True)
    print_table(rows)
    for p in problems:
        print("problem:", p, file=sys.stderr)
    return 1 if problems else 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    return driver(args)


if __name__ == "__main__":
    sys.exit(main())
