"""Worker bodies for test_tf_ops.py: kungfu's TensorFlow ops in real worker processes.

TensorFlow takes seconds to import, so each body runs many checks and returns raw results (as
numpy arrays, dtype names, error class names and messages); the tests compute what the values
must be and judge them. The input helpers below are pure numpy, shared by bodies and tests.
"""
from __future__ import annotations

import functools
import os
import signal
import threading
import time

import numpy as np

REDUCE_DTYPES = ["int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
                 "float16", "bfloat16", "float32", "float64"]
REDUCE_OPS = ["sum", "min", "max", "prod"]
SHAPE = (2, 4)


# -- inputs (pure numpy) -----------------------------------------------------------------------

def reduce_input(dtype: str, op: str, rank: int) -> np.ndarray:
    """Rank `rank`'s input for all_reduce, as float64 (bool for "bool"), exact in `dtype`.

    Small values, so that sums and products over 3 workers neither overflow int8/uint8 nor
    round in float16/bfloat16, whatever order the runtime reduces in.
    """
    j = np.arange(8)
    if dtype == "bool":
        return (((j >> rank) & 1) == 1).reshape(SHAPE)  # min: only j=7 True at np 3
    base = (j * (rank + 2) + rank) % 7
    if dtype.startswith("uint"):
        v = base % 4 + (1 if op == "prod" else 0)
    else:
        v = base - 3.0
        if dtype in ("float16", "float32", "float64"):
            v = v + 0.5
    return np.asarray(v, np.float64).reshape(SHAPE)


def broadcast_input(rank: int) -> np.ndarray:
    return (100.0 * rank + np.arange(6)).reshape(2, 3)


def gather_input(rank: int) -> np.ndarray:
    """rank + 1 rows of 3: axis-0 sizes differ per worker."""
    return (100.0 * rank + np.arange(3 * (rank + 1))).reshape(rank + 1, 3)


def gather_input_ragged(rank: int) -> np.ndarray:
    """`rank` rows of 2 (rank 0 passes an empty tensor)."""
    return (10 * rank + np.arange(2 * rank)).reshape(rank, 2)


def group_inputs(rank: int):
    """(dtype, shape, values) of the tensors given to group_all_reduce, in order."""
    specs = [("float32", (2, 2)), ("float32", (3,)), ("int32", (4,)), ("float32", (2, 2)),
             ("float64", (5,)), ("float32", (1,)), ("int32", (2, 1)), ("float32", ()),
             ("float64", (3, 1)), ("int64", (6,))]
    out = []
    for i, (dt, shape) in enumerate(specs):
        size = int(np.prod(shape))
        out.append((dt, shape, (np.arange(size) + 10 * i + rank).reshape(shape).astype(np.float64)))
    return out


# With bucket_bytes=32 the tensors above go into these buckets (indices in the list above):
# float32: [0 (16 B), 1 (12 B), 3 (16 B)] -> 44 B >= 32 closes it; [5, 7] ; int32: [2 (16 B),
# 6 (8 B)] ; float64: [4 (40 B)] closes at once, [8] ; int64: [9].
GROUP_BUCKET_BYTES = 32
# Buckets are named <prefix>/<dtype>/<index of the first tensor in the bucket>.
GROUP_BUCKET_NAMES = ["group/float32/0", "group/float32/5", "group/int32/2", "group/float64/4",
                      "group/float64/8", "group/int64/9"]


# -- helpers -----------------------------------------------------------------------------------

def _tf():
    import tensorflow as tf

    import kungfu.tensorflow  # noqa: F401 - loads the op library and connects to the peers
    from kungfu.tensorflow import ops

    return tf, ops


def _pack(t):
    """A tensor as (dtype name, shape, values): floats as float64, ints as int64 (exact here)."""
    a = np.asarray(t.numpy() if hasattr(t, "numpy") else t)
    name = t.dtype.name if hasattr(t, "dtype") and hasattr(t.dtype, "name") else str(a.dtype)
    if a.dtype == bool:
        v = a.copy()
    elif name in ("float16", "bfloat16", "float32", "float64"):
        v = a.astype(np.float64)
    else:
        v = a.astype(np.int64)
    return name, tuple(a.shape), v


