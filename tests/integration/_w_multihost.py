"""Worker of test_multihost.py's layout test, run by kungfu-run in every "host" namespace.

Allreduces every dtype under every strategy across hosts (sizes 1, 7 and 2**20 + 3, the large
one under the strategies AUTO picks across hosts), floats that round differently in every
reduction order, a broadcast from every root and an allgather; checks every result against numpy
(inputs as in _w_collectives: a pure function of case and rank) and prints one JSON line: the
cases run and failed per group, and a SHA-256 of every result's bytes, which must be the same on
every peer.
"""
from __future__ import annotations

import hashlib
import json

import numpy as np

import _w_collectives as W
import kungfu as kf
from kungfu import errors

BIG = (1 << 20) + 3
BIG_STRATEGIES = ["HIERARCHICAL", "RING", "AUTO"]
ACROSS_HOSTS = [s for s in W.STRATEGIES if s != "DIRECT"]  # DIRECT needs one host


def allreduce_cases():
    """(strategy, dtype, op, count) in the order every peer runs them."""
    out = []
    for s in ACROSS_HOSTS:
        for dtype in W.ALL_DTYPES:
            for op in ("min", "max") if dtype == "bool" else ("sum", "max"):
                for count in (1, 7):
                    out.append((s, dtype, op, count))
    for s in BIG_STRATEGIES:
        for dtype in W.ALL_DTYPES:
            out.append((s, dtype, "max" if dtype == "bool" else "sum", BIG))
    return out


def expected_counts(n: int) -> dict:
    counts: dict = {}
    for s, *_ in allreduce_cases():
        counts[f"allreduce/{s}"] = counts.get(f"allreduce/{s}", 0) + 1
    counts["rounding"] = 2 * len(ACROSS_HOSTS)
    counts["broadcast"] = n * len(ACROSS_HOSTS)
    counts["allgather"] = 1
    counts["direct"] = 1
    return counts


def main() -> None:
    b = W.Batch()
    digest = hashlib.sha256()

    for s, dtype, op, count in allreduce_cases():
        cid = f"multihost/{s}/{dtype}/{op}/{count}"

        def one(cid=cid, s=s, dtype=dtype, op=op, count=count):
            inputs = W.case_inputs(cid, b.n, dtype, (count,), op)
            got = kf.allreduce(inputs[b.rank], op=op, name=cid, strategy=s,
                               timeout=W.CASE_TIMEOUT)
            digest.update(got.tobytes())
            return W.mismatch(got, W.reference(inputs, op, dtype), dtype, op)
        b.case(f"allreduce/{s}", cid, one)

    for s in ACROSS_HOSTS:
        for count in (7, BIG):
            def rounding(s=s, count=count):
                i = np.arange(count) % 101
                got = kf.allreduce((1.0 / (3 + b.rank + i)).astype(np.float32), strategy=s,
                                   name=f"rounding/{s}/{count}", timeout=W.CASE_TIMEOUT)
                digest.update(got.tobytes())
                exact = sum(1.0 / (3 + r + i) for r in range(b.n))
                if not np.allclose(got, exact, rtol=1e-5, atol=0):
                    return f"max relative error {np.max(np.abs(got - exact) / exact):.2e}"
                return None
            b.case("rounding", f"rounding/{s}/{count}", rounding)
        for root in range(b.n):
            cid = f"multihost/broadcast/{s}/root{root}"

            def bcast(cid=cid, s=s, root=root):
                inputs = W.case_inputs(cid, b.n, "float64", (1009,), "broadcast")
                got = kf.broadcast(inputs[b.rank], root=root, name=cid, strategy=s,
                                   timeout=W.CASE_TIMEOUT)
                digest.update(got.tobytes())
                return W.mismatch(got, inputs[root], "float64", "broadcast")
            b.case("broadcast", cid, bcast)

    def allgather():
        got = kf.allgather(np.full(3, b.rank, dtype=np.int32), timeout=W.CASE_TIMEOUT)
        want = np.repeat(np.arange(b.n, dtype=np.int32), 3)  # rows concatenated
        return None if np.array_equal(got, want) else f"got {got.tolist()}"
    b.case("allgather", "multihost/allgather", allgather)

    def direct():
        try:
            kf.allreduce(np.ones(4, np.float32), strategy="DIRECT", timeout=W.CASE_TIMEOUT)
        except errors.InvalidArgumentError as e:
            return None if "one host" in str(e) else f"refused, but the message says: {e}"
        return "DIRECT across hosts was not refused"
    b.case("direct", "multihost/direct", direct)

    print(json.dumps({"rank": b.rank, "size": b.n, "count": b.count, "failures": b.failures,
                      "expected": expected_counts(b.n), "digest": digest.hexdigest()}),
          flush=True)


if __name__ == "__main__":
    main()
