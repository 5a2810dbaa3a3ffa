"""Worker bodies for test_collectives.py (run inside spawned workers; no pytest import).

Every rank's input is a pure function of (case id, rank), so each worker can compute every other
rank's input and check its own result against numpy. A batch runs many cases in one process and
returns, per group, the number of cases it ran and a description of each case that went wrong;
the tests in test_collectives.py turn each group into one test.
"""
from __future__ import annotations

import os
import time
import zlib
from typing import Callable, Dict, List, Optional, Tuple

import ml_dtypes
import numpy as np

import kungfu as kf
from kungfu import errors

STRATEGIES = ["STAR", "RING", "TREE", "BINARY_TREE", "BINARY_TREE_STAR",
              "MULTI_BINARY_TREE_STAR", "CLIQUE", "DIRECT", "HIERARCHICAL",
              "AUTO"]
INT_DTYPES = ["int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"]
FLOAT_DTYPES = ["float16", "bfloat16", "float32", "float64"]
ALL_DTYPES = INT_DTYPES + FLOAT_DTYPES + ["bool"]
OPS = ["sum", "avg", "min", "max", "prod"]
# Odd primes and a 3-D shape; 0 and 1 are the edge cases.
SMALL_SHAPES = [(0,), (1,), (7,), (3, 5, 7)]
# Per-op deadline inside batches: a case that hangs is reported as that case, not as the batch.
CASE_TIMEOUT = 15.0

# Tolerances for results that involve rounding (avg, prod, and sums of non-grid values).
_TOL = {"float16": (8e-3, 4e-3), "bfloat16": (3e-2, 3e-2), "float32": (1e-6, 1e-6),
        "float64": (1e-12, 1e-12)}


def np_dtype(name: str) -> np.dtype:
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def _rng(key: str) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(key.encode()))


def case_inputs(key: str, n: int, dtype: str, shape: Tuple[int, ...], op: str) -> np.ndarray:
    """Every rank's input for case `key`, stacked: row r is rank r's (one generator per case).

    Values are chosen so that the reference is exact: integer sums and products stay inside the
    dtype's range for up to 7 workers; float sums use multiples of 1/4 (exact in every float
    dtype); min/max, broadcast and gather use the whole range (floats: NaN, inf, -inf and -0.0
    first, when there is room, so that they must arrive bit for bit).
    """
    rng = _rng(key)
    full = (n,) + tuple(shape)
    dt = np_dtype(dtype)
    if dtype == "bool":
        p_true = 0.9 if op == "min" else 0.1 if op == "max" else 0.5
        return rng.random(full) < p_true
    if dtype in INT_DTYPES:
        signed = dtype.startswith("int")
        if op in ("sum", "avg"):
            v = rng.integers(-15, 16, full) if signed else rng.integers(0, 31, full)
        elif op == "prod":
            if signed:  # |product| <= 2**6: ranks from 6 on contribute only -1 or 1
                v = rng.choice([-1, 1, 2, 1, -1, 0, 2], full)
                if n > 6:
                    v[6:] = rng.choice([-1, 1], (n - 6,) + tuple(shape))
            else:
                v = rng.choice([1, 2, 1, 0, 2], full)
        else:  # min, max, broadcast, gather: anything the dtype holds
            info = np.iinfo(dt)
            return rng.integers(info.min, info.max, full, dtype=dt, endpoint=True)
        return v.astype(dt)
    if op in ("sum", "avg"):
        v = rng.integers(-16, 17, full) / 4.0
    elif op == "prod":
        v = rng.choice([0.5, 1.0, 1.5, 2.0], full) * rng.choice([-1.0, 1.0], full)
    else:
        v = rng.standard_normal(full) * 100.0
        if op == "broadcast" and v[0].size >= 4:
            v.reshape(n, -1)[:, :4] = [np.nan, np.inf, -np.inf, -0.0]
    return v.astype(dt)


def ragged_inputs(key: str, dtype: str, shapes: List[Tuple[int, ...]]) -> List[np.ndarray]:
    """Inputs of different shapes per rank (for gathers), from one generator per case."""
    sizes = [int(np.prod(s)) for s in shapes]
    flat = case_inputs(key, 1, dtype, (sum(sizes),), "broadcast")[0]
    out, at = [], 0
    for s, k in zip(shapes, sizes):
        out.append(flat[at:at + k].reshape(s))
        at += k
    return out