def _outcome(fn):
    t0 = time.monotonic()
    try:
        value = fn()
        return {"error": None, "value": value, "seconds": time.monotonic() - t0}
    except Exception as e:  # noqa: BLE001 - the test judges it
        return {"error": type(e).__name__, "message": str(e), "seconds": time.monotonic() - t0,
                "mro": [c.__name__ for c in type(e).__mro__]}


def _peers():
    return os.environ.get("KUNGFU_INIT_PEERS", "").split(",")


# -- values ------------------------------------------------------------------------------------

def values():
    """Every op's values, eagerly and inside tf.function; returns a dict of raw results."""
    tf, ops = _tf()
    import kungfu as kf

    r, n = kf.rank(), kf.size()
    res = {"rank": r, "size": n}
    # Autograph's source transformation costs seconds per function on a small machine, and
    # nothing here needs it; the multi-step function below keeps it, as user code would.
    graph = functools.partial(tf.function, autograph=False)

    # -- all_reduce, every dtype and op ---------------------------------------------------
    cases = [(dt, op) for dt in REDUCE_DTYPES for op in REDUCE_OPS]
    cases += [("bool", "min"), ("bool", "max")]

    def make(dt, op):
        return tf.constant(reduce_input(dt, op, r), dtype=tf.as_dtype(dt))

    strategies = [None, "STAR", "RING", "TREE"]
    eager = {}
    for i, (dt, op) in enumerate(cases):
        eager[(dt, op)] = _pack(ops.all_reduce(make(dt, op), op=op, name=f"e/ar/{dt}/{op}",
                                               strategy=strategies[i % len(strategies)]))
    res["all_reduce/eager"] = eager

    @graph
    def all_reduce_graph():
        # Default names: derived from the (identically traced) tensor names on every worker.
        return {f"{dt}/{op}": ops.all_reduce(make(dt, op), op=op) for dt, op in cases}

    out = all_reduce_graph()
    res["all_reduce/graph"] = {(dt, op): _pack(out[f"{dt}/{op}"]) for dt, op in cases}
    res["all_reduce/graph_names"] = sorted(
        o.get_attr("op_name").decode()
        for o in all_reduce_graph.get_concrete_function().graph.get_operations()
        if o.type == "KungfuAllReduce")

    # -- the same tf.function for several steps, values changing per step ----------------
    traces = []

    @tf.function(input_signature=[tf.TensorSpec([3], tf.float32)])
    def step(x):
        traces.append(1)
        return (ops.all_reduce(x, name="steps/sum"), ops.all_reduce(x, op="max"),
                ops.all_reduce(tf.cast(x, tf.int64), op="min", name="steps/min"))

    res["steps"] = []
    for k in range(5):
        x = np.array([r + 10 * k, -r, k * r], np.float32)
        s, m, mn = step(tf.constant(x))
        res["steps"].append((_pack(s), _pack(m), _pack(mn)))
    res["steps_traces"] = len(traces)

    v = tf.Variable(float(r + 1), dtype=tf.float64)

    @graph
    def train():
        v.assign(ops.all_reduce(v.read_value(), name="train/v"))
        return v.read_value()

    res["variable_steps"] = [float(train().numpy()) for _ in range(3)]

    # -- group_all_reduce -----------------------------------------------------------------
    def group_tensors():
        return [tf.constant(vals, dtype=tf.as_dtype(dt)) for dt, _, vals in group_inputs(r)]

    res["group/eager"] = [_pack(t) for t in ops.group_all_reduce(
        group_tensors(), name="eg", bucket_bytes=GROUP_BUCKET_BYTES)]
    res["group/eager_max"] = [_pack(t) for t in ops.group_all_reduce(
        group_tensors(), op="max", name="egmax")]  # default bucket size: one bucket per dtype

    @graph
    def group_graph():
        return ops.group_all_reduce(group_tensors(), bucket_bytes=GROUP_BUCKET_BYTES)

    @graph
    def group_graph_default():
        return ops.group_all_reduce(group_tensors(), name="gd")

    graph_ops = group_graph_default.get_concrete_function().graph.get_operations()
    res["group/default_ops"] = sorted(
        (o.type, o.get_attr("op_name").decode()) for o in graph_ops if o.type.startswith("Kungfu"))
    res["group/default_copies"] = sorted(o.type for o in graph_ops if "Concat" in o.type
                                         or "Split" in o.type)
    res["group/default"] = [_pack(t) for t in group_graph_default()]
    res["group/graph"] = _outcome(lambda: [_pack(t) for t in group_graph()])

    # -- collectives in a tf.function run in no fixed order ---------------------------------
    # Each worker writes the same four allreduces in another program order (ranks of odd
    # parity reversed): if TensorFlow ran them in program order, rank 0's first op would wait
    # for rank 1's, queued behind rank 1's other three, and none would finish before its 20 s
    # deadline.
    @graph
    def crossed():
        order = range(4) if r % 2 == 0 else reversed(range(4))
        outs = {i: ops.all_reduce(tf.fill([3], float(10 * i + r)), name=f"crossed/{i}", timeout=20)
                for i in order}
        outs["b"] = ops.broadcast(tf.fill([2], float(r)), root=n - 1, name="crossed/b", timeout=20)
        outs["g"] = ops.all_gather(tf.fill([1], float(r)), name="crossed/ag", timeout=20)
        return [outs[k] for k in (0, 1, 2, 3, "b", "g")]

    kinds = ("KungfuAllReduce", "KungfuBroadcast", "KungfuAllGather")
    res["crossed/chained"] = sorted(
        f"{o.name} after {c.name}"
        for o in crossed.get_concrete_function().graph.get_operations() if o.type in kinds
        for c in o.control_inputs if c.type in kinds)
    res["crossed"] = _outcome(lambda: [t.numpy().tolist() for t in crossed()])

    # Inside a loop the same op runs once per iteration under one name; an iteration's input
    # does not wait for the previous iteration's allreduce, so only program order pairs the k-th
    # run of the name with iteration k on every worker.
    @graph
    def looped():
        def body(i, acc):
            x = tf.fill([1000], tf.cast(i, tf.float32) * 10 + r)
            y = ops.all_reduce(x, name="looped", timeout=20)
            return i + 1, acc + y * tf.cast(i + 1, tf.float32)

        return tf.while_loop(lambda i, acc: i < 6, body, (tf.constant(0), tf.zeros([1000])))[1]

    # Ordering same-name ops keeps nothing of a traced graph alive once its function is gone.
    import gc
    import weakref

    @graph
    def twice(x):
        return ops.all_reduce(x, name="twice") + ops.all_reduce(x, name="twice")

    traced = weakref.ref(twice.get_concrete_function(tf.TensorSpec([2])).graph)
    res["twice"] = twice(tf.ones([2])).numpy().tolist()
    del twice
    gc.collect()
    res["twice/graph_freed"] = traced() is None

    res["looped"] = _outcome(lambda: [sorted(set(looped().numpy().tolist())) for _ in range(10)])
    if res["group/graph"]["error"] is None:
        res["group/graph_buckets"] = sorted(
            o.get_attr("op_name").decode()
            for o in group_graph.get_concrete_function().graph.get_operations()
            if o.type == "KungfuGroupAllReduce")

    # -- broadcast, from each root --------------------------------------------------------
    bc = {}
    for root in range(n):
        for dt in ("float32", "int64", "bfloat16", "uint8"):
            x = tf.constant(broadcast_input(r) % 256 if dt == "uint8" else broadcast_input(r),
                            dtype=tf.as_dtype(dt))
            bc[("eager", root, dt)] = _pack(ops.broadcast(x, root=root, name=f"bc/{root}/{dt}"))

    @graph
    def broadcast_graph():
        x = tf.constant(broadcast_input(r), tf.float64)
        return [ops.broadcast(x, root=root) for root in range(n)]

    for root, t in enumerate(broadcast_graph()):
        bc[("graph", root, "float64")] = _pack(t)
    res["broadcast"] = bc

    # -- all_gather -----------------------------------------------------------------------
    res["all_gather/eager"] = _pack(ops.all_gather(tf.constant(gather_input(r), tf.float32),
                                                   name="ag"))
    res["all_gather/eager_ragged"] = _pack(ops.all_gather(
        tf.constant(gather_input_ragged(r), tf.int8), name="ag/ragged"))
    static = {}

    @graph
    def gather_graph():
        a = ops.all_gather(tf.constant(gather_input(r), tf.float32))
        b = ops.all_gather(tf.constant(gather_input_ragged(r), tf.int16))
        c = ops.all_gather(tf.zeros([r + 1, 2, 3], tf.float64), name="ag/3d")
        static["a"], static["b"], static["c"] = (a.shape.as_list(), b.shape.as_list(),
                                                 c.shape.as_list())
        return a, b, c

    a, b, c = gather_graph()
    res["all_gather/graph"] = (_pack(a), _pack(b), _pack(c))
    res["all_gather/static"] = static

    # -- barrier --------------------------------------------------------------------------
    def timed_barrier(run):
        time.sleep(0.3 * r)
        arrived = time.time()
        run()
        return arrived, time.time()

    res["barrier/eager"] = timed_barrier(lambda: ops.barrier(name="bar/eager"))
    @graph
    def barrier_graph():
        ops.barrier(name="bar/graph")

    res["barrier/graph"] = [timed_barrier(barrier_graph) for _ in range(2)]

    # -- consensus ------------------------------------------------------------------------
    same = tf.constant([1.5, 2.5, 3.5])
    differ = tf.constant([1, r, 3], tf.int64)
    length = tf.range(r + 1)
    res["consensus/eager"] = {
        "same": bool(ops.consensus(same, name="cs/same")),
        "differ": bool(ops.consensus(differ, name="cs/differ")),
        "length": bool(ops.consensus(length, name="cs/length")),
        "same_again": bool(ops.consensus(same, name="cs/same")),
    }

    @graph
    def consensus_graph(x):
        return ops.consensus(x, name="cs/graph")

    res["consensus/graph"] = [bool(consensus_graph(tf.constant([k, k * r], tf.int32)))
                              for k in range(3)]

    # -- peer_info / rank / cluster_size -------------------------------------------------
    pr, ps = ops.peer_info()
    res["peer_info/eager"] = (pr.dtype.name, int(pr), ps.dtype.name, int(ps),
                              int(ops.rank()), int(ops.cluster_size()))
    g = graph(lambda: (ops.rank(), ops.cluster_size(), ops.peer_info()))()
    res["peer_info/graph"] = (int(g[0]), int(g[1]), int(g[2][0]), int(g[2][1]))

    # -- counter -------------------------------------------------------------------------
    count = graph(lambda: (ops.counter(), ops.counter(init=5, incr=3)))
    res["counter"] = [(int(a), int(b)) for a, b in (count() for _ in range(4))]

    # -- fuse / defuse -------------------------------------------------------------------
    parts = [np.arange(6.0).reshape(2, 3), np.arange(4.0) + 10, np.array(42.0),
             np.arange(4.0).reshape(1, 2, 2) - 7]
    shapes = [p.shape for p in parts]
    fused = ops.fuse([tf.constant(p, tf.float32) for p in parts])
    res["fuse/eager"] = (_pack(fused), [_pack(t) for t in ops.defuse(fused, shapes)])

    @graph
    def roundtrip():
        f = ops.fuse([tf.constant(p, tf.float32) for p in parts])
        return f, ops.defuse(f, shapes)

    f, d = roundtrip()
    res["fuse/graph"] = (_pack(f), [_pack(t) for t in d])
    res["fuse/parts"] = parts

    # -- save_variable / request_variable -------------------------------------------------
    peer = (r + 1) % n
    p2p = {}
    ops.save_variable(tf.fill([2, 3], 10.0 * r + 1), name="w")
    ops.barrier(name="p2p/saved/1")
    p2p["peer/1"] = _pack(ops.request_variable(peer, name="w", shape=[2, 3], dtype=tf.float32))
    p2p["self/1"] = _pack(ops.request_variable(r, name="w", shape=[2, 3], dtype=tf.float32))
    ops.barrier(name="p2p/read/1")
    ops.save_variable(tf.fill([2, 3], 10.0 * r + 2), name="w")  # replaces the old blob
    ops.barrier(name="p2p/saved/2")
    p2p["peer/2"] = _pack(ops.request_variable(peer, name="w", shape=[2, 3], dtype=tf.float32))
    ops.save_variable(tf.constant([r, -r, 7 * r], tf.int64), name="w64")
    ops.barrier(name="p2p/saved/3")
    p2p["int64"] = _pack(ops.request_variable(tf.constant(peer), name="w64", shape=[3], dtype=tf.int64))
    p2p["missing/peer"] = _outcome(
        lambda: ops.request_variable(peer, name="no-such-blob", shape=[2], dtype=tf.float32))
    p2p["missing/self"] = _outcome(
        lambda: ops.request_variable(r, name="no-such-blob-self", shape=[2], dtype=tf.float32))
    p2p["size/peer"] = _outcome(lambda: ops.request_variable(peer, name="w", shape=[5], dtype=tf.float32))
    p2p["size/self"] = _outcome(lambda: ops.request_variable(r, name="w", shape=[2, 2], dtype=tf.float32))
    # Another dtype of the same byte size is refused, not reinterpreted.
    p2p["dtype/peer"] = _outcome(lambda: ops.request_variable(peer, name="w", shape=[2, 3], dtype=tf.int32))
    p2p["dtype/self"] = _outcome(lambda: ops.request_variable(r, name="w", shape=[2, 3], dtype=tf.int32))
    p2p["after_errors"] = _pack(ops.request_variable(peer, name="w", shape=[2, 3], dtype=tf.float32))
    # KungFu's positional order: (target, version, name, shape, dtype).
    p2p["kungfu_order"] = _pack(ops.request_variable(peer, None, "w", [2, 3], tf.float32))
    p2p["version"] = _outcome(lambda: ops.request_variable(peer, 3, "w", [2, 3], tf.float32))
    ops.barrier(name="p2p/eager/done")

    # A saved tensor is lent to the store, not copied: updating in place the variable it was
    # read from (as optimizers do) afterwards must not change what the store serves.
    lent = tf.Variable(tf.fill([1000], 5.0 + r))
    ops.save_variable(tf.convert_to_tensor(lent), name="lent")
    lent.assign_sub(tf.ones([1000]))
    lent.assign_add(tf.fill([1000], 10.0))
    tf.raw_ops.ResourceApplyGradientDescent(var=lent.handle, alpha=1.0, delta=tf.ones([1000]))
    lent.assign(tf.fill([1000], -3.0))
    ops.barrier(name="p2p/lent")
    p2p["lent/self"] = _pack(ops.request_variable(r, name="lent", shape=[1000], dtype=tf.float32))
    p2p["lent/peer"] = _pack(ops.request_variable(peer, name="lent", shape=[1000], dtype=tf.float32))
    p2p["lent/variable"] = _pack(lent)
    ops.barrier(name="p2p/lent/read")

    w = tf.Variable(tf.zeros([2, 3]), name="pw")

    @graph
    def exchange(k):
        # Stateful ops in a tf.function run in program order: save, barrier, request.
        w.assign(tf.fill([2, 3], 100.0 * tf.cast(k, tf.float32) + r))
        ops.save_variable(w)  # default blob name from the variable, the same on every worker
        ops.barrier(name="p2p/graph/saved")
        got = ops.request_variable(peer, like=w)
        ops.barrier(name="p2p/graph/read")
        return got

    p2p["graph"] = [_pack(exchange(tf.constant(k))) for k in range(3)]
    res["p2p"] = p2p

    # -- eager mode without name= ---------------------------------------------------------
    t = tf.constant([1.0, 2.0])
    res["noname"] = {
        "all_reduce": _outcome(lambda: ops.all_reduce(t)),
        "broadcast": _outcome(lambda: ops.broadcast(t)),
        "all_gather": _outcome(lambda: ops.all_gather(t)),
        "consensus": _outcome(lambda: ops.consensus(t)),
        "save_variable": _outcome(lambda: ops.save_variable(t)),
        "request_variable": _outcome(lambda: ops.request_variable(0, shape=[2],
                                                                  dtype=tf.float32)),
    }
    res["bad_op"] = _outcome(lambda: ops.all_reduce(t, op="mean", name="bad-op"))
    # Nobody leaves while another worker may still be reading its blobs.
    ops.barrier(name="values/done")

    # -- broadcast_variables in a TF1-style graph session ---------------------------------
    # Before: the op it returned grouped nothing, so a session broadcast nothing.
    from kungfu.tensorflow.initializer import broadcast_variables
    g = tf.Graph()
    with g.as_default():
        v = tf.Variable(np.full(3, float(r + 1), np.float32))
        w = tf.compat.v1.Variable(np.full(2, 10.0 * (r + 1), np.float64))
        bcast = kf.broadcast_variables([v, w], root=n - 1, name="tf1/a")
        bcast2 = broadcast_variables([w], root=0, name="tf1/b")
        import keras
        k = keras.Variable([1.0])
        res["tf1/keras"] = _outcome(lambda: kf.broadcast_variables([k], name="tf1/k"))
        with tf.compat.v1.Session(graph=g) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            sess.run(bcast)
            res["tf1/first"] = [sess.run(v).tolist(), sess.run(w).tolist()]
            sess.run(w.assign(np.full(2, -1.0 - r)))
            sess.run(bcast2)
            res["tf1/second"] = sess.run(w).tolist()
    return res


