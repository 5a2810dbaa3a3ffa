"""Straggler replacement (Or et al.) with an emulated straggler (seed-papers.md, B6).

    python benchmarks/adaptation/stragglers.py [--np 4] [--factors 1.33,2,4] [--runs 2]
        [--load N] [--spares K]

Each run is `kungfu-run -w -np N -H 127.0.0.1:N+1` (one free slot for the replacement) of
benchmarks/adaptation/_worker.py (digits MLP, model.fit, kf.ElasticData, kf.Hook) with emulated
compute (KUNGFU_SAMPLE_TIME per sample, KUNGFU_SAMPLE_JITTER noise): from step --at, worker 1
takes FACTOR times as long (KUNGFU_SLOWDOWN). Arms, interleaved:

- replace x F:  kf.policy.StragglerReplacement() (the median over 30 steps of speed / median
                under 0.85, and set apart from the cluster's own spread);
- keep x F:     no policy, the straggler stays;
- jitter only:  no straggler, +-10% noise on every worker, the policy on: false positives.

--load N runs N busy processes beside every job (a machine loaded by others: the load average
rises by about N); --spares K keeps K warm spares (kungfu-run -spares; the job then has K more
slots), so a replacement skips its start-up.

Reported: the detection delay (steps from --at to the decision), the steps until the new
worker has switched in, the throughput (samples/s) before --at, from --at to the switch, and
after it; for the jitter arm, how many workers were replaced.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys

from _common import REPO, busy, cell, run_job

sys.path.insert(0, str(REPO))

from kungfu._ports import free_port_range, free_ports  # noqa: E402


def run(arm: str, factor: float, args) -> dict:
    n = args.np
    env = {"KUNGFU_SAMPLE_TIME": str(args.sample_time),
           "KUNGFU_SAMPLE_JITTER": str(args.jitter)}
    if arm != "jitter":
        env["KUNGFU_SLOWDOWN"] = f"1:{factor}@{args.at}"
    slots = n + max(1, args.spares)
    with busy(args.load):
        rows = run_job(["-w", "-np", str(n), "-H", f"127.0.0.1:{slots}",
                        "-builtin-config-port", str(free_ports(1)[0]),
                        "-port-range", free_port_range(slots), "-spares", str(args.spares)],
                       ["--policy", "bsp" if arm == "keep" else "stragglers",
                        "--epochs", str(args.epochs), "--batch-size", str(args.batch_size)],
                       env, f"{arm} x{factor}")
        load = os.getloadavg()[0]
    steps = [r for r in rows if "step" in r and r["step_time"]]
    replaced = next((r["replaced"] for r in rows if "replaced" in r), [])

    def rate(rows_):
        rows_ = [r for r in rows_ if r["step"] > 5]
        return (sum(sum(r["batch_sizes"]) for r in rows_) / sum(r["step_time"] for r in rows_)
                if rows_ else float("nan"))

    out = {"arm": arm, "factor": factor, "replaced": replaced, "load": load,
           "before": rate([r for r in steps if r["step"] < args.at])}
    if arm == "replace" and replaced:
        decided = replaced[0]["step"]
        switched = next((r["step"] for r in steps if r["step"] > decided
                         and r["version"] != steps[0]["version"]), None)
        out.update(delay=decided - args.at, switch=None if switched is None else
                   switched - decided,
                   during=rate([r for r in steps if args.at <= r["step"] < (switched or 10**9)]),
                   after=rate([r for r in steps if switched and r["step"] >= switched + 2]))
    elif arm == "keep":
        out.update(during=rate([r for r in steps if r["step"] >= args.at]))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--np", type=int, default=4, help="workers (default 4; one more slot)")
    p.add_argument("--factors", default="1.33,2,4", help="slowdowns (default 1.33,2,4)")
    p.add_argument("--runs", type=int, default=2, help="runs per arm (default 2)")
    p.add_argument("--at", type=int, default=30, help="step the slowdown starts (default 30)")
    p.add_argument("--epochs", type=int, default=7, help="(default 7)")
    p.add_argument("--batch-size", type=int, default=16, help="per worker (default 16)")
    p.add_argument("--sample-time", type=float, default=0.003,
                   help="emulated seconds of compute per sample (default 0.003)")
    p.add_argument("--jitter", type=float, default=0.1, help="+- noise (default 0.1)")
    p.add_argument("--load", type=int, default=0,
                   help="busy processes beside each job: a loaded machine (default 0)")
    p.add_argument("--spares", type=int, default=0,
                   help="warm spares of each job (kungfu-run -spares; default 0)")
    p.add_argument("--json", help="also write every run's numbers to this file")
    args = p.parse_args()
    factors = [float(f) for f in args.factors.split(",") if f]
    results = []
    for i in range(args.runs):
        for f in factors:
            for arm in ("replace", "keep"):
                results.append(dict(run(arm, f, args), run=i))
                print(json.dumps(results[-1]), flush=True)
        results.append(dict(run("jitter", 1.0, args), run=i))
        print(json.dumps(results[-1]), flush=True)
    loads = [r["load"] for r in results]
    print(f"\nnp={args.np}, batch {args.batch_size} per worker, {args.sample_time * 1000:g} ms "
          f"emulated compute per sample +-{args.jitter:.0%}, worker 1 slowed from step "
          f"{args.at}; {args.load} busy processes beside, {args.spares} warm spares; "
          f"{args.runs} runs; median [min, max]; load average at the end of a job "
          f"{cell(loads, '{:.1f}')}")
    print(f"{'arm':14}{'delay (steps)':>16}{'to switch':>16}{'before (samples/s)':>26}"
          f"{'during':>26}{'after':>26}")
    for f in factors:
        for arm in ("replace", "keep"):
            mine = [r for r in results if r["arm"] == arm and r["factor"] == f]
            got = [r for r in mine if arm == "keep" or r.get("delay") is not None]
            row = f"{arm + ' x' + format(f, 'g'):14}"
            if arm == "replace":
                if len(got) < len(mine):
                    row += f"  (no replacement in {len(mine) - len(got)} of {len(mine)} runs)"
                row += (f"{cell([r['delay'] for r in got], '{:.0f}'):>16}"
                        f"{cell([r['switch'] for r in got if r['switch']], '{:.0f}'):>16}"
                        if got else f"{'-':>16}{'-':>16}")
            else:
                row += f"{'-':>16}{'-':>16}"
            row += f"{cell([r['before'] for r in mine], '{:.0f}'):>26}"
            row += f"{cell([r['during'] for r in got], '{:.0f}'):>26}" if got else f"{'-':>26}"
            after = [r["after"] for r in got if math.isfinite(r.get("after", math.nan))]
            row += f"{cell(after, '{:.0f}'):>26}" if after else f"{'-':>26}"
            print(row)
    jit = [r for r in results if r["arm"] == "jitter"]
    print(f"jitter only: {sum(len(r['replaced']) for r in jit)} replacements in {len(jit)} runs "
          "(false positives)")
    print("\nOr et al.: detector EWMA(0.1) of throughput / median < 0.8; here the median over 30 "
          "steps, under 0.85 and set apart from the cluster's spread; the replacement joins "
          "before the straggler leaves")
    if args.json:
        with open(args.json, "w") as f:
            f.write("\n".join(json.dumps(r) for r in results) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
