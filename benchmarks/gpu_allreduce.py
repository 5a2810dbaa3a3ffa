"""The ResNet-50 gradient set's allreduce on CUDA tensors, three ways side by side (a GPU machine;
scripts/gpu_check.sh runs it):

    python benchmarks/gpu_allreduce.py --np 2 --repeats 3

  staging  kungfu.torch, KUNGFU_GPU=staging: chunks through pinned host buffers on a stream of
           kungfu's, reduced over kungfu's TCP path, the copies overlapping the reduction
  cpu      kungfu.torch, KUNGFU_GPU=off: each tensor copied to the host synchronously (.cpu()),
           reduced, copied back (what kungfu did before it had a GPU backend)
  gloo     torch.distributed's gloo backend with the same CUDA tensors

Arms take turns (repeat r starts with arm r mod 3). Each run: --warmup rounds, then --steps
timed rounds of "allreduce every tensor (all started, then all waited), synchronize"; a round's
time is the slowest worker's. Workers share the one GPU (KUNGFU_GPU_COUNT=0), as NCCL cannot.
One JSON line per run: arm, np, repeat, ms (median round), ms_min, ms_max, bytes, device.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SIZES = os.path.join(HERE, "resnet50_sizes.json")
ARMS = ("staging", "cpu", "gloo")


def worker(arm: str, warmup: int, steps: int) -> None:
    import torch
    import torch.distributed as dist

    import kungfu.torch as kft

    shapes = [t["size"] for t in json.load(open(SIZES))["tensors"]]
    dev = torch.device("cuda", 0)
    tensors = [torch.ones(n, device=dev) for n in shapes]
    rank, size = kft.rank(), kft.size()
    if arm == "gloo":
        peers = os.environ["KUNGFU_INIT_PEERS"].split(",")
        host, port = peers[0].rsplit(":", 1)
        dist.init_process_group("gloo", init_method=f"tcp://{host}:{int(port) + 1000}",
                                rank=rank, world_size=size)

    def round_():
        if arm == "gloo":
            works = [dist.all_reduce(t, async_op=True) for t in tensors]
            for w in works:
                w.wait()
        else:
            hs = [kft.ops.collective.all_reduce_async(t, "sum", f"g{i}")
                  for i, t in enumerate(tensors)]
            for h in hs:
                h.wait()
        torch.cuda.synchronize()

    times = []
    for i in range(warmup + steps):
        kft.ops.collective.all_reduce(torch.zeros(1), "sum", "barrier")
        start = time.perf_counter()
        round_()
        mine = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        slowest = kft.ops.collective.all_reduce(mine, "max", "slowest")
        if i >= warmup:
            times.append(float(slowest[0]) * 1000)
    if rank == 0:
        print("RESULT " + json.dumps({"ms": statistics.median(times), "ms_min": min(times),
                                      "ms_max": max(times),
                                      "bytes": 4 * sum(shapes),
                                      "device": torch.cuda.get_device_name(dev),
                                      "gpu": kft.show_nccl_version()}), flush=True)
    if arm == "gloo":
        dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--np", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        return worker(a.worker, a.warmup, a.steps)
    arms = a.arms.split(",")
    for r in range(a.repeats):
        for k in range(len(arms)):
            arm = arms[(r + k) % len(arms)]
            env = dict(os.environ, KUNGFU_GPU_COUNT="0",
                       KUNGFU_GPU="off" if arm in ("cpu", "gloo") else arm)
            cmd = [sys.executable, "-m", "kungfu.cmd", "-np", str(a.np), sys.executable, __file__,
                   "--worker", arm, "--warmup", str(a.warmup), "--steps", str(a.steps)]
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
            rows = [line.split("RESULT ", 1)[1] for line in out.stdout.splitlines()
                    if "RESULT " in line]
            if out.returncode != 0 or not rows:
                print(json.dumps({"arm": arm, "np": a.np, "repeat": r, "error": out.stderr[-2000:]}))
                continue
            print(json.dumps({"arm": arm, "np": a.np, "repeat": r, **json.loads(rows[0])}), flush=True)


if __name__ == "__main__":
    main()
