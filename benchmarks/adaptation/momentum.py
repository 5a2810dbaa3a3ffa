"""Momentum compensation (Lin et al.): the loss spike after the global batch grows by k, with
and without a learning-rate ramp (seed-papers.md, B4).

    python benchmarks/adaptation/momentum.py [--np 2] [--ks 4,8] [--seeds 3] [--plot m.png]

Each run is `kungfu-run -np N` of benchmarks/adaptation/_worker.py (digits MLP, SGD with
momentum 0.9, model.fit, kf.ElasticData, kf.Hook); at step --at (about 30% of training) a policy
makes the global batch k times larger. The optimizer (--optimizer) matters: in the default,
lr-outside (v = m v + g, w -= lr v: PyTorch's and MXNet's SGD, the paper's setting), a larger
learning rate scales the whole momentum buffer at once; keras.optimizers.SGD keeps lr x gradient
in its buffer, so its old buffer is not scaled and a jump hurts less. Arms, interleaved, the same data and seeds:

- none:     the learning rate unchanged;
- jump:     the learning rate k times larger at once (the linear scaling rule);
- ramp-8:   kf.policy.MomentumCompensation(steps=8): the multiplier ramps 1 -> k over 8 steps;
- ramp-8k:  the same over 8k steps (the third-party reading of the paper's T).

Reported, mean +- std over seeds: the spike (the highest loss on a fixed probe set of 256
training samples in the 50 steps after the change, minus that loss just before it; negative when
the loss only went down), and the final test accuracy. --plot draws the probe loss around the change for the first seed.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from _common import REPO, pyplot, run_job, save

sys.path.insert(0, str(REPO))

from kungfu._ports import free_port_range  # noqa: E402

ARMS = ("none", "jump", "ramp-8", "ramp-8k")


def policy(arm: str, k: int, at: int) -> str:
    if arm == "ramp-8":
        return f"ramp:{k}@{at}:8"
    if arm == "ramp-8k":
        return f"ramp:{k}@{at}:{8 * k}"
    return f"{arm}:{k}@{at}"


def run(arm: str, k: int, seed: int, args) -> dict:
    rows = run_job(["-np", str(args.np), "-port-range", free_port_range(args.np)],
                   ["--policy", policy(arm, k, args.at), "--epochs", str(args.epochs),
                    "--batch-size", str(args.batch_size), "--lr", str(args.lr),
                    "--seed", str(seed), "--optimizer", args.optimizer], {}, f"{arm} k={k}")
    steps = [row for row in rows if "step" in row]
    loss = {row["step"]: row["probe_loss"] for row in steps}
    before = loss[args.at]  # after the last step with the old batch
    after = [loss[s] for s in range(args.at + 1, args.at + 51) if s in loss]
    final = [row["accuracy"] for row in rows if "epoch_end" in row][-1]
    return {"arm": arm, "k": k, "seed": seed, "spike": max(after) - before, "accuracy": final,
            "curve": [(s, loss[s]) for s in sorted(loss) if args.at - 20 <= s <= args.at + 60],
            "lr": [(row["step"], row["lr"]) for row in steps
                   if args.at - 2 <= row["step"] <= args.at + 8 * k + 4]}


def plot(results, ks, path: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, len(ks), figsize=(5 * len(ks), 3.5), squeeze=False)
    seed = results[0]["seed"]
    for col, k in enumerate(ks):
        for arm in ARMS:
            mine = [r for r in results if r["arm"] == arm and r["k"] == k and r["seed"] == seed]
            if mine:
                s, v = zip(*mine[0]["curve"])
                axes[0][col].plot(s, v, label=arm, lw=0.9)
        axes[0][col].set_title(f"probe loss, batch x{k} at the dashed line")
        axes[0][col].axvline(results[0]["curve"][0][0] + 20, ls="--", color="grey", lw=0.6)
        axes[0][col].set_xlabel("step")
    axes[0][0].legend(fontsize=7)
    save(fig, path)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--np", type=int, default=2, help="workers (default 2)")
    p.add_argument("--ks", default="4,8", help="batch growth factors (default 4,8)")
    p.add_argument("--seeds", type=int, default=3, help="(default 3)")
    p.add_argument("--arms", default=",".join(ARMS), help=f"(default {','.join(ARMS)})")
    p.add_argument("--epochs", type=int, default=6, help="(default 6)")
    p.add_argument("--batch-size", type=int, default=16, help="per worker before (default 16)")
    p.add_argument("--lr", type=float, default=0.05, help="before the change (default 0.05)")
    p.add_argument("--at", type=int, default=80, help="step of the change (default 80)")
    p.add_argument("--optimizer", choices=("keras", "lr-outside"), default="lr-outside",
                   help="lr-outside (default): v = m v + g, w -= lr v, as PyTorch's and "
                        "MXNet's SGD, where a larger lr scales the buffer; keras: "
                        "keras.optimizers.SGD, whose buffer already holds lr x gradient")
    p.add_argument("--json", help="also write every run's numbers to this file")
    p.add_argument("--plot", help="draw a PNG here (needs matplotlib)")
    args = p.parse_args()
    ks = [int(k) for k in args.ks.split(",") if k]
    arms = [a for a in args.arms.split(",") if a]
    results = []
    for seed in range(1, args.seeds + 1):
        for k in ks:
            for arm in arms:
                res = run(arm, k, seed, args)
                results.append(res)
                print(json.dumps({x: v for x, v in res.items() if x not in ("curve", "lr")}),
                      flush=True)
    print(f"\nnp={args.np}, global batch {args.np * args.batch_size} -> k times that at step "
          f"{args.at}, lr {args.lr}, momentum 0.9, optimizer {args.optimizer}; mean +- std "
          f"over {args.seeds} seeds")
    print(f"{'arm':9}" + "".join(f"{'spike k=' + str(k):>20}{'accuracy k=' + str(k):>20}"
                                  for k in ks))

    def ms(vals):
        return f"{statistics.mean(vals):.3f} +- {statistics.pstdev(vals):.3f}"

    for arm in arms:
        cells = []
        for k in ks:
            mine = [r for r in results if r["arm"] == arm and r["k"] == k]
            cells += [ms([r["spike"] for r in mine]), ms([r["accuracy"] for r in mine])]
        print(f"{arm:9}" + "".join(f"{c:>20}" for c in cells))
    print("\nLin et al.: an immediate k-fold learning rate spikes the loss (noise in the momentum "
          "buffer, amplified k times); a ramp over T = 8 steps removes most of it")
    if args.json:
        Path(args.json).write_text("\n".join(json.dumps(r) for r in results) + "\n")
    if args.plot:
        plot(results, ks, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
