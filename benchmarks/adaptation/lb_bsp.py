"""LB-BSP against equal-split BSP with an emulated straggler (seed-papers.md, B7).

    python benchmarks/adaptation/lb_bsp.py [--np 4] [--runs 2] [--plot lb_bsp.png]

Each run is `kungfu-run -np N` of benchmarks/adaptation/_worker.py (digits MLP, model.fit,
kf.ElasticData, kf.Hook), the arms interleaved, the same data and seeds. Compute is emulated so
that the experiment means something on a 2-core machine: kf.ElasticData sleeps
KUNGFU_SAMPLE_TIME (--sample-time) per sample of each batch, times the worker's slowdown factor
(KUNGFU_SLOWDOWN); the real model is tiny. Scenarios:

- static: worker 1 is 2x slower for the whole run (ideal LB-BSP gain 3.5/2 = 1.75x at np 4);
- moving: worker 1 is 2x slower until step --move-at, then worker 3 is and worker 1 is not.

Arms: bsp (equal split), lb-last, lb-ewma, lb-narx (kf.policy.LoadBalancing's predictors).
Reported per arm, median [min, max] over runs: mean step time (after the first --skip steps), the
speedup over bsp, the barrier-idle fraction (per step, the mean over workers of 1 - compute /
step time), the test accuracy after each epoch, and the job's wall time. --plot draws the step
times and the slow workers' batch sizes of one run per arm (needs matplotlib).
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

from kungfu._ports import free_port_range  # noqa: E402

ARMS = ("bsp", "lb-last", "lb-ewma", "lb-narx")
SCENARIOS = ("static", "moving")


def run(arm: str, scenario: str, args) -> dict:
    slowdown = "1:2" if scenario == "static" else f"1:2,1:1@{args.move_at},3:2@{args.move_at}"
    rows = run_job(["-np", str(args.np), "-port-range", free_port_range(args.np)],
                   ["--policy", arm, "--epochs", str(args.epochs), "--batch-size",
                    str(args.batch_size), "--seed", str(args.seed)],
                   {"KUNGFU_SAMPLE_TIME": str(args.sample_time), "KUNGFU_SLOWDOWN": slowdown},
                   f"{arm}/{scenario}")
    steps = [row for row in rows if "step" in row]
    epochs = [row for row in rows if "epoch_end" in row]
    timed = [row for row in steps if row["step"] > args.skip and row["compute_times"]]
    idle = [statistics.mean(1 - c / row["step_time"] for c in row["compute_times"])
            for row in timed]
    return {"arm": arm, "scenario": scenario,
            "step_time": statistics.mean(row["step_time"] for row in timed),
            "idle": statistics.mean(idle), "accuracy": [e["accuracy"] for e in epochs],
            "wall": steps[-1]["t"] - steps[0]["t"],
            "trace": [(row["step"], row["step_time"], row["batch_sizes"]) for row in steps]}


def plot(results, path: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(2, len(SCENARIOS), figsize=(11, 6), sharex=True)
    for col, scenario in enumerate(SCENARIOS):
        for arm in ARMS:
            mine = [r for r in results if r["arm"] == arm and r["scenario"] == scenario]
            if not mine:
                continue
            steps, times, sizes = zip(*mine[0]["trace"])
            axes[0][col].plot(steps, [t * 1000 for t in times], label=arm, lw=0.8)
            if arm != "bsp":
                axes[1][col].plot(steps, [s[1] for s in sizes], label=f"{arm}: worker 1", lw=0.8)
                axes[1][col].plot(steps, [s[3] for s in sizes], "--", lw=0.8,
                                  label=f"{arm}: worker 3")
        axes[0][col].set_title(f"{scenario}: step time (ms)")
        axes[1][col].set_title("batch size of the slowed workers")
        axes[1][col].set_xlabel("step")
    axes[0][0].legend(fontsize=7)
    axes[1][0].legend(fontsize=6)
    save(fig, path)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--np", type=int, default=4, help="workers (default 4)")
    p.add_argument("--runs", type=int, default=2, help="runs per arm, interleaved (default 2)")
    p.add_argument("--arms", default=",".join(ARMS), help=f"(default {','.join(ARMS)})")
    p.add_argument("--scenarios", default=",".join(SCENARIOS),
                   help=f"(default {','.join(SCENARIOS)})")
    p.add_argument("--epochs", type=int, default=5, help="(default 5)")
    p.add_argument("--batch-size", type=int, default=16, help="per worker (default 16)")
    p.add_argument("--sample-time", type=float, default=0.004,
                   help="emulated seconds of compute per sample (default 0.004)")
    p.add_argument("--move-at", type=int, default=60, help="moving: step of the change")
    p.add_argument("--skip", type=int, default=20,
                   help="steps left out of the step time and idle fraction (default 20)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", help="also write every run's numbers to this file")
    p.add_argument("--plot", help="draw a PNG here (needs matplotlib)")
    args = p.parse_args()
    arms = [a for a in args.arms.split(",") if a]
    scenarios = [s for s in args.scenarios.split(",") if s]
    results = []
    for i in range(args.runs):
        for scenario in scenarios:
            for arm in arms:
                res = run(arm, scenario, args)
                res["run"] = i
                results.append(res)
                print(json.dumps({k: v for k, v in res.items() if k != "trace"}), flush=True)
    load = os.getloadavg()[0]
    print(f"\nnp={args.np}, batch {args.batch_size} per worker, {args.sample_time * 1000:g} ms "
          f"emulated compute per sample, {args.runs} runs per arm; median [min, max]; "
          f"load average at the end {load:.2f}")
    for scenario in scenarios:
        print(f"\n{scenario}: " + ("worker 1 2x slower" if scenario == "static" else
                                    f"worker 1 2x slower, worker 3 from step {args.move_at}"))
        base = statistics.median(r["step_time"] for r in results
                                 if r["arm"] == "bsp" and r["scenario"] == scenario) \
            if "bsp" in arms else None
        print(f"{'arm':9}{'step time (ms)':>24}{'speedup':>24}{'idle fraction':>24}"
              f"{'wall (s)':>24}  accuracy per epoch (first run)")
        for arm in arms:
            mine = [r for r in results if r["arm"] == arm and r["scenario"] == scenario]
            speed = cell([base / r["step_time"] for r in mine], "{:.2f}") if base else "-"
            print(f"{arm:9}{cell([r['step_time'] * 1000 for r in mine], '{:.1f}'):>24}"
                  f"{speed:>24}{cell([r['idle'] for r in mine]):>24}"
                  f"{cell([r['wall'] for r in mine], '{:.1f}'):>24}  "
                  + " ".join(f"{a:.3f}" for a in mine[0]["accuracy"]))
    print("\nLB-BSP (Chen et al.): up to 2x (SoCC'18 poster), up to 54% (SoCC'20); ideal here "
          f"sum(v) / (n min v) = {(args.np - 0.5) / (args.np * 0.5):.2f}x")
    if args.json:
        Path(args.json).write_text("\n".join(json.dumps(r) for r in results) + "\n")
    if args.plot:
        plot(results, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
