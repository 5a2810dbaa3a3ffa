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


# (rank 0's call, every other rank's call): valid calls that disagree, each under the name 'x'.
DISAGREEMENTS = {
    "sum-vs-avg": (lambda: kf.allreduce(np.array([1.0, 2.0, 3.0]), op="sum", name="x"),
                   lambda: kf.allreduce(np.array([1.0, 2.0, 3.0]), op="avg", name="x")),
    "int-sum-vs-avg": (lambda: kf.allreduce(np.array([1, 2], np.int64), op="sum", name="x"),
                       lambda: kf.allreduce(np.array([1, 2], np.int64), op="avg", name="x")),
    "allreduce-shape": (lambda: kf.allreduce(np.ones((2, 3), np.float32), name="x"),
                        lambda: kf.allreduce(np.ones((3, 2), np.float32), name="x")),
    "allreduce-flat": (lambda: kf.allreduce(np.ones((4, 4), np.float32), name="x"),
                       lambda: kf.allreduce(np.ones(16, np.float32), name="x")),
    "broadcast-shape": (lambda: kf.broadcast(np.ones((2, 3), np.float32), name="x"),
                        lambda: kf.broadcast(np.ones((3, 2), np.float32), name="x")),
}


def disagreements() -> dict:
    """Every case of DISAGREEMENTS in turn: its outcome here, how long it took, and whether the
    next allreduce of 'x' pairs (numbering intact)."""
    out = {}
    for case, calls in DISAGREEMENTS.items():
        start = time.time()
        try:
            got = calls[0 if kf.rank() == 0 else 1]()
            err = None
        except errors.InvalidArgumentError as e:
            got, err = None, str(e)
        after = kf.allreduce(np.full(2, 10.0, np.float32), name="x").tolist()
        out[case] = {"error": err, "got": None if got is None else np.asarray(got).tolist(),
                     "seconds": time.time() - start, "after": after}
    return out


def avg_results() -> dict:
    """avg's result is made once, and integer avg is the exact floor of the mean."""
    r, n = kf.rank(), kf.size()
    out = {}
    h = kf.allreduce_async(np.array([4.0, 8.0]) * (r + 1), op="avg")
    first = h.wait()
    kept = first.copy()
    second = h.wait()
    out["twice"] = {"first": first.tolist(), "kept": kept.tolist(), "second": second.tolist(),
                    "same_object": first is second}
    h = kf.allreduce_async(np.array([7, -7], np.int64) * (r + 1), op="avg")
    out["twice-int"] = [h.wait().tolist(), h.wait().tolist()]
    # Inputs whose sum overflows its dtype, per rank; the expected value is computed exactly by
    # the test from the same table.
    for key, (dtype, values) in INTEGER_MEANS.items():
        x = np.array(values(r), dtype=dtype)
        got = kf.allreduce(x, op="avg", name=f"avg/{key}")
        out[key] = {"dtype": str(got.dtype), "shape": list(got.shape), "values": got.tolist()}
    # The same through out= (the result is written there) and as a numpy scalar.
    buf = np.empty(2, np.int8)
    res = kf.allreduce(np.array([100, -100], np.int8), op="avg", out=buf)
    out["out"] = {"values": buf.tolist(), "is_out": res is buf}
    out["scalar"] = kf.allreduce(np.int16(30000 - r), op="avg").item()
    return out


_I64 = np.iinfo(np.int64)
_U64 = np.iinfo(np.uint64)
# name -> (dtype, rank -> values): sums that overflow the dtype, and the 64-bit extremes.
INTEGER_MEANS = {
    "int8": ("int8", lambda r: [100, 120, -128, 127, 5 - r, -5 + r]),
    "uint8": ("uint8", lambda r: [255, 200 + r, 0, 1]),
    "int16": ("int16", lambda r: [32767, -32768, 30000 + r]),
    "int32": ("int32", lambda r: [2**31 - 1, -2**31, 2**31 - 1 - 3 * r]),
    "uint32": ("uint32", lambda r: [2**32 - 1, 2**32 - 2 - r]),
    "int64": ("int64", lambda r: [2**62, _I64.max, _I64.min, _I64.max - r, _I64.min + r,
                                  -1 - r, (-1) ** r * 3]),
    "uint64": ("uint64", lambda r: [int(_U64.max), int(_U64.max) - r, 2**63 + r]),
    "int32-2d": ("int32", lambda r: [[2**30 * (1 + r % 2) - 1, -7], [r, 2**31 - 1]]),
}


def names_that_differ(strategy) -> dict:
    """Rank 0 calls allreduce 'a', the others 'b' (fused when strategy is None): how each ends,
    how long it took, and whether the next allreduce pairs."""
    start = time.time()
    try:
        kf.allreduce(np.ones(4, np.float32), name="a" if kf.rank() == 0 else "b", strategy=strategy)
        err = None
    except errors.InvalidArgumentError as e:
        err = str(e)
    took = time.time() - start
    return {"error": err, "seconds": took,
            "after": kf.allreduce(np.full(2, 10.0, np.float32), name="x", strategy=strategy).tolist()}


def equal_timeouts(iters: int, strategy) -> list:
    """The probe's loop (2m'): ranks enter a few ms apart, one allreduce with the same 10 ms
    timeout on every rank, then an allgather of the outcomes. The late rank (each in turn) comes
    7-13 ms after the others, around their deadline, where outcomes split most often (the
    probe's uniform 0-20 ms split 1 op in 200). Returns, per op, every rank's outcome (1: the
    right sum, 2: a wrong one, 0: OpTimeoutError)."""
    r, n = kf.rank(), kf.size()
    rows = []
    for i in range(iters):
        if r == i % n:
            time.sleep(np.random.default_rng(i).uniform(0.007, 0.013))
        try:
            v = kf.allreduce(np.full(20000, float(i + r), np.float32), timeout=0.01, name="eq",
                             strategy=strategy)
            mine = 1 if np.all(v == n * i + n * (n - 1) / 2) else 2
        except errors.OpTimeoutError:
            mine = 0
        rows.append(kf.allgather(np.array([mine], np.int32), name="eqflag").tolist())
    return rows


def broadcast_unpicklable(root: int) -> dict:
    """Root broadcasts an object it cannot pickle (a lock); every worker reports what it
    raised, then a broadcast_object under the same name runs on."""
    import threading

    import kungfu as kf

    r = kf.rank()
    try:
        kf.broadcast_object(threading.Lock() if r == root else None, root=root, name="obj")
        error = None
    except Exception as e:  # noqa: BLE001 - the test judges it
        error = f"{type(e).__name__}: {e}"
    after = kf.broadcast_object(("ok", r) if r == root else None, root=root, name="obj")
    return {"error": error, "after": after}
