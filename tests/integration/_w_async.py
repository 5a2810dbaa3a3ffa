"""Worker bodies for test_async.py (run inside spawned workers; no pytest import)."""
from __future__ import annotations

import threading
import time

import numpy as np

import kungfu as kf
from kungfu import errors

from _w_collectives import (ALL_DTYPES, STRATEGIES, Batch, case_inputs, mismatch, ragged_inputs,
                            reference)

TIMEOUT = 30.0


def _many_allreduces(b: Batch, count: int = 50):
    """`count` allreduces with distinct names, issued in a different order on every rank and
    waited in yet another order."""
    n, r = b.n, b.rank
    ops = ["sum", "min", "max", "prod", "avg"]
    dtypes = [d for d in ALL_DTYPES if d != "bool"]
    specs = []
    for i in range(count):
        dtype = dtypes[i % len(dtypes)]
        op = ops[(i // len(dtypes)) % len(ops)]
        shape = (i * 131 % 2000,) if i % 5 else (i % 4, 3)
        strategy = STRATEGIES[i % len(STRATEGIES)] if i % 3 else None
        specs.append((f"async/{i}", dtype, op, shape, strategy))
    rng = np.random.default_rng(1000 + r)
    issue = rng.permutation(count)
    wait = rng.permutation(count)

    def one():
        handles = {}
        for i in issue:
            name, dtype, op, shape, strategy = specs[i]
            x = case_inputs(name, n, dtype, shape, op)[r]
            handles[i] = (kf.allreduce_async(x, op=op, name=name, strategy=strategy,
                                             timeout=TIMEOUT), x)
        problems = []
        for i in wait:
            name, dtype, op, shape, strategy = specs[i]
            h, _ = handles[i]
            got = h.wait()
            if not h.done():
                problems.append(f"{name}: done() is False after wait()")
            p = mismatch(got, reference(case_inputs(name, n, dtype, shape, op), op, dtype),
                         dtype, op)
            if p:
                problems.append(f"{name} ({dtype} {op} {shape} {strategy}): {p}")
        return "; ".join(problems) or None

    b.case("many_allreduces", f"many_allreduces/{count}", one)


def _mixed(b: Batch):
    """Allreduce, broadcast, allgather, gather, reduce and consensus in flight together, issued
    in a different order on every rank."""
    n, r = b.n, b.rank
    jobs = []
    for i in range(8):
        name = f"mixed/allreduce/{i}"
        jobs.append(("allreduce", name, case_inputs(name, n, "int32", (100 + i,), "sum")))
        name = f"mixed/broadcast/{i}"
        jobs.append(("broadcast", name, case_inputs(name, n, "float32", (i * 7,), "broadcast"),
                     i % n))
        name = f"mixed/allgather/{i}"
        shapes = [((q + i) % 3, 2) for q in range(n)]
        jobs.append(("allgather", name, ragged_inputs(name, "uint16", shapes)))
        name = f"mixed/gather/{i}"
        jobs.append(("gather", name, ragged_inputs(name, "int8", shapes), (i + 1) % n))
        name = f"mixed/reduce/{i}"
        jobs.append(("reduce", name, case_inputs(name, n, "float64", (9,), "sum"), i % n))
        jobs.append(("consensus", f"mixed/consensus/{i}", i))
    order = np.random.default_rng(2000 + r).permutation(len(jobs))

    def one():
        handles = {}
        for j in order:
            job = jobs[j]
            kind, name = job[0], job[1]
            if kind == "allreduce":
                h = kf.allreduce_async(job[2][r], name=name, timeout=TIMEOUT)
            elif kind == "broadcast":
                h = kf.broadcast_async(job[2][r], root=job[3], name=name, timeout=TIMEOUT)
            elif kind == "allgather":
                h = kf.allgather_async(job[2][r], name=name, timeout=TIMEOUT)
            elif kind == "gather":
                h = kf.gather_async(job[2][r], root=job[3], name=name, timeout=TIMEOUT)
            elif kind == "reduce":
                h = kf.reduce_async(job[2][r], root=job[3], name=name, timeout=TIMEOUT)
            else:
                h = kf.consensus_async(f"same-{job[2]}" if job[2] % 2 else f"rank-{r}",
                                       name=name, timeout=TIMEOUT)
            handles[j] = h
        problems = []
        for j in reversed(order):
            job = jobs[j]
            kind, name = job[0], job[1]
            got = handles[j].wait()
            if kind == "allreduce":
                p = mismatch(got, reference(job[2], "sum", "int32"), "int32", "sum")
            elif kind == "broadcast":
                p = mismatch(got, job[2][job[3]], "float32", "broadcast")
            elif kind == "allgather":
                p = mismatch(got, np.concatenate(job[2]), "uint16", "broadcast")
            elif kind == "gather":
                p = (mismatch(got, np.concatenate(job[2]), "int8", "broadcast") if r == job[3]
                     else None if got is None else "non-root got a value")
            elif kind == "reduce":
                p = (mismatch(got, reference(job[2], "sum", "float64"), "float64", "sum")
                     if r == job[3] else None if got is None else "non-root got a value")
            else:
                want = job[2] % 2 == 1 or n == 1
                p = None if got is want else f"got {got!r}, expected {want}"
            if p:
                problems.append(f"{name}: {p}")
        return "; ".join(problems) or None

    b.case("mixed", "mixed/48-ops", one)


def _same_name_in_flight(b: Batch):
    """Several uses of one name in flight at once are matched by their sequence numbers."""
    n, r = b.n, b.rank

    def one():
        hs = [kf.allreduce_async(np.full(3, step * 10 + r, np.int64), name="inflight",
                                 timeout=TIMEOUT) for step in range(6)]
        problems = []
        for step, h in reversed(list(enumerate(hs))):
            got = h.wait()
            exp = np.full(3, n * step * 10 + n * (n - 1) // 2)
            if not np.array_equal(got, exp):
                problems.append(f"step {step}: got {got}, expected {exp}")
        hs = [kf.allreduce_async(np.float32(r + step), op="max", timeout=TIMEOUT)
              for step in range(5)]
        got = [h.wait() for h in hs]
        if got != [np.float32(n - 1 + step) for step in range(5)]:
            problems.append(f"unnamed: got {got}")
        return "; ".join(problems) or None

    b.case("same_name", "same_name/6-in-flight", one)


def _callbacks(b: Batch):
    n, r = b.n, b.rank

    def fires_once():
        lock = threading.Lock()
        calls = {"a": [], "b": []}
        fired = threading.Event()

        def cb(key):
            def f(h):
                with lock:
                    calls[key].append((h, h.done(), threading.get_ident()))
                fired.set()
            return f

        # The last rank joins late, so the op is still pending when the callbacks are added.
        if r == n - 1:
            time.sleep(0.3)
        h = kf.allreduce_async(np.arange(4, dtype=np.int32) + r, name="cb/once", timeout=TIMEOUT)
        pending = not h.done()
        h.add_done_callback(cb("a"))
        h.add_done_callback(cb("b"))
        got = h.wait()
        if not fired.wait(5):
            return "no callback within 5 s of completion"
        time.sleep(0.2)  # a second call would come now
        late = []
        h.add_done_callback(lambda hh: late.append(hh))  # added after completion: runs once too
        deadline = time.time() + 5
        while not late and time.time() < deadline:
            time.sleep(0.01)
        time.sleep(0.1)
        with lock:
            counts = {k: len(v) for k, v in calls.items()}
            args_ok = all(c[0] is h and c[1] for v in calls.values() for c in v)
        if counts != {"a": 1, "b": 1}:
            return f"callbacks ran {counts} times"
        if not args_ok:
            return "a callback did not get its own, completed handle"
        if len(late) != 1 or late[0] is not h:
            return f"callback added after completion ran {len(late)} times"
        exp = np.arange(4, dtype=np.int32) * n + n * (n - 1) // 2
        if not np.array_equal(got, exp):
            return f"result {got}, expected {exp}"
        if r != n - 1 and n > 1 and not pending:
            return "done() was True before the last rank had joined"
        return None

    def on_error():
        # A callback also fires (once) for an op that fails: rank 0 waits for an op nobody else
        # runs, with a short deadline.
        if r != 0:
            return None
        count = []
        h = kf.allreduce_async(np.int32(1), name="cb/lonely", timeout=0.5)
        h.add_done_callback(lambda hh: count.append(1))
        try:
            h.wait()
            if n > 1:
                return "an op no peer joined completed"
        except errors.OpTimeoutError:
            pass
        time.sleep(0.2)
        return None if len(count) == 1 else f"callback ran {len(count)} times"

    def raising_callback():
        def bad(h):
            raise RuntimeError("callback failure (expected by the test)")
        h = kf.allreduce_async(np.int64(r), name="cb/raises", timeout=TIMEOUT)
        h.add_done_callback(bad)
        got = h.wait()
        again = kf.allreduce(np.int64(1), name="cb/after-raise", timeout=TIMEOUT)
        if got != n * (n - 1) // 2 or again != n:
            return f"results {got!r}, {again!r}"
        return None

    b.case("callbacks", "callbacks/fires-once", fires_once)
    if n > 1:
        b.case("callbacks", "callbacks/on-error", on_error)
    b.case("callbacks", "callbacks/raising", raising_callback)
    kf.barrier(timeout=TIMEOUT)  # rank 0's lonely op must not leak into later cases


def _wait_timeout(b: Batch):
    """wait(timeout) that expires raises TimeoutError but leaves the op running."""
    n, r = b.n, b.rank

    def one():
        if r == n - 1:
            time.sleep(0.5)
        h = kf.allreduce_async(np.full(5, r, np.int16), name="wait/short", timeout=TIMEOUT)
        if r != n - 1:
            t0 = time.monotonic()
            try:
                h.wait(timeout=0.05)
                return "wait(0.05) returned before the last rank joined"
            except TimeoutError as e:
                if not isinstance(e, errors.OpTimeoutError):
                    return f"raised {type(e).__name__}, not OpTimeoutError"
            if time.monotonic() - t0 > 1.0:
                return f"wait(0.05) took {time.monotonic() - t0:.2f} s"
        got = h.wait()
        exp = np.full(5, n * (n - 1) // 2, np.int16)
        return None if np.array_equal(got, exp) else f"got {got}"

    if n > 1:
        b.case("wait_timeout", "wait_timeout/partial", one)


GROUPS = ["many_allreduces", "mixed", "same_name", "callbacks", "wait_timeout"]


def expected_counts(n: int):
    return {"many_allreduces": 1, "mixed": 1, "same_name": 1,
            "callbacks": 3 if n > 1 else 2, "wait_timeout": 1 if n > 1 else 0}


def run_batch():
    b = Batch()
    _many_allreduces(b)
    _mixed(b)
    _same_name_in_flight(b)
    _callbacks(b)
    _wait_timeout(b)
    return b.result()
