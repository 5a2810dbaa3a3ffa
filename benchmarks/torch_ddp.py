"""A PyTorch training step: kungfu.torch's SynchronousSGDOptimizer against DistributedDataParallel
on gloo (CPU), side by side.

    python benchmarks/torch_ddp.py --np 2,4 --model dense,deep --repeats 2

For every model and worker count N it trains the model with SGD (momentum 0.9) on synthetic
data (a fixed batch per worker, --batch-size), in two ways, taking turns (repeat r starts with
arm r mod 2, so that load that comes and goes falls on both):

  kungfu  N workers under kungfu-run (`python -m kungfu.cmd -np N`), the optimizer wrapped in
          kungfu.torch's SynchronousSGDOptimizer (each gradient's average starts from its hook
          as backward makes it; step() waits for them).
  ddp     N workers under torchrun (`python -m torch.distributed.run`), the model wrapped in
          torch.nn.parallel.DistributedDataParallel over the gloo backend (its default 25 MB
          buckets, reduced as backward fills them).

Models:
  dense   an MLP 1024-4096-4096-1024-10: 25.2M parameters in 8 tensors (96 MB of gradients).
  deep    an MLP of 48 hidden layers 256 wide: 3.2M parameters in 98 tensors (12.6 MB), where
          the per-tensor cost of many small gradients shows.

Each measurement: --warmup steps, then --steps timed steps; a step's time is the slowest
worker's (each worker times its own zero_grad, forward, backward and step, after a barrier that
lines the workers up); the reported value is the median over the steps (and min, max). Both arms
use the same model, data, batch and torch thread count (--threads, default: the machine's cores
divided among the workers, at least 1).

Output: one JSON line per measurement (also to --json PATH), then a table. Keys: model, arm, np,
repeat, step_ms (median), step_ms_min, step_ms_max, steps, threads, loadavg (before, after).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
if REPO not in sys.path:  # run from a checkout: this repository's kungfu
    sys.path.insert(0, REPO)

from _common import JsonLines  # noqa: E402

MODELS = {"dense": "MLP 1024-4096-4096-1024-10, 25.2M params, 8 tensors",
          "deep": "MLP of 48 hidden layers of 256, 3.2M params, 98 tensors"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description="PyTorch step time: kungfu.torch SynchronousSGDOptimizer vs DDP on gloo",
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--np", default="2,4", help="worker counts, comma separated (2,4)")
    p.add_argument("--model", default="dense,deep",
                   help="models, comma separated: " + "; ".join(f"{k} ({v})"
                                                               for k, v in MODELS.items()))
    p.add_argument("--arms", default="kungfu,ddp", help="kungfu, ddp or both (kungfu,ddp)")
    p.add_argument("--batch-size", type=int, default=32, help="samples per worker per step (32)")
    p.add_argument("--steps", type=int, default=20, help="timed steps per measurement (20)")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first (5)")
    p.add_argument("--repeats", type=int, default=2, help="measurements per arm, taking turns (2)")
    p.add_argument("--bucket-bytes", type=int, default=None,
                   help="the kungfu arm's SynchronousSGDOptimizer bucket_bytes (default: its own)")
    p.add_argument("--threads", type=int, default=0,
                   help="torch threads per worker (0: the cores divided among the workers)")
    p.add_argument("--timeout", type=float, default=600, help="seconds per measurement (600)")
    p.add_argument("--json", default=None, help="also write the JSON lines to this file")
    # Internal: the worker side.
    p.add_argument("--worker", choices=("kungfu", "ddp"), default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


# -- worker side -----------------------------------------------------------------------------

def build_model(torch, name: str):
    nn = torch.nn
    if name == "dense":
        widths = [1024, 4096, 4096, 1024]
    else:
        widths = [256] * 49
    layers = []
    for a, b in zip(widths, widths[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    layers.append(nn.Linear(widths[-1], 10))
    return nn.Sequential(*layers), widths[0]


def worker(args):
    import torch

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model, inputs = build_model(torch, args.model.split(",")[0])
    if args.worker == "kungfu":
        import kungfu.torch as kf

        rank = kf.rank()
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        extra = {} if args.bucket_bytes is None else {"bucket_bytes": args.bucket_bytes}
        opt = kf.optimizers.SynchronousSGDOptimizer(opt, model.named_parameters(), **extra)
        net = model

        def barrier():
            kf.all_reduce(torch.zeros(1), name="bench/barrier")
    else:
        import torch.distributed as dist

        dist.init_process_group("gloo")
        rank = dist.get_rank()
        net = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)

        def barrier():
            dist.barrier()
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(args.batch_size, inputs, generator=g)
    y = torch.randint(0, 10, (args.batch_size,), generator=g)
    times = []
    for i in range(args.warmup + args.steps):
        barrier()
        t0 = time.perf_counter()
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    digest = float(sum(p.detach().double().sum() for p in model.parameters()))
    with open(f"{args.out}.{rank}", "w") as f:
        json.dump({"times": times, "digest": digest}, f)


# -- driver ------------------------------------------------------------------------------------

def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(args, arm: str, model: str, n: int, threads: int, tmp: str) -> dict:
    out = os.path.join(tmp, f"{arm}-{model}-{n}")
    me = [os.path.abspath(__file__), "--worker", arm, "--out", out, "--model", model,
          "--batch-size", str(args.batch_size), "--steps", str(args.steps),
          "--warmup", str(args.warmup), "--threads", str(threads)]
    if args.bucket_bytes is not None:
        me += ["--bucket-bytes", str(args.bucket_bytes)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUNGFU_")}
    env["PYTHONPATH"] = os.pathsep.join([REPO] + [p for p in [env.get("PYTHONPATH")] if p])
    env["OMP_NUM_THREADS"] = str(threads)
    if arm == "kungfu":
        cmd = [sys.executable, "-m", "kungfu.cmd", "-np", str(n), sys.executable, *me]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(n),
               "--master_addr", "127.0.0.1", "--master_port", str(_free_port()), *me]
    load0 = os.getloadavg()[0]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout,
                       cwd=REPO, check=False)
    if r.returncode != 0:
        raise SystemExit(f"{arm} np={n} {model} failed:\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}")
    ranks = []
    for k in range(n):
        with open(f"{out}.{k}") as f:
            ranks.append(json.load(f))
    if len({round(rk["digest"], 6) for rk in ranks}) != 1:
        raise SystemExit(f"{arm} np={n} {model}: the workers' weights differ: "
                         f"{[rk['digest'] for rk in ranks]}")
    steps = [max(rk["times"][i] for rk in ranks) * 1e3 for i in range(args.steps)]
    return {"model": model, "arm": arm, "np": n, "step_ms": round(statistics.median(steps), 2),
            "step_ms_min": round(min(steps), 2), "step_ms_max": round(max(steps), 2),
            "steps": args.steps, "threads": threads, "bucket_bytes": args.bucket_bytes,
            "loadavg": [round(load0, 2), round(os.getloadavg()[0], 2)]}


def main(argv=None):
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    arms = [a for a in args.arms.split(",") if a]
    models = [m for m in args.model.split(",") if m]
    for m in models:
        if m not in MODELS:
            raise SystemExit(f"--model: unknown model {m!r} (known: {', '.join(MODELS)})")
    nps = [int(v) for v in args.np.split(",") if v]
    out = JsonLines(args.json)
    with tempfile.TemporaryDirectory() as tmp:
        for model in models:
            for n in nps:
                threads = args.threads or max(1, (os.cpu_count() or 1) // n)
                for rep in range(args.repeats):
                    order = arms if rep % 2 == 0 else arms[::-1]
                    for arm in order:
                        out.emit({**measure(args, arm, model, n, threads, tmp), "repeat": rep})
    out.close()
    print()
    print("| model | np | arm | step ms, median of each repeat [min-max] | kungfu/ddp (medians) |")
    print("| --- | --- | --- | --- | --- |")
    for model in models:
        for n in nps:
            med = {}
            for arm in arms:
                rows = [r for r in out.rows if (r["model"], r["np"], r["arm"]) == (model, n, arm)]
                med[arm] = statistics.median(r["step_ms"] for r in rows)
                each = ", ".join(f"{r['step_ms']} [{r['step_ms_min']}-{r['step_ms_max']}]"
                                 for r in rows)
                ratio = (f"{med['kungfu'] / med['ddp']:.2f}"
                         if arm == arms[-1] and {"kungfu", "ddp"} <= med.keys() else "")
                print(f"| {model} | {n} | {arm} | {each} | {ratio} |")


if __name__ == "__main__":
    main()
