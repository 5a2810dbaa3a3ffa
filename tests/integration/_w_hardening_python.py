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


def _ones() -> np.ndarray:
    return np.ones(2, np.float32)


def _read_only() -> np.ndarray:
    a = _ones()
    a.flags.writeable = False
    return a


# (good call on rank 0, bad call on rank 1) for each case, all under the name 'x'.
BAD_INPUT = {
    "op": (lambda: kf.allreduce(_ones(), name="x"),
           lambda: kf.allreduce(_ones(), op="mean", name="x")),
    "dtype": (lambda: kf.allreduce(_ones(), name="x"),
              lambda: kf.allreduce(np.array(["a", "b"], dtype=object), name="x")),
    "out": (lambda: kf.allreduce(_ones(), name="x"),
            lambda: kf.allreduce(_ones(), name="x", out=np.ones(3, np.float32))),
    "avg-bool": (lambda: kf.allreduce(np.ones(2, bool), op="max", name="x"),
                 lambda: kf.allreduce(np.ones(2, bool), op="avg", name="x")),
    "timeout": (lambda: kf.allreduce(_ones(), name="x"),
                lambda: kf.allreduce(_ones(), name="x", timeout=-1)),
    "reduce-root": (lambda: kf.reduce(_ones(), root=0, name="x"),
                    lambda: kf.reduce(_ones(), root="0", name="x")),
    "broadcast-out": (lambda: kf.broadcast(_ones(), name="x"),
                      lambda: kf.broadcast(_ones(), name="x", out=_read_only())),
    "allgather-type": (lambda: kf.allgather(_ones(), name="x"),
                       lambda: kf.allgather([1.0, 2.0], name="x")),
    "gather-root": (lambda: kf.gather(_ones(), root=0, name="x"),
                    lambda: kf.gather(_ones(), root=0.0, name="x")),
    "consensus-type": (lambda: kf.consensus(b"ab", name="x"),
                       lambda: kf.consensus([1, 2], name="x")),
}


def bad_input_on_one_rank(bad: str) -> dict:
    """Rank 1 passes bad input to an operation named 'x'; rank 0 good input. Then both run two
    allreduces of 'x' (numbering is per name, so they pair only if the failed one took its
    number on both ranks)."""
    out = {}
    start = time.time()
    try:
        BAD_INPUT[bad][kf.rank()]()
        out["error"] = None
    except errors.InvalidArgumentError as e:
        out["error"] = str(e)
    out["seconds"] = time.time() - start
    out["after"] = [kf.allreduce(np.full(2, 10.0 ** (i + 1), np.float32), name="x").tolist()
                    for i in range(2)]
    return out


def rejected_here() -> dict:
    """Input that cannot name its operation, or that only concerns this worker: each raises
    InvalidArgumentError at once (at np=1, nothing is waited for)."""
    x = np.arange(8, dtype=np.float32)
    cases = {
        "name": lambda: kf.allreduce(x, name=5),
        "timeout-inf": lambda: kf.allreduce(x, timeout=float("inf")),
        "timeout-str": lambda: kf.allreduce(x, timeout="1"),
        "out-overlap": lambda: kf.allreduce(x[:4], out=x[2:6]),
        "wait-nan": lambda: kf.allreduce_async(x).wait(timeout=float("nan")),
    }
    got = {}
    for case, call in cases.items():
        try:
            call()
            got[case] = None
        except errors.InvalidArgumentError as e:
            got[case] = str(e)
    got["in-place"] = kf.allreduce(x, out=x).tolist()
    return got


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