# -- errors: mismatches and deadlines ----------------------------------------------------------

def errors():
    """Workers disagree, or wait alone: each case's outcome, and whether an op works after."""
    tf, ops = _tf()
    import kungfu as kf

    r, n = kf.rank(), kf.size()
    odd = r == n - 1  # only the last rank differs
    out = {"rank": r}

    def recover(i):
        o = _outcome(lambda: ops.all_reduce(tf.constant([r + 1, 1], tf.int64),
                                            name=f"after/{i}", timeout=20))
        return o["error"] is None and o["value"].numpy().tolist() == [n * (n + 1) // 2, n]

    @tf.function(autograph=False)
    def graph_size_mismatch():
        return ops.all_reduce(tf.ones([7 if odd else 6]), name="mm/graph-size")


    cases = [
        ("all_reduce-size", lambda: ops.all_reduce(tf.ones([5 if odd else 4]), name="mm/size")),
        ("all_reduce-dtype", lambda: ops.all_reduce(
            tf.ones([4], tf.float64 if odd else tf.float32), name="mm/dtype")),
        ("all_reduce-size-graph", graph_size_mismatch),
        ("broadcast-size", lambda: ops.broadcast(tf.ones([3 if odd else 2]), root=0,
                                                 name="mm/bc")),
        ("all_gather-rows", lambda: ops.all_gather(tf.ones([2, 4 if odd else 3]),
                                                   name="mm/ag")),
        # Same dtype and total count, split differently between the tensors.
        ("group-split", lambda: ops.group_all_reduce(
            [tf.ones([4 if odd else 3]), tf.ones([3 if odd else 4])], name="mm/group")),
        # Same dtype and element count, another shape: the whole shape must agree.
        ("all_reduce-shape", lambda: ops.all_reduce(tf.ones([3, 2] if odd else [2, 3]),
                                                    name="mm/shape")),
        ("broadcast-shape", lambda: ops.broadcast(tf.ones([3, 2] if odd else [2, 3]), root=0,
                                                  name="mm/bc-shape")),
        ("group-shape", lambda: ops.group_all_reduce(
            [tf.ones([2]), tf.ones([3, 2] if odd else [2, 3])], name="mm/group-shape")),
        # Rows of the same size but another shape (6 elements either way).
        ("all_gather-dims", lambda: ops.all_gather(tf.ones([2, 2, 3] if odd else [2, 3, 2]),
                                                   name="mm/ag-dims")),
    ]
    mm = []
    for i, (label, fn) in enumerate(cases):
        o = _outcome(fn)
        o.pop("value", None)
        o["case"] = label
        o["recovered"] = recover(i)
        mm.append(o)
    out["mismatch"] = mm

    # Local errors: every worker makes the same bad call.
    local = [
        ("bool-sum", lambda: ops.all_reduce(tf.constant([True, False]), name="bad/bool")),
        ("gather-scalar", lambda: ops.all_gather(tf.constant(1.0), name="bad/scalar")),
    ]
    out["local"] = []
    for i, (label, fn) in enumerate(local):
        o = _outcome(fn)
        o.pop("value", None)
        o["case"] = label
        o["recovered"] = recover(100 + i)
        out["local"].append(o)

    # A per-op deadline: rank 0 waits alone on an op the others never run.
    lonely_graph = tf.function(
        lambda: ops.all_reduce(tf.ones([3]), name="lonely/graph", timeout=1.0), autograph=False)
    if r == 0:
        out["timeout/eager"] = _outcome(lambda: ops.all_reduce(tf.ones([3]), name="lonely",
                                                               timeout=1.0))
        out["timeout/graph"] = _outcome(lonely_graph)
        out["timeout/barrier"] = _outcome(lambda: ops.barrier(name="lonely/barrier",
                                                              timeout=0.5))
        for key in ("timeout/eager", "timeout/graph", "timeout/barrier"):
            out[key].pop("value", None)
    ops.barrier(name="after-timeouts")
    out["recovered_after_timeouts"] = recover(200)

    # One worker asks a peer for a blob with the wrong size; the others then read the same blob
    # correctly (their requests must not be affected by that worker's failed one).
    ops.save_variable(tf.fill([4], float(r)), name="shared")
    ops.barrier(name="p2p/saved")
    peer = (r + 1) % n
    if r == 0:
        out["p2p/wrong"] = _outcome(lambda: ops.request_variable(peer, name="shared", shape=[3],
                                                                 dtype=tf.float32))
        out["p2p/wrong"].pop("value", None)
    ops.barrier(name="p2p/wrong-done")
    o = _outcome(lambda: ops.request_variable(peer, name="shared", shape=[4], dtype=tf.float32,
                                              timeout=10))
    if o["error"] is None:
        o["value"] = o["value"].numpy().tolist()
    out["p2p/right"] = o
    ops.barrier(name="errors/done")
    return out


# -- a peer dies -------------------------------------------------------------------------------

def peer_killed(victim: int):
    """All workers loop a tf.function of all_reduce; `victim` is SIGKILLed 0.5 s in.

    Survivors return what the loop raised and when (relative to the kill), and what a later op
    raises."""
    tf, ops = _tf()
    import kungfu as kf

    r, n = kf.rank(), kf.size()

    @tf.function(autograph=False)
    def step(x):
        return ops.all_reduce(x, name="doomed")

    x = tf.ones([1 << 16])
    first = step(x).numpy()
    assert np.all(first == n), first[:4]
    ops.barrier(name="start")
    t_kill = time.time() + 0.5
    if r == victim:
        threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGKILL)).start()
    steps = 0

    def loop():
        nonlocal steps
        deadline = time.monotonic() + 40
        while time.monotonic() < deadline:
            step(x)
            steps += 1
        return "no error within 40 s"

    o = _outcome(loop)
    o["after_kill"] = time.time() - t_kill
    o["steps"] = steps
    o.pop("value", None)
    if r == victim:
        return {"victim": True, "first": o}
    time.sleep(2.0)  # no survivor may learn of the failure from another survivor's exit
    later = _outcome(lambda: ops.all_reduce(tf.ones([3]), name="later"))
    later.pop("value", None)
    return {"victim": False, "first": o, "later": later, "dead": _peers()[victim]}