def reference(inputs: np.ndarray, op: str, dtype: str) -> np.ndarray:
    """What allreduce/reduce must produce from the stacked inputs (row r: rank r), in float64
    for float dtypes (compared with tolerance)."""
    n = len(inputs)
    dt = np_dtype(dtype)
    if dtype in FLOAT_DTYPES:
        s = inputs.astype(np.float64)
        if op == "sum":
            return s.sum(axis=0)
        if op == "avg":
            return s.sum(axis=0) / n
        if op == "prod":
            return s.prod(axis=0)
        return (s.min(axis=0) if op == "min" else s.max(axis=0)).astype(dt)
    s = inputs
    if op in ("min", "max"):
        return (s.min(axis=0) if op == "min" else s.max(axis=0)).astype(dt)
    acc = np.uint64 if dtype == "uint64" else np.int64
    if op == "sum":
        return s.sum(axis=0, dtype=acc).astype(dt)
    if op == "avg":
        return (s.sum(axis=0, dtype=acc) // n).astype(dt)
    return s.prod(axis=0, dtype=acc).astype(dt)


def mismatch(got, expected: np.ndarray, dtype: str, op: str) -> Optional[str]:
    """None if `got` is right, else a short description of the first difference."""
    dt = np_dtype(dtype)
    if not isinstance(got, np.ndarray):
        return f"got {type(got).__name__}, expected ndarray"
    if got.dtype != dt:
        return f"dtype {got.dtype} != {dt}"
    if got.shape != expected.shape:
        return f"shape {got.shape} != {expected.shape}"
    if dtype in FLOAT_DTYPES and op in ("sum", "avg", "prod"):
        rtol, atol = _TOL[dtype]
        g = got.astype(np.float64)
        bad = ~np.isclose(g, expected, rtol=rtol, atol=atol)
    elif op == "broadcast" and dtype in FLOAT_DTYPES:
        # Bit for bit: NaN, infinities and -0.0 must arrive unchanged.
        bits = np.dtype(f"u{dt.itemsize}")
        bad = got.view(bits) != expected.view(bits)
    else:
        bad = got != expected
    if not np.any(bad):
        return None
    idx = tuple(int(i) for i in np.argwhere(bad)[0])
    return (f"{int(np.count_nonzero(bad))} of {got.size} elements wrong; first at {idx}: "
            f"got {got[idx]!r}, expected {expected[idx]!r}")


def _shape_id(shape) -> str:
    return "x".join(str(d) for d in shape) if shape else "scalar"


# -- case lists (the same on every rank, and in the test module for its parameters) ----------

def allreduce_cases(strategy: str) -> List[Tuple[str, str, str, tuple, Optional[str]]]:
    """(case id, dtype, op, shape, out) for one strategy; out: None, "new" (a preallocated
    result array) or "inplace" (out=x)."""
    cases = []
    for dtype in INT_DTYPES + FLOAT_DTYPES:
        for op in OPS:
            for shape in SMALL_SHAPES:
                cases.append((dtype, op, shape))
        for op in ("sum", "max"):
            cases.append((dtype, op, (1009,)))
    for op in ("min", "max"):
        for shape in SMALL_SHAPES + [(1009,)]:
            cases.append(("bool", op, shape))
    cases += [("int32", "sum", (65537,)), ("float32", "sum", (65537,)),
              ("float16", "avg", (65537,)), ("bfloat16", "max", (65537,)),
              ("int64", "min", (65537,)), ("uint8", "prod", (65537,)),
              ("float64", "prod", (257, 255)),
              # just below and just above 512 KiB, where AUTO changes algorithm
              ("float32", "sum", (131071,)), ("float32", "sum", (131073,))]
    out = [(f"allreduce/{strategy}/{d}/{op}/{_shape_id(s)}", d, op, s, None) for d, op, s in cases]
    for d, op, s in (("int32", "sum", (3, 5, 7)), ("int16", "avg", (1009,)),
                     ("float32", "sum", (131073,)), ("bfloat16", "max", (7,))):
        for mode in ("inplace", "new"):
            out.append((f"allreduce/{strategy}/{d}/{op}/{_shape_id(s)}/out={mode}", d, op, s,
                        mode))
    return out


def broadcast_cases(strategy: str, n: int):
    out = []
    for root in range(n):
        for dtype in ("int8", "uint16", "int32", "int64", "float16", "bfloat16", "float64",
                      "bool"):
            for shape in ((0,), (1,), (3, 5, 7), (1009,)):
                out.append((f"broadcast/{strategy}/root{root}/{dtype}/{_shape_id(shape)}",
                            dtype, root, shape))
    out.append((f"broadcast/{strategy}/root{n - 1}/float32/65537", "float32", n - 1, (65537,)))
    return out


def reduce_cases(strategy: str, n: int):
    out = []
    for root in range(n):
        for op in ("sum", "min", "max", "prod"):
            for dtype in ("int32", "uint8", "float32", "bfloat16"):
                out.append((f"reduce/{strategy}/root{root}/{dtype}/{op}/7", dtype, op, root, (7,)))
    out.append((f"reduce/{strategy}/root{n - 1}/int16/sum/3x5x7", "int16", "sum", n - 1,
                (3, 5, 7)))
    out.append((f"reduce/{strategy}/root0/float64/sum/65537", "float64", "sum", 0, (65537,)))
    return out


STRATEGY_KINDS = ["allreduce", "broadcast", "reduce"]
OTHER_GROUPS = ["allgather", "gather", "barrier", "consensus", "scalars", "name_reuse",
                "identity", "compat", "results"]


class Batch:
    """Runs cases and collects failures per group."""

    def __init__(self):
        self.rank = kf.rank()
        self.n = kf.size()
        self.count: Dict[str, int] = {}
        self.failures: Dict[str, List[str]] = {}

    def case(self, group: str, case_id: str, fn: Callable[[], Optional[str]]) -> None:
        self.count[group] = self.count.get(group, 0) + 1
        fails = self.failures.setdefault(group, [])
        try:
            problem = fn()
        except (errors.PeerFailedError, errors.CancelledError):
            raise  # the job is broken: let the whole batch fail with this error
        except Exception as e:  # noqa: BLE001 - recorded against the case
            problem = f"raised {type(e).__name__}: {e}"
        if problem:
            fails.append(f"{case_id} (rank {self.rank} of {self.n}): {problem}")

    def result(self):
        return {"count": self.count, "failures": self.failures}


def _all_inputs(key, n, dtype, shape, op):
    return case_inputs(key, n, dtype, shape, op)


def _run_allreduce(b: Batch, strategy: str):
    for cid, dtype, op, shape, out in allreduce_cases(strategy):
        def one(cid=cid, dtype=dtype, op=op, shape=shape, out=out):
            inputs = _all_inputs(cid, b.n, dtype, shape, op)
            if out is None:
                got = kf.allreduce(inputs[b.rank], op=op, name=cid, strategy=strategy,
                                   timeout=CASE_TIMEOUT)
                return mismatch(got, reference(inputs, op, dtype), dtype, op)
            x = inputs[b.rank].copy()
            target = x if out == "inplace" else np.full_like(x, 7)
            got = kf.allreduce(x, op=op, name=cid, strategy=strategy, timeout=CASE_TIMEOUT,
                               out=target)
            if got is not target:
                return "the result is not the out= array"
            if out == "new" and not np.array_equal(x, inputs[b.rank]):
                return "the input changed although out= was another array"
            return mismatch(target, reference(inputs, op, dtype), dtype, op)
        b.case(f"allreduce/{strategy}", cid, one)


def _run_broadcast(b: Batch, strategy: str):
    for cid, dtype, root, shape in broadcast_cases(strategy, b.n):
        def one(cid=cid, dtype=dtype, root=root, shape=shape):
            inputs = case_inputs(cid, b.n, dtype, shape, "broadcast")
            mine = inputs[b.rank]
            keep = mine.copy()
            got = kf.broadcast(mine, root=root, name=cid, strategy=strategy,
                               timeout=CASE_TIMEOUT)
            if mine.tobytes() != keep.tobytes():
                return "the input array was modified"
            return mismatch(got, inputs[root], dtype, "broadcast")
        b.case(f"broadcast/{strategy}", cid, one)


def _run_reduce(b: Batch, strategy: str):
    for cid, dtype, op, root, shape in reduce_cases(strategy, b.n):
        def one(cid=cid, dtype=dtype, op=op, root=root, shape=shape):
            inputs = _all_inputs(cid, b.n, dtype, shape, op)
            got = kf.reduce(inputs[b.rank], op=op, root=root, name=cid, strategy=strategy,
                            timeout=CASE_TIMEOUT)
            if b.rank != root:
                return None if got is None else f"non-root got {type(got).__name__}, not None"
            return mismatch(got, reference(inputs, op, dtype), dtype, op)
        b.case(f"reduce/{strategy}", cid, one)


# Rows each rank contributes in the "different sizes" gathers (zeros included on purpose).
_ROWS = [3, 0, 5, 1, 0, 2, 4]


def _gather_inputs(kind: str, n: int):
    """(case id, dtype, per-rank shapes) for allgather/gather."""
    cases = []
    for dtype in ALL_DTYPES:
        cases.append((f"{kind}/equal/{dtype}/3x4", dtype, [(3, 4)] * n))
    for dtype in ("int8", "uint64", "float16", "bfloat16", "float32", "bool"):
        cases.append((f"{kind}/ragged/{dtype}/rowsx3", dtype,
                      [(_ROWS[r % 7], 3) for r in range(n)]))
    cases.append((f"{kind}/ragged/int32/1d", "int32", [(_ROWS[(r + 1) % 7],) for r in range(n)]))
    cases.append((f"{kind}/ragged/float64/rowsx2x5", "float64",
                  [(_ROWS[(r + 2) % 7], 2, 5) for r in range(n)]))
    cases.append((f"{kind}/empty/int64/0x3", "int64", [(0, 3)] * n))
    cases.append((f"{kind}/scalar/float32", "float32", [()] * n))
    cases.append((f"{kind}/large/int32", "int32", [(1009 * (r + 1),) for r in range(n)]))
    return cases


def _gather_expected(cid, dtype, shapes):
    parts = ragged_inputs(cid, dtype, shapes)
    return np.concatenate([p.reshape((-1,) + p.shape[1:]) if p.ndim else p.reshape(1)
                           for p in parts], axis=0)


def _run_allgather(b: Batch):
    for cid, dtype, shapes in _gather_inputs("allgather", b.n):
        def one(cid=cid, dtype=dtype, shapes=shapes):
            mine = ragged_inputs(cid, dtype, shapes)[b.rank]
            got = kf.allgather(mine, name=cid, timeout=CASE_TIMEOUT)
            return mismatch(got, _gather_expected(cid, dtype, shapes), dtype, "broadcast")
        b.case("allgather", cid, one)
    # Unnamed allgathers match by their per-kind sequence number.
    def unnamed():
        problems = []
        for step in range(3):
            got = kf.allgather(np.full((b.rank % 3,), step * 100 + b.rank, np.int32),
                               timeout=CASE_TIMEOUT)
            exp = np.concatenate([np.full((r % 3,), step * 100 + r, np.int32)
                                  for r in range(b.n)])
            problem = mismatch(got, exp, "int32", "max")
            if problem:
                problems.append(f"step {step}: {problem}")
        return "; ".join(problems) or None
    b.case("allgather", "allgather/unnamed", unnamed)


def _run_gather(b: Batch):
    for root in range(b.n):
        for cid, dtype, shapes in _gather_inputs(f"gather/root{root}", b.n):
            def one(cid=cid, dtype=dtype, shapes=shapes, root=root):
                mine = ragged_inputs(cid, dtype, shapes)[b.rank]
                got = kf.gather(mine, root=root, name=cid, timeout=CASE_TIMEOUT)
                if b.rank != root:
                    return None if got is None else f"non-root got {type(got).__name__}"
                return mismatch(got, _gather_expected(cid, dtype, shapes), dtype, "broadcast")
            b.case("gather", cid, one)


def _run_barrier(b: Batch):
    # Each round one rank arrives late; nobody may leave before the last one has arrived.
    for rnd in range(4):
        def one(rnd=rnd):
            late = (rnd * 3 + 1) % b.n
            if b.rank == late:
                time.sleep(0.15)
            enter = time.time()
            kf.barrier(name=f"barrier/{rnd}" if rnd % 2 else None, timeout=CASE_TIMEOUT)
            leave = time.time()
            enters = kf.allgather(np.float64(enter), name=f"barrier/enter/{rnd}",
                                  timeout=CASE_TIMEOUT)
            last = float(enters.max())
            if leave < last:
                return (f"left at {leave:.4f} before rank {int(enters.argmax())} entered "
                        f"at {last:.4f}")
            return None
        b.case("barrier", f"barrier/round{rnd}", one)


def _run_consensus(b: Batch):
    n, r = b.n, b.rank
    arr = np.arange(10, dtype=np.float32)
    cases = [
        ("array-same", arr, True),
        ("array-one-differs", arr + (1 if r == n - 1 else 0), n == 1),
        ("array-length-differs", np.arange(10 + (r == n - 1), dtype=np.float32), n == 1),
        ("int-same", 42, True),
        ("int-differs", 42 + (r == 0), n == 1),
        ("np-scalar-same", np.int16(-7), True),
        ("str-same", "resize-to-4", True),
        ("str-differs", f"value-{r % 2}", n == 1),
        ("bytes-same", b"\x00\x01\xff", True),
        ("bytes-empty", b"", True),
        ("bytes-one-empty", b"" if r == n - 1 else b"x", n == 1),
        ("large-same", np.arange(65537, dtype=np.int64), True),
    ]
    for label, value, expected in cases:
        def one(value=value, expected=expected, label=label):
            got = kf.consensus(value, name=f"consensus/{label}", timeout=CASE_TIMEOUT)
            if type(got) is not bool:
                return f"returned {type(got).__name__}, not bool"
            return None if got == expected else f"returned {got}, expected {expected}"
        b.case("consensus", f"consensus/{label}", one)
    # Unnamed ones, twice in a row with different verdicts.
    def unnamed():
        a = kf.consensus(b"same")
        c = kf.consensus(b"x" * (1 + (r == n - 1)))
        return None if (a, c) == (True, n == 1) else f"got {(a, c)}"
    b.case("consensus", "consensus/unnamed", unnamed)


def _run_scalars(b: Batch):
    n, r = b.n, b.rank
    ranks = range(n)

    def check(got, expected, typ):
        if type(got) is not typ:
            return f"type {type(got).__name__}, expected {typ.__name__}"
        if isinstance(expected, float) and not isinstance(expected, np.generic):
            return None if abs(got - expected) <= 1e-9 * max(1, abs(expected)) else \
                f"{got!r} != {expected!r}"
        return None if got == expected else f"{got!r} != {expected!r}"

    py_cases = [
        ("py-int-sum", lambda: kf.allreduce(r + 1), sum(q + 1 for q in ranks), int),
        ("py-int-max", lambda: kf.allreduce(-r, op="max"), 0, int),
        ("py-int-prod", lambda: kf.allreduce(2, op="prod"), 2 ** n, int),
        ("py-int-avg", lambda: kf.allreduce(r * 2, op="avg"), sum(2 * q for q in ranks) // n, int),
        ("py-float-sum", lambda: kf.allreduce(0.25 * (r + 1)), 0.25 * sum(q + 1 for q in ranks),
         float),
        ("py-float-avg", lambda: kf.allreduce(float(r), op="avg"), sum(ranks) / n, float),
        ("py-float-min", lambda: kf.allreduce(1.5 - r, op="min"), 1.5 - (n - 1), float),
        ("py-bool-max", lambda: kf.allreduce(r == n - 1, op="max"), True, bool),
        ("py-bool-min", lambda: kf.allreduce(r != 0, op="min"), False, bool),
        ("py-int-broadcast", lambda: kf.broadcast(r * 10 + 3, root=n - 1), (n - 1) * 10 + 3, int),
        ("py-float-broadcast", lambda: kf.broadcast(r + 0.5, root=0), 0.5, float),
        ("py-bool-broadcast", lambda: kf.broadcast(r == 0, root=0), True, bool),
        ("py-int-reduce", lambda: kf.reduce(r, op="sum", root=0),
         sum(ranks) if r == 0 else None, int if r == 0 else type(None)),
    ]
    for label, fn, expected, typ in py_cases:
        b.case("scalars", f"scalars/{label}", lambda fn=fn, e=expected, t=typ: check(fn(), e, t))
    for i, dtype in enumerate(ALL_DTYPES):
        dt = np_dtype(dtype)
        op = "max" if dtype == "bool" else "sum"
        def one(dt=dt, op=op, dtype=dtype, strategy=STRATEGIES[i % len(STRATEGIES)]):
            x = dt.type(r % 2 == 0) if dtype == "bool" else dt.type(r + 1)
            got = kf.allreduce(x, op=op, strategy=strategy)
            if dtype == "bool":
                exp = dt.type(True)
            else:
                exp = dt.type(sum(q + 1 for q in ranks))
            if type(got) is not dt.type:
                return f"type {type(got).__name__}, expected {dt.type.__name__}"
            if np.asarray(got).shape != ():
                return f"shape {np.asarray(got).shape}"
            return None if got == exp else f"{got!r} != {exp!r}"
        b.case("scalars", f"scalars/numpy-{dtype}", one)
        def bcast(dt=dt, dtype=dtype):
            x = dt.type(r % 2 == 1) if dtype == "bool" else dt.type(r + 2)
            got = kf.broadcast(x, root=n - 1)
            exp = dt.type((n - 1) % 2 == 1) if dtype == "bool" else dt.type(n + 1)
            if type(got) is not dt.type:
                return f"type {type(got).__name__}, expected {dt.type.__name__}"
            return None if got == exp else f"{got!r} != {exp!r}"
        b.case("scalars", f"scalars/numpy-{dtype}-broadcast", bcast)


def _run_name_reuse(b: Batch):
    # Loops record problems and go on, so that every rank runs the same ops even when one
    # step is wrong on some ranks only.
    n, r = b.n, b.rank
    tri = n * (n + 1) // 2

    def same_name():
        problems = []
        for step in range(30):
            got = kf.allreduce(np.full(5, step * (r + 1), np.int64), name="reused",
                               timeout=CASE_TIMEOUT)
            if not np.array_equal(got, np.full(5, step * tri)):
                problems.append(f"step {step}: got {got}")
        return "; ".join(problems) or None

    def alternating():
        problems = []
        for step in range(20):
            name = f"alt{step % 2}"
            got = kf.allreduce(np.float32(step + r), op="max", name=name, timeout=CASE_TIMEOUT)
            if got != np.float32(step + n - 1):
                problems.append(f"step {step} ({name}): got {got!r}")
        return "; ".join(problems) or None

    def size_changes():
        # The same name, with a size that changes from step to step (equal on every rank).
        problems = []
        for step in range(12):
            got = kf.allreduce(np.arange(step * 37, dtype=np.int32) * (r + 1), name="grow",
                               timeout=CASE_TIMEOUT)
            if not np.array_equal(got, np.arange(step * 37, dtype=np.int32) * tri):
                problems.append(f"step {step}: wrong values")
        return "; ".join(problems) or None

    def other_kinds():
        problems = []
        for step in range(10):
            got = kf.broadcast(np.int32(step * 10 + r), root=step % n, name="bc-reused",
                               timeout=CASE_TIMEOUT)
            if got != step * 10 + step % n:
                problems.append(f"broadcast step {step}: got {got!r}")
            g = kf.allgather(np.int32(step + r), name="ag-reused", timeout=CASE_TIMEOUT)
            if not np.array_equal(g, np.arange(n, dtype=np.int32) + step):
                problems.append(f"allgather step {step}: got {g!r}")
        return "; ".join(problems) or None

    for label, fn in (("same-name", same_name), ("alternating", alternating),
                      ("size-changes", size_changes), ("other-kinds", other_kinds)):
        b.case("name_reuse", f"name_reuse/{label}", fn)


def _run_identity(b: Batch):
    def one():
        peers = os.environ["KUNGFU_INIT_PEERS"].split(",")
        me = os.environ["KUNGFU_SELF_SPEC"]
        got = (kf.rank(), kf.size(), kf.local_rank(), kf.local_size())
        exp = (peers.index(me), len(peers), peers.index(me), len(peers))
        if got != exp:
            return f"(rank, size, local_rank, local_size) = {got}, expected {exp}"
        return None
    b.case("identity", "identity/env", one)


def _run_compat(b: Batch):
    import kungfu.python as kp

    def one():
        got = (kp.current_rank(), kp.current_cluster_size(), kp.current_local_rank(),
               kp.current_local_size(), kp.detached())
        exp = (b.rank, b.n, b.rank, b.n, False)
        barrier = kp.run_barrier()
        m = kp.all_reduce_int_max(b.rank * 10 - 5)
        big = kp.all_reduce_int_max(2 ** 40 + b.rank)
        problems = []
        if got != exp:
            problems.append(f"identity {got} != {exp}")
        if barrier is not None:
            problems.append(f"run_barrier returned {barrier!r}")
        if type(m) is not int or m != (b.n - 1) * 10 - 5:
            problems.append(f"all_reduce_int_max returned {m!r}")
        if big != 2 ** 40 + b.n - 1:
            problems.append(f"all_reduce_int_max(2**40 + rank) returned {big!r}")
        return "; ".join(problems) or None
    b.case("compat", "compat/kungfu.python", one)


def _run_results(b: Batch):
    """Results without out= of at least 1 MiB come from a pool of reused memory (kungfu/
    _collective.py, _new_result): a result never shares memory with one still alive, or with
    a view that outlives its array, and a freed result's memory serves the next one."""
    from kungfu import _native

    n, r = b.n, b.rank
    tri = n * (n + 1) // 2
    count = (1 << 20) // 4 + 3  # float32: just over 1 MiB
    held = _native.lib().result_pool_held

    def alive_results_are_apart():
        a = kf.allreduce(np.full(count, r + 1, np.float32), name="pool/a", timeout=CASE_TIMEOUT)
        keep = a[5:9]  # a view outliving its array keeps the memory
        a_ptr = a.__array_interface__["data"][0]
        del a
        c = kf.allreduce(np.full(count, 2 * (r + 1), np.float32), name="pool/c",
                         timeout=CASE_TIMEOUT)
        d = kf.allreduce(np.full(count, 3 * (r + 1), np.float32), name="pool/d",
                         timeout=CASE_TIMEOUT)
        problems = []
        if not np.array_equal(keep, np.full(4, tri, np.float32)):
            problems.append(f"a view of a freed result changed: {keep}")
        if np.may_share_memory(c, d) or a_ptr in (c.__array_interface__["data"][0],
                                                  d.__array_interface__["data"][0]):
            problems.append("two live results (or a live view) share memory")
        if not (np.array_equal(c, np.full(count, 2 * tri, np.float32))
                and np.array_equal(d, np.full(count, 3 * tri, np.float32))):
            problems.append("wrong values")
        return "; ".join(problems) or None

    def freed_memory_is_reused():
        size = count + 1  # a size of its own: the other case's blocks come back meanwhile
        x = np.arange(size, dtype=np.float32) % 7 * (r + 1)
        a = kf.allreduce(x, op="avg", name="pool/e", timeout=CASE_TIMEOUT)
        ptr = a.__array_interface__["data"][0]
        want = (np.arange(size, dtype=np.float64) % 7 * tri / n).astype(np.float32)
        problems = [] if np.array_equal(a, want) else ["avg: wrong values"]
        before = held(size * 4)
        del a
        # The operation's own reference to its output goes when its completion callback has
        # run (on a runtime thread, which needs the GIL: waiting here lets it).
        deadline = time.monotonic() + CASE_TIMEOUT
        while held(size * 4) == before and time.monotonic() < deadline:
            time.sleep(0.001)
        after = held(size * 4)
        if after != (before[0] + size * 4, before[1] + 1):
            problems.append(f"the freed result did not go back to the pool: {before} -> {after}")
        b2 = kf.allreduce(x, op="avg", name="pool/e", timeout=CASE_TIMEOUT)
        if b2.__array_interface__["data"][0] != ptr or held(size * 4) != before:
            problems.append("the next result of that size did not reuse the freed memory")
        if not np.array_equal(b2, want):
            problems.append("avg from reused memory: wrong values")
        return "; ".join(problems) or None

    b.case("results", "alive results are apart", alive_results_are_apart)
    b.case("results", "freed memory is reused", freed_memory_is_reused)


def run_batch():
    """Every case of test_collectives.py for this world size, in one process per rank."""
    b = Batch()
    _run_identity(b)
    for strategy in STRATEGIES:
        _run_allreduce(b, strategy)
        _run_broadcast(b, strategy)
        _run_reduce(b, strategy)
    _run_allgather(b)
    _run_gather(b)
    _run_barrier(b)
    _run_consensus(b)
    _run_scalars(b)
    _run_name_reuse(b)
    _run_compat(b)
    _run_results(b)
    return b.result()


def expected_counts(n: int) -> Dict[str, int]:
    """How many cases each group holds at world size n (the tests check nothing was skipped)."""
    counts = {}
    for s in STRATEGIES:
        counts[f"allreduce/{s}"] = len(allreduce_cases(s))
        counts[f"broadcast/{s}"] = len(broadcast_cases(s, n))
        counts[f"reduce/{s}"] = len(reduce_cases(s, n))
    counts["allgather"] = len(_gather_inputs("allgather", n)) + 1
    counts["gather"] = n * len(_gather_inputs("gather", n))
    counts["barrier"] = 4
    counts["consensus"] = 13
    counts["scalars"] = 13 + 2 * len(ALL_DTYPES)
    counts["name_reuse"] = 4
    counts["identity"] = 1
    counts["compat"] = 1
    counts["results"] = 2
    return counts


def big_allreduce(count: int, strategies: List[str]):
    """Allreduce of `count` float32 (small integers, so every sum is exact) per strategy.

    Returns the seconds each took; raises AssertionError on a wrong value.
    """
    r, n = kf.rank(), kf.size()
    base = (np.arange(count, dtype=np.int64) % 13).astype(np.float32)
    x = base + np.float32(r)
    # sum over ranks of (base + q) = n * base + n(n-1)/2
    expected = base * np.float32(n) + np.float32(n * (n - 1) // 2)
    times = {}
    for s in strategies:
        kf.barrier()
        t0 = time.perf_counter()
        got = kf.allreduce(x, name=f"big/{s}", strategy=s, timeout=120)
        times[s] = time.perf_counter() - t0
        assert got.dtype == np.float32 and got.shape == (count,), (got.dtype, got.shape)
        if not np.array_equal(got, expected):
            bad = np.flatnonzero(got != expected)
            raise AssertionError(f"{s}: {bad.size} of {count} wrong; first at {bad[0]}: "
                                 f"got {got[bad[0]]}, expected {expected[bad[0]]}")
        if not np.array_equal(x, base + np.float32(r)):
            raise AssertionError(f"{s}: the input was modified")
    return times


def default_strategy():
    """Collectives without a strategy argument (the default comes from the environment)."""
    b = Batch()
    n, r = b.n, b.rank
    for dtype, op, shape in (("int32", "sum", (1009,)), ("float32", "avg", (3, 5, 7)),
                             ("float64", "sum", (65537,)), ("uint8", "max", (7,))):
        cid = f"default/allreduce/{dtype}/{op}/{_shape_id(shape)}"
        def one(cid=cid, dtype=dtype, op=op, shape=shape):
            inputs = _all_inputs(cid, n, dtype, shape, op)
            got = kf.allreduce(inputs[r], op=op, name=cid, timeout=CASE_TIMEOUT)
            return mismatch(got, reference(inputs, op, dtype), dtype, op)
        b.case("default", cid, one)
    for root in range(n):
        cid = f"default/broadcast/root{root}"
        def bc(cid=cid, root=root):
            inputs = case_inputs(cid, n, "int64", (1009,), "broadcast")
            got = kf.broadcast(inputs[r], root=root, timeout=CASE_TIMEOUT)
            return mismatch(got, inputs[root], "int64", "broadcast")
        b.case("default", cid, bc)
        cid = f"default/reduce/root{root}"
        def rd(cid=cid, root=root):
            inputs = _all_inputs(cid, n, "int16", (33,), "sum")
            got = kf.reduce(inputs[r], root=root, timeout=CASE_TIMEOUT)
            if r != root:
                return None if got is None else "non-root got a value"
            return mismatch(got, reference(inputs, "sum", "int16"), "int16", "sum")
        b.case("default", cid, rd)
        cid = f"default/gather/root{root}"
        shapes = [(_ROWS[q % 7], 2) for q in range(n)]
        def ga(cid=cid, root=root, shapes=shapes):
            parts = ragged_inputs(cid, "float32", shapes)
            got = kf.gather(parts[r], root=root, timeout=CASE_TIMEOUT)
            if r != root:
                return None if got is None else "non-root got a value"
            return mismatch(got, np.concatenate(parts), "float32", "broadcast")
        b.case("default", cid, ga)
    def ag():
        parts = ragged_inputs("default/allgather", "uint16", [(q + 1, 3) for q in range(n)])
        got = kf.allgather(parts[r], timeout=CASE_TIMEOUT)
        return mismatch(got, np.concatenate(parts), "uint16", "broadcast")
    b.case("default", "default/allgather", ag)
    def bc_cons():
        kf.barrier(timeout=CASE_TIMEOUT)
        same = kf.consensus(b"same", timeout=CASE_TIMEOUT)
        differ = kf.consensus(np.int32(r), timeout=CASE_TIMEOUT)
        return None if (same, differ) == (True, n == 1) else f"consensus gave {(same, differ)}"
    b.case("default", "default/barrier-consensus", bc_cons)
    return b.result()


def half_means():
    """The avg of float16 and bfloat16 where the sum overflows and the mean fits, through every
    path that reaches the runtime's reduction from Python: numpy allreduce and reducescatter,
    TensorFlow's all_reduce and group_all_reduce (a mix of dtypes) and kf.Optimizer's mean of
    the gradients, and a torch tensor on the host (where torch is installed). Rank r's element
    i: float16 64 (600 + r + i); bfloat16 2^127 (1 + (2r + i) / 128). Returns each path's
    result as float64 lists."""
    rank = kf.rank()
    i = np.arange(6)
    f16 = (64.0 * (600 + rank + i)).astype(np.float16)
    bf16 = np.ldexp(1.0 + (2 * rank + i) / 128.0, 127).astype(ml_dtypes.bfloat16)
    out = {"numpy float16": kf.allreduce(f16, "avg", name="half/f16"),
           "numpy bfloat16": kf.allreduce(bf16, "avg", name="half/bf16"),
           "numpy float16 sum": kf.allreduce(f16, "sum", name="half/f16sum"),
           "numpy reducescatter": kf.reducescatter(f16, "avg", name="half/rs")}
    import tensorflow as tf

    from kungfu.tensorflow import ops
    from kungfu.tensorflow.optimizers._fusion import mean_over_workers

    t16, tb16 = tf.constant(f16), tf.cast(tf.constant(bf16.astype(np.float32)), tf.bfloat16)
    out["tf float16"] = ops.all_reduce(t16, op="avg", name="half/tf")
    group = ops.group_all_reduce([t16, tf.constant([2.0, 4.0]), tb16], op="avg", name="half/g")
    out["tf group float16"], out["tf group float32"], out["tf group bfloat16"] = group
    means = mean_over_workers([t16, tf.constant([2.0, 4.0])], "half/grads", None)
    out["tf gradients float16"], out["tf gradients float32"] = means
    try:
        import torch
    except ImportError:
        torch = None
    if torch is not None:
        from kungfu.torch.ops import all_reduce

        out["torch float16"] = all_reduce(torch.tensor(f16), "avg", name="half/torch")
    return {k: np.asarray(v.numpy() if hasattr(v, "numpy") else v, dtype=np.float64).tolist()
            for k, v in out.items()}
