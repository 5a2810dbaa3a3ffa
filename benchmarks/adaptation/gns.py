"""Batch growth from the gradient noise scale, and AdaScale, against fixed batches
(seed-papers.md, B3; KungFu's Fig. 4 in kind).

    python benchmarks/adaptation/gns.py [--np 2] [--seeds 2] [--target 0.95] [--plot g.png]

Each run is `kungfu-run -np N` of benchmarks/adaptation/_worker.py (digits MLP, SGD with
momentum, model.fit, kf.ElasticData, kf.Hook), the arms interleaved, the same data and seeds:

- small:      a fixed batch of --batch-size per worker, lr --lr;
- large:      a fixed batch of --max-batch per worker, lr scaled by the square-root rule;
- gns:        kf.policy.GNSBatchGrowth from --batch-size (every 20 steps: doubles while the
              noise scale exceeds the global batch), lr by the square-root rule;
- gns+adascale: the same growth, the learning rate from kf.policy.AdaScale's gain.

Reported, median [min, max] over seeds: the time and the steps until the test accuracy (after
an epoch) first reaches --target, the final accuracy, and the batch sizes the growth chose; the
plot shows the global batch against the measured noise scale, and the accuracy against time.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys

from _common import REPO, cell, pyplot, run_job, save

sys.path.insert(0, str(REPO))

from kungfu._ports import free_port_range  # noqa: E402

ARMS = ("small", "large", "gns", "gns+adascale")


def run(arm: str, seed: int, args) -> dict:
    b, lr = args.batch_size, args.lr
    policy = "bsp"
    if arm == "large":
        b, lr = args.max_batch, args.lr * math.sqrt(args.max_batch / args.batch_size)
    elif arm == "gns":
        policy = f"gns:{args.max_batch}"
    elif arm == "gns+adascale":
        policy = f"gns-adascale:{args.max_batch}"
    rows = run_job(["-np", str(args.np), "-port-range", free_port_range(args.np)],
                   ["--policy", policy, "--epochs", str(args.epochs), "--batch-size", str(b),
                    "--lr", str(lr), "--seed", str(seed)], {}, f"{arm} seed {seed}")
    steps = [r for r in rows if "step" in r]
    epochs = [r for r in rows if "epoch_end" in r]
    start = steps[0]["t"] - (steps[0]["step_time"] or 0)
    hit = next((e for e in epochs if e["accuracy"] >= args.target), None)
    hit_step = None if hit is None else max(r["step"] for r in steps if r["t"] <= hit["t"])
    return {"arm": arm, "seed": seed, "final": epochs[-1]["accuracy"],
            "time": None if hit is None else hit["t"] - start, "steps": hit_step,
            "batches": sorted({sum(r["batch_sizes"]) for r in steps}),
            "trace": [(r["step"], r["t"] - start, sum(r["batch_sizes"]), r["gns"])
                      for r in steps],
            "accuracy": [(e["t"] - start, e["accuracy"]) for e in epochs]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--np", type=int, default=2, help="workers (default 2)")
    p.add_argument("--seeds", type=int, default=2, help="(default 2)")
    p.add_argument("--epochs", type=int, default=12, help="(default 12)")
    p.add_argument("--batch-size", type=int, default=8, help="small batch per worker (8)")
    p.add_argument("--max-batch", type=int, default=64, help="large batch per worker (64)")
    p.add_argument("--lr", type=float, default=0.02, help="at the small batch (0.02)")
    p.add_argument("--target", type=float, default=0.95, help="test accuracy (0.95)")
    p.add_argument("--json", help="also write every run's numbers to this file")
    p.add_argument("--plot", help="draw a PNG here (needs matplotlib)")
    args = p.parse_args()
    results = []
    for seed in range(1, args.seeds + 1):
        for arm in ARMS:
            results.append(run(arm, seed, args))
            print(json.dumps({k: v for k, v in results[-1].items()
                              if k not in ("trace", "accuracy")}), flush=True)
    load = os.getloadavg()[0]
    print(f"\nnp={args.np}, batch {args.batch_size} -> {args.max_batch} per worker, "
          f"{args.epochs} epochs, target accuracy {args.target}, {args.seeds} seeds; median "
          f"[min, max]; load average at the end {load:.2f}")
    print(f"{'arm':14}{'time to target (s)':>26}{'steps to target':>24}{'final accuracy':>26}"
          "  global batches")
    for arm in ARMS:
        mine = [r for r in results if r["arm"] == arm]
        hit = [r for r in mine if r["time"] is not None]
        miss = f" ({len(mine) - len(hit)} missed)" if len(hit) < len(mine) else ""
        print(f"{arm:14}"
              + (f"{cell([r['time'] for r in hit], '{:.1f}') + miss:>26}"
                 f"{cell([r['steps'] for r in hit], '{:.0f}'):>24}" if hit else
                 f"{'missed':>26}{'-':>24}")
              + f"{cell([r['final'] for r in mine]):>26}  {mine[0]['batches']}")
    print("\nKungFu (Fig. 4): the adaptive batch reaches the small batch's accuracy in less time; "
          "McCandlish et al.: batches below the noise scale waste little")
    if args.json:
        with open(args.json, "w") as f:
            f.write("\n".join(json.dumps(r) for r in results) + "\n")
    if args.plot:
        plt = pyplot()
        if plt is not None:
            fig, (a, b) = plt.subplots(1, 2, figsize=(11, 3.8))
            for r in results:
                if r["seed"] != 1:
                    continue
                _, t, batch, _ = zip(*r["trace"])
                if r["arm"].startswith("gns"):
                    a.step(t, batch, where="post", label=f"{r['arm']}: global batch")
                if r["arm"] == "gns":
                    a.plot(t, [g if g is not None and g == g else float("nan")
                               for *_, g in r["trace"]], lw=0.6, label="noise scale")
                b.plot(*zip(*r["accuracy"]), marker=".", label=r["arm"])
            a.set_yscale("log")
            a.set_xlabel("seconds")
            b.set_xlabel("seconds")
            b.set_ylabel("test accuracy")
            a.legend(fontsize=7)
            b.legend(fontsize=7)
            save(fig, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
