"""Worker bodies for test_process_sets.py: every numpy collective in process sets that run
concurrently (two disjoint, one overlapping), and the failures that must stay inside a set.
Bodies return raw values; the tests compute what they must be (pure numpy)."""
from __future__ import annotations

import numpy as np


def sets_for(n: int) -> dict:
    """Two disjoint sets and one that overlaps both (at np 3, the second has one member)."""
    return {"a": [0, 1], "b": list(range(2, n)), "c": [1, 2]}


def x_of(r: int) -> np.ndarray:
    return (np.arange(10, dtype=np.float64).reshape(5, 2) * (r + 1) - r)


def a2a_of(r: int, m: int) -> np.ndarray:
    """2 rows for every member j of a set of m: 100 r + j, then the row index."""
    return np.array([[100 * r + j, k] for j in range(m) for k in range(2)], np.int32)


def every_collective() -> dict:
    import kungfu as kf

    r, n = kf.rank(), kf.size()
    sets = {k: kf.ProcessSet(v) for k, v in sets_for(n).items()}
    pending = {}
    for key, ps in sets.items():
        if not ps.included():
            continue
        m, root = ps.size(), ps.size() - 1
        x = x_of(r)
        pending[key] = {
            "sum": kf.allreduce_async(x, "sum", name="ar", process_set=ps),
            "avg": kf.allreduce_async(x, "avg", name="avg", process_set=ps),
            "max_int": kf.allreduce_async(np.int64(r * 7), "max", name="mx", process_set=ps),
            "reduce": kf.reduce_async(x, "sum", root, name="rd", process_set=ps),
            "bcast": kf.broadcast_async(x, root, name="bc", process_set=ps),
            "allgather": kf.allgather_async(x[: r % 3 + 1], name="ag", process_set=ps),
            "gather": kf.gather_async(x, root, name="ga", process_set=ps),
            "alltoall": kf.alltoall_async(a2a_of(r, m), name="a2a", process_set=ps),
            "rscatter": kf.reducescatter_async(x, "sum", name="rs", process_set=ps),
            "consensus": kf.consensus_async(np.int32(5), name="cs", process_set=ps),
            "disagree": kf.consensus_async(np.int32(r), name="cs2", process_set=ps),
        }
    whole = kf.allreduce_async(np.float64(r), name="ar")  # the cluster's own "ar", alongside
    out = {"rank": r, "size": n, "whole": whole.wait()}
    for key, hs in pending.items():
        ps = sets[key]
        res = {k: h.wait() for k, h in hs.items()}
        kf.barrier(name="bar", process_set=ps)
        res["set_rank"] = ps.rank()
        out[key] = {k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in res.items()}
    out["not_in"] = sorted(k for k, ps in sets.items() if not ps.included())
    return out


def failures_stay_in_the_set() -> dict:
    """Set a = [0, 1]: a shape mismatch (rank 1) and input rejected before the runtime (rank 0)
    fail both members; the other workers run their own set and the cluster's operations."""
    import kungfu as kf
    from kungfu import errors

    r, n = kf.rank(), kf.size()
    a, b = kf.ProcessSet([0, 1]), kf.ProcessSet(list(range(2, n)))
    out = {"rank": r}
    try:
        kf.allreduce(np.zeros(4), process_set=a)  # rank 3 is no member: refused at once
        out["refused"] = None
    except errors.InvalidArgumentError as e:
        out["refused"] = str(e)
    if a.included():
        errs = []
        try:
            kf.allreduce(np.ones(3 if r == 1 else 2), name="g", process_set=a)
        except errors.InvalidArgumentError as e:
            errs.append(str(e))
        try:
            kf.allreduce(np.ones(2), op="bogus" if r == 0 else "sum", name="g", process_set=a)
        except errors.InvalidArgumentError as e:
            errs.append(str(e))
        out["errors"] = errs
        out["after"] = kf.allreduce(np.float64(r + 1), name="g", process_set=a)
    else:
        out["b"] = [kf.allreduce(np.float64(r + 1), name="g", process_set=b) for _ in range(3)]
    out["whole"] = kf.allreduce(np.float64(r + 1), name="g")
    return out


def tf_collectives() -> dict:
    """The TensorFlow ops with process_set=, eagerly and in a tf.function, and the gradient of
    an allreduce in a set (it runs in the same set)."""
    import tensorflow as tf

    import kungfu as kf
    from kungfu.tensorflow import ops

    r, n = kf.rank(), kf.size()
    out = {"rank": r}
    for key, ranks in sets_for(n).items():
        ps = kf.ProcessSet(ranks)
        if not ps.included():
            continue
        m, root = ps.size(), ps.size() - 1
        x = tf.constant(x_of(r))
        res = {
            "sum": ops.all_reduce(x, name="ar", process_set=ps),
            "avg": ops.all_reduce(x, op="avg", name="avg", process_set=ps),
            "group": ops.group_all_reduce([x, x[0]], name="grp", process_set=ps),
            "bcast": ops.broadcast(x, root, name="bc", process_set=ps),
            "allgather": ops.all_gather(x[: r % 3 + 1], name="ag", process_set=ps),
            "alltoall": ops.all_to_all(tf.constant(a2a_of(r, m)), name="a2a", process_set=ps),
            "rscatter": ops.reduce_scatter(x, name="rs", process_set=ps),
            "consensus": ops.consensus(tf.constant(5), name="cs", process_set=ps),
        }
        ops.barrier(name="bar", process_set=ps)

        @tf.function
        def traced(t):
            return ops.all_reduce(t, name="traced", process_set=ps)

        res["traced"] = [traced(x), traced(x * 2)]
        v = tf.Variable(x)
        with tf.GradientTape() as tape:
            y = tf.reduce_sum(ops.all_reduce(v * float(r + 1), name="fwd", process_set=ps))
        res["grad"] = tape.gradient(y, v)
        out[key] = tf.nest.map_structure(lambda t: t.numpy().tolist(), res)
    return out


def members_made_different_sets() -> dict:
    """Rank 0 makes [0, 1], ranks 1 and 2 make [0, 1, 2]: the first use fails on all three."""
    import kungfu as kf
    from kungfu import errors

    r = kf.rank()
    ps = kf.ProcessSet([0, 1] if r == 0 else [0, 1, 2])
    try:
        kf.allreduce(np.float64(1), process_set=ps)
        return {"rank": r, "error": None}
    except errors.KungFuError as e:
        return {"rank": r, "error": f"{type(e).__name__}: {e}"}
