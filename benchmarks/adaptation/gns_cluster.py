"""The KungFu talk's GNS policy, which grows the cluster while the gradient noise scale grows,
against static cluster sizes: which reaches the target accuracy first (the talk's policy as
printed, with the two fixes its class in _worker.py names).

    python benchmarks/adaptation/gns_cluster.py [--max 4] [--runs 2] [--target 0.95]

The same training (benchmarks/adaptation/_worker.py: digits MLP, SGD with momentum, model.fit,
kf.ElasticData, kf.Hook, --batch-size samples per worker, so the global batch grows with the
cluster) at every static size k = 1 .. --max (kungfu-run -np k) and with the talk's policy
(`--policy talk-gns`: after every step, kf.resize(kf.size() + 1) while the noise scale averaged
over the workers grows) from --start workers (default 2: one worker has no noise scale, which
needs two batch sizes, so from 1 the policy never grows) under kungfu-run -w with --max slots
and --spares warm spares; the arms interleaved, the same seed in every arm of a run (run i
uses seed --seed + i).

Reported per arm, median [min, max] over runs: seconds from the first step until the test
accuracy (measured after each epoch) first reaches --target ("missed" where it never does),
the worker-seconds spent until then, the final accuracy, and for the policy the sizes it went
through. The best static size is the one with the smallest median time to the target.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
from pathlib import Path

from _common import REPO, cell, run_job

sys.path.insert(0, str(REPO))

from kungfu._ports import free_port_range, free_ports  # noqa: E402

POLICY = "talk-gns"


def run(arm: str, seed: int, args) -> dict:
    worker = ["--epochs", str(args.epochs), "--batch-size", str(args.batch_size),
              "--seed", str(seed), "--lr", str(args.lr), "--hidden", args.hidden]
    if arm == POLICY:
        launcher = ["-w", "-np", str(args.start), "-H", f"127.0.0.1:{args.max}",
                    "-builtin-config-port", str(free_ports(1)[0]),
                    "-port-range", free_port_range(args.max), "-spares", str(args.spares)]
        worker += ["--policy", "talk-gns"]
    else:
        k = int(arm.split("=")[1])
        launcher = ["-np", str(k), "-port-range", free_port_range(k)]
    rows = run_job(launcher, worker, {}, arm)
    steps = [row for row in rows if "step" in row]
    t0 = steps[0]["t"]
    epochs = [row for row in rows if "epoch_end" in row]
    reached = next((row["t"] for row in epochs if row["accuracy"] >= args.target), None)

    def worker_seconds(until: float) -> float:
        return sum((min(b["t"], until) - a["t"]) * a["size"]
                   for a, b in zip(steps, steps[1:]) if a["t"] < until)

    sizes = []
    for row in steps:
        if not sizes or sizes[-1][1] != row["size"]:
            sizes.append((row["step"], row["size"], round(row["t"] - t0, 2)))
    return {"arm": arm, "seed": seed,
            "time_to_target": None if reached is None else reached - t0,
            "worker_seconds_to_target": None if reached is None else worker_seconds(reached),
            "final_accuracy": epochs[-1]["accuracy"] if epochs else math.nan,
            "job_time": steps[-1]["t"] - t0, "sizes": sizes}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--max", type=int, default=4, help="slots: the largest size (default 4)")
    p.add_argument("--runs", type=int, default=2, help="runs per arm, interleaved (default 2)")
    p.add_argument("--target", type=float, default=0.95,
                   help="test accuracy to reach (default 0.95)")
    p.add_argument("--start", type=int, default=2, help="the policy's first size (default 2)")
    p.add_argument("--epochs", type=int, default=8, help="(default 8)")
    p.add_argument("--hidden", default="1024,1024",
                   help="the MLP's hidden widths (default 1024,1024: compute-bound steps)")
    p.add_argument("--batch-size", type=int, default=16, help="per worker (default 16)")
    p.add_argument("--lr", type=float, default=0.05, help="(default 0.05)")
    p.add_argument("--spares", type=int, default=1,
                   help="the policy's warm spares (kungfu-run -spares; default 1)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", help="also write every run's numbers to this file")
    args = p.parse_args()
    arms = [f"static k={k}" for k in range(1, args.max + 1)] + [POLICY]
    results = []
    for i in range(args.runs):
        for arm in arms:
            res = run(arm, args.seed + i, args)
            res["run"] = i
            results.append(res)
            print(json.dumps(res), flush=True)

    def times(arm):
        return [r["time_to_target"] for r in results if r["arm"] == arm]

    def median_time(arm):
        got = [t for t in times(arm) if t is not None]
        return statistics.median(got) if len(got) == len(times(arm)) else math.inf

    best = min(arms[:-1], key=median_time)
    print(f"\n{args.epochs} epochs of digits, batch {args.batch_size} per worker, lr {args.lr}, "
          f"target accuracy {args.target}, {args.spares} warm spares, {args.runs} runs per arm; "
          f"median [min, max]; load average at the end {os.getloadavg()[0]:.2f}")
    print(f"{'arm':12}{'to target (s)':>24}{'worker-s to target':>24}{'final accuracy':>26}")
    for arm in arms:
        mine = [r for r in results if r["arm"] == arm]
        hit = [r for r in mine if r["time_to_target"] is not None]
        missed = len(mine) - len(hit)
        if hit:
            t = cell([r["time_to_target"] for r in hit], "{:.1f}")
            ws = cell([r["worker_seconds_to_target"] for r in hit], "{:.1f}")
        else:
            t = ws = "-"
        if missed:
            t += f", missed {missed}"
        print(f"{arm:12}{t:>24}{ws:>24}{cell([r['final_accuracy'] for r in mine]):>26}")
    for r in results:
        if r["arm"] == POLICY:
            path = " -> ".join(f"{k} (step {st}, {t:.1f} s)" for st, k, t in r["sizes"])
            print(f"{POLICY} run {r['run']}: {path}")
    policy = median_time(POLICY)
    print(f"best static size: {best} ({median_time(best):.1f} s); {POLICY}: "
          + (f"{policy:.1f} s" if math.isfinite(policy) else "missed the target in a run"))
    if args.json:
        Path(args.json).write_text("\n".join(json.dumps(r) for r in results) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
