"""Worker bodies for test_hardening_python.py (run inside spawned workers)."""
from __future__ import annotations

import gc
import time

import numpy as np

import kungfu as kf
from kungfu import errors


def dropped_handles(n: int, rounds: int, wait_timeout) -> dict:
    """Async allreduces whose handles are dropped at once (or after a wait that gives up), with
    fresh zero arrays allocated right after: none of them may ever be written into."""
    dirty = 0
    for _ in range(rounds):
        h = kf.allreduce_async(np.full(n, 1.0, np.float32), name="d")
        if wait_timeout is not None:
            try:
                h.wait(timeout=wait_timeout)
            except errors.OpTimeoutError:
                pass
        del h
        gc.collect()
        zs = [np.zeros(n, np.float32) for _ in range(3)]
        time.sleep(0.002)
        dirty += sum(int(z.any()) for z in zs)
    kf.barrier()
    final = kf.allreduce(np.full(4, float(kf.rank() + 1), np.float32))
    return {"dirty": dirty, "final": final.tolist()}


def bad_input_on_one_rank(bad: str) -> dict:
    """Rank 1 passes bad input to allreduce 'x'; rank 0 a good one. Then both do good ones."""
    out = {}
    start = time.time()
    try:
        if kf.rank() == 1:
            if bad == "op":
                kf.allreduce(np.ones(2, np.float32), op="mean", name="x")
            elif bad == "dtype":
                kf.allreduce(np.array(["a", "b"], dtype=object), name="x")
            elif bad == "out":
                kf.allreduce(np.ones(2, np.float32), name="x", out=np.ones(3, np.float32))
        else:
            kf.allreduce(np.ones(2, np.float32), name="x")
        out["error"] = None
    except errors.InvalidArgumentError as e:
        out["error"] = str(e)
    out["seconds"] = time.time() - start
    out["after"] = [kf.allreduce(np.full(2, 10.0 ** (i + 1), np.float32), name="x").tolist()
                    for i in range(2)]
    return out


def zero_d() -> dict:
    x = np.array(2.5, np.float32)
    return {"allreduce": kf.allreduce(x).shape, "broadcast": kf.broadcast(x).shape,
            "allgather": kf.allgather(x).shape, "value": float(kf.allreduce(x))}


def allgather_shapes() -> dict:
    x = np.ones((4, 2) if kf.rank() == 0 else (2, 4), np.float32)
    start = time.time()
    try:
        kf.allgather(x)
        err = None
    except errors.InvalidArgumentError as e:
        err = str(e)
    return {"error": err, "seconds": time.time() - start,
            "after": kf.allgather(np.full((1, 3), kf.rank(), np.int32)).tolist()}


def nan_max() -> list:
    x = np.array([np.nan, 1.0], np.float32) if kf.rank() == 0 else np.array([1.0, np.nan], np.float32)
    return [np.isnan(kf.allreduce(x, op="max")).tolist(), np.isnan(kf.allreduce(x, op="min")).tolist()]
