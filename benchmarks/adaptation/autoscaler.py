"""The scaling-efficiency autoscaler (Or et al.) against static sizes (seed-papers.md, B5).

    python benchmarks/adaptation/autoscaler.py [--max 4] [--runs 2] [--plot a.png]

The same training (benchmarks/adaptation/_worker.py: digits with a 64-1024-1024-10 MLP, whose
steps are compute-bound; model.fit, kf.ElasticData, kf.Hook; --epochs passes over the data) at every static size k = 1 .. --max (kungfu-run -np k),
and with kf.policy.ScalingAutoscaler(threshold=S) from 1 worker under kungfu-run -w with --max
slots and --spares warm spares (default 1: a probe's grow takes a started worker); the arms
interleaved. The throughput curve is real: the workers share this machine's
cores, so it flattens where the cores run out (about 2 here); --sample-time adds emulated
compute per sample instead (sleeping workers scale until the slots run out).

Reported per arm, median [min, max] over runs: job time (first to last step), worker-seconds
(the integral of the cluster size over the job time: the "GPU time" of the paper), and for the
autoscaler its decision trace (sizes probed, the efficiency s of each probe, where it settled).
The oracle k* is the largest static k whose marginal efficiency over k - 1, from the static
runs' throughputs, exceeds S.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

from _common import REPO, cell, pyplot, run_job, save

sys.path.insert(0, str(REPO))

from kungfu._ports import free_port_range, free_ports  # noqa: E402


def run(arm: str, args) -> dict:
    worker = ["--epochs", str(args.epochs), "--batch-size", str(args.batch_size),
              "--seed", str(args.seed), "--hidden", args.hidden, "--lr", "0.01"]
    if arm == "autoscaler":
        launcher = ["-w", "-np", "1", "-H", f"127.0.0.1:{args.max}",
                    "-builtin-config-port", str(free_ports(1)[0]),
                    "-port-range", free_port_range(args.max), "-spares", str(args.spares)]
        worker += ["--policy", f"autoscale:{args.threshold}"]
    else:
        k = int(arm.split("=")[1])
        launcher = ["-np", str(k), "-port-range", free_port_range(k)]
    env = {"KUNGFU_SAMPLE_TIME": str(args.sample_time)} if args.sample_time else {}
    rows = run_job(launcher, worker, env, arm)
    steps = [row for row in rows if "step" in row]
    seconds = sum((b["t"] - a["t"]) * b["size"] for a, b in zip(steps, steps[1:]))
    samples = sum(row["size"] * args.batch_size for row in steps[1:])
    trace = next((row["autoscaler"] for row in rows if "autoscaler" in row), None)
    return {"arm": arm, "jct": steps[-1]["t"] - steps[0]["t"], "worker_seconds": seconds,
            "throughput": samples / (steps[-1]["t"] - steps[0]["t"]), "trace": trace,
            "sizes": [(row["step"], row["t"] - steps[0]["t"], row["size"]) for row in steps]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--max", type=int, default=4, help="slots: the largest size (default 4)")
    p.add_argument("--runs", type=int, default=2, help="runs per arm, interleaved (default 2)")
    p.add_argument("--threshold", type=float, default=0.1, help="S (default 0.1)")
    p.add_argument("--epochs", type=int, default=40, help="(default 40)")
    p.add_argument("--hidden", default="1024,1024",
                   help="the MLP's hidden widths (default 1024,1024: compute-bound steps)")
    p.add_argument("--batch-size", type=int, default=32, help="per worker (default 32)")
    p.add_argument("--sample-time", type=float, default=0.0,
                   help="emulated seconds of compute per sample (default 0: real compute)")
    p.add_argument("--spares", type=int, default=1,
                   help="the autoscaler's warm spares (kungfu-run -spares): a probe's grow "
                        "takes one instead of starting a worker (default 1; 0: none)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", help="also write every run's numbers to this file")
    p.add_argument("--plot", help="draw the autoscaler's sizes over time here (matplotlib)")
    args = p.parse_args()
    arms = [f"static k={k}" for k in range(1, args.max + 1)] + ["autoscaler"]
    results = []
    for i in range(args.runs):
        for arm in arms:
            res = run(arm, args)
            res["run"] = i
            results.append(res)
            print(json.dumps({k: v for k, v in res.items() if k != "sizes"}), flush=True)
    rate = {k: statistics.median(r["throughput"] for r in results
                                 if r["arm"] == f"static k={k}") for k in range(1, args.max + 1)}
    oracle = 1
    for k in range(2, args.max + 1):
        s = (rate[k] - rate[k - 1]) / (rate[k - 1] / (k - 1))
        if s > args.threshold:
            oracle = k
        else:
            break
    load = os.getloadavg()[0]
    print(f"\n{args.epochs} epochs of digits, batch {args.batch_size} per worker, S = "
          f"{args.threshold}, {args.spares} warm spares, {args.runs} runs per arm; median "
          f"[min, max]; load average at the end {load:.2f}")
    print("static throughput (samples/s): " + ", ".join(f"k={k}: {v:.0f}"
                                                         for k, v in rate.items())
          + f"; oracle k* = {oracle}")
    print(f"{'arm':12}{'job time (s)':>24}{'worker-seconds':>24}")
    for arm in arms:
        mine = [r for r in results if r["arm"] == arm]
        print(f"{arm:12}{cell([r['jct'] for r in mine], '{:.1f}'):>24}"
              f"{cell([r['worker_seconds'] for r in mine], '{:.1f}'):>24}")
    for r in results:
        if r["arm"] == "autoscaler":
            steps = " -> ".join(
                f"{t['probe']}" if "probe" in t else
                (f"settle {t['k']}" if t.get("settled") else f"(s={t['s']:.2f})")
                for t in r["trace"])
            print(f"autoscaler run {r['run']}: 1 -> {steps}")
    print("\nOr et al.: best cases -45% job time and -85.1% GPU time against over- or "
          "under-provisioned static sizes")
    if args.json:
        Path(args.json).write_text("\n".join(json.dumps(r) for r in results) + "\n")
    if args.plot:
        plt = pyplot()
        if plt is None:
            return 0
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for r in results:
            if r["arm"] == "autoscaler":
                _, t, k = zip(*r["sizes"])
                ax.step(t, k, where="post", label=f"run {r['run']}")
        ax.axhline(oracle, ls="--", color="grey", lw=0.8, label="oracle k*")
        ax.set_xlabel("seconds")
        ax.set_ylabel("workers")
        ax.legend(fontsize=7)
        save(fig, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
