"""How long the survivors of an elastic job take to go on after a worker is lost.

    python benchmarks/recovery_latency.py [--np 4] [--runs 3] [--peer-timeout 3s]

Each run starts `kungfu-run -w -np N` with tests/integration/elastic_train.py (model.fit, kf.Hook,
kf.ElasticData; a small Dense model, batch 8 per worker) and one fault, the arms interleaved:

- kill: rank 1 kills itself with SIGKILL right after step 10 (its Hook done with it);
- hang: rank 1 stops itself with SIGSTOP during step 10 (KUNGFU_PEER_TIMEOUT=--peer-timeout,
  KUNGFU_RECOVERY_WINDOW=--window).

The faulty worker writes the time of its fault; every survivor records (kf.Hook.recoveries) when
its collective failed, when it had the survivors' decision, when its new native peer was up, when
it had rolled back, and when the failed step had been redone. All processes run on this host,
so their time.time() stamps compare. Per run the table shows the slowest survivor's phases:

  detect    fault -> the survivor's collective fails
  agree     -> the decision (check-in, waiting for the dead peer's launcher, compare-and-swap)
  rebuild   -> the new cluster version's native peer is connected
  rollback  -> the agreed commit restored
  step      -> the failed step redone (the next completed step)
  total     fault -> the next completed step

Targets on a 2-core machine: detection of a killed worker < 1 s, kill -> next step < 3 s at
np 4; a hung worker adds KUNGFU_PEER_TIMEOUT. Results: benchmarks/README.md.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from kungfu._ports import free_port_range, free_ports  # noqa: E402

PHASES = ("detect", "agree", "rebuild", "rollback", "step", "total")


def run(arm: str, np_: int, args) -> dict:
    with tempfile.TemporaryDirectory() as out:
        env = {k: v for k, v in os.environ.items() if not k.startswith("KUNGFU_")}
        env["PYTHONPATH"] = str(REPO)
        env["TF_CPP_MIN_LOG_LEVEL"] = "3"
        fault = ["--kill", "1@10+"]
        if arm == "hang":
            fault = ["--hang", "1@10"]
            env["KUNGFU_PEER_TIMEOUT"] = args.peer_timeout
            env["KUNGFU_RECOVERY_WINDOW"] = args.window
        cmd = [sys.executable, "-m", "kungfu.cmd", "-w", "-np", str(np_), "-H",
               f"127.0.0.1:{np_}", "-builtin-config-port", str(free_ports(1)[0]),
               "-port-range", free_port_range(np_), "-timeout", "300s", "-q",
               sys.executable, str(REPO / "tests/integration/elastic_train.py"), "--out", out,
               "--samples", "960", "--schedule", str(np_), "--tail", "100000",
               "--max-steps", "20", "--step-sleep", "0", *fault]
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=400)
        if r.returncode != 0:
            raise RuntimeError(f"{arm} run failed ({r.returncode}):\n{r.stderr[-3000:]}")
        rows = [json.loads(line) for f in Path(out).glob("*.jsonl")
                for line in f.read_text().splitlines()]
    [fault_at] = [row["at"] for row in rows if "fault" in row]
    recs = [rec for row in rows if "done" in row for rec in row["recoveries"]]
    if len(recs) != np_ - 1 or any("step_done_at" not in rec for rec in recs):
        raise RuntimeError(f"{arm}: expected one recovery and a redone step per survivor, "
                           f"got {recs}")

    def slowest(key, since):
        return max(rec[key] for rec in recs) - since

    t_fail = max(rec["failed_at"] for rec in recs)
    t_agree = max(rec["agreed_at"] for rec in recs)
    t_rebuilt = max(rec["rebuilt_at"] for rec in recs)
    t_restored = max(rec["restored_at"] for rec in recs)
    return {"arm": arm, "detect": t_fail - fault_at, "agree": t_agree - t_fail,
            "rebuild": t_rebuilt - t_agree, "rollback": t_restored - t_rebuilt,
            "step": slowest("step_done_at", t_restored),
            "total": slowest("step_done_at", fault_at)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--np", type=int, default=4, help="workers (default 4)")
    p.add_argument("--runs", type=int, default=3, help="runs per arm, interleaved (default 3)")
    p.add_argument("--arms", default="kill,hang", help="kill, hang or both (default)")
    p.add_argument("--peer-timeout", default="3s", help="KUNGFU_PEER_TIMEOUT in the hang arm")
    p.add_argument("--window", default="1s", help="KUNGFU_RECOVERY_WINDOW in the hang arm")
    p.add_argument("--json", help="also write every run's numbers to this file")
    args = p.parse_args()
    arms = [a for a in args.arms.split(",") if a]
    results = []
    for i in range(args.runs):
        for arm in arms:
            res = run(arm, args.np, args)
            res["run"] = i
            results.append(res)
            print(json.dumps({k: round(v, 3) if isinstance(v, float) else v
                              for k, v in res.items()}), flush=True)
    print(f"\nnp={args.np}, {args.runs} runs per arm; seconds, median [min, max] of the "
          f"slowest survivor")
    print(f"{'arm':6}" + "".join(f"{ph:>22}" for ph in PHASES))
    for arm in arms:
        mine = [r for r in results if r["arm"] == arm]
        cells = []
        for ph in PHASES:
            vals = [r[ph] for r in mine]
            cells.append(f"{statistics.median(vals):.3f} [{min(vals):.3f}, {max(vals):.3f}]")
        print(f"{arm:6}" + "".join(f"{c:>22}" for c in cells))
    if args.json:
        Path(args.json).write_text("\n".join(json.dumps(r) for r in results) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
