"""Worker bodies for test_surface.py: alltoall, reducescatter, objects, TensorFlow avg, the
collectives' gradients and sparse allreduce, in real worker processes. Each body returns raw
values; the tests compute what they must be from the inputs below (pure numpy)."""
from __future__ import annotations

import time

import numpy as np


# -- inputs (pure numpy, shared with the tests) -------------------------------------------------

def a2a_splits(r: int, n: int) -> list:
    """Worker r's splits: uneven, some zero, different on every worker."""
    return [(r + 2 * j) % 3 for j in range(n)]


def a2a_input(r: int, n: int, dtype="float32") -> np.ndarray:
    """Worker r's rows: the rows for worker j hold 100 r + j, then the column index."""
    rows = [np.stack([np.full(c, 100 * r + j), np.arange(c)], axis=1)
            for j, c in enumerate(a2a_splits(r, n))]
    return np.concatenate(rows).astype(dtype).reshape(-1, 2)


def rs_input(r: int, rows: int = 7) -> np.ndarray:
    return (np.arange(rows * 3).reshape(rows, 3) * (r + 1) - 5 * r).astype(np.float64)


def even_parts(rows: int, n: int) -> list:
    return [rows // n + (1 if j < rows % n else 0) for j in range(n)]


def rs_int_input(r: int) -> np.ndarray:
    """int64 rows whose sums overflow: avg must still be the exact floor of the mean."""
    big = np.iinfo(np.int64)
    return np.array([[big.max - r, big.min + r], [2**62 + r, -3 - r], [7 * r, -7 * r],
                     [r, 1]], np.int64)


# -- numpy ------------------------------------------------------------------------------------

def numpy_surface() -> dict:
    import kungfu as kf
    from kungfu import errors

    r, n = kf.rank(), kf.size()
    out = {"rank": r, "size": n}
    out["alltoall"] = kf.alltoall(a2a_input(r, n), a2a_splits(r, n), name="a2a").tolist()
    out["alltoall/int8"] = kf.alltoall(a2a_input(r, n, "int8"), np.array(a2a_splits(r, n)),
                                       name="a2a8").tolist()
    even = np.arange(2 * n, dtype=np.int32).reshape(2 * n, 1) + 10 * r
    out["alltoall/even"] = kf.alltoall(even, name="a2a-even").tolist()
    out["reducescatter"] = {op: kf.reducescatter(rs_input(r), op=op, name=f"rs/{op}").tolist()
                            for op in ("sum", "avg", "min", "max", "prod")}
    out["reducescatter/int-avg"] = kf.reducescatter(rs_int_input(r), op="avg", name="rsi").tolist()
    out["reducescatter/short"] = kf.reducescatter(np.ones((1, 2), np.float32) * (r + 1),
                                                  name="rs-short").tolist()
    out["broadcast_object"] = kf.broadcast_object(
        {"from": r, "blob": b"x" * 100000} if r == n - 1 else None, root=n - 1)
    out["allgather_object"] = kf.allgather_object(("rank", r, "y" * (1000 * r)))

    # The peer-to-peer store: each worker saves a blob, reads its right neighbour's.
    from kungfu import _collective

    _collective.save("p2p/x", np.arange(6, dtype=np.float64).reshape(2, 3) * (r + 1))
    _collective.save("p2p/x", np.arange(6, dtype=np.float64).reshape(2, 3) * (r + 10))  # replaces
    kf.barrier(name="p2p/saved")
    right = (r + 1) % n
    out["p2p"] = _collective.request(right, "p2p/x", like=np.zeros((2, 3))).tolist()
    into = np.zeros((2, 3))
    _collective.request(right, "p2p/x", out=into)
    out["p2p/out"] = into.tolist()
    for case, call in {"p2p/dtype": lambda: _collective.request(right, "p2p/x",
                                                                like=np.zeros((2, 3), np.float32)),
                       "p2p/size": lambda: _collective.request(right, "p2p/x",
                                                               like=np.zeros(5)),
                       "p2p/missing": lambda: _collective.request(right, "p2p/none",
                                                                  like=np.zeros(1))}.items():
        try:
            call()
            out[case] = None
        except errors.KungFuError as e:
            out[case] = f"{type(e).__name__}: {e}"
    kf.barrier(name="p2p/read")
    _collective.drop("p2p/x")
    kf.barrier(name="p2p/dropped")
    try:
        _collective.request(right, "p2p/x", like=np.zeros((2, 3)))
        out["p2p/dropped"] = None
    except errors.NotFoundError as e:
        out["p2p/dropped"] = str(e)

    # Disagreements and bad input: every rank fails, and the next op still pairs.
    cases = {
        # rows of other shapes beyond axis 0
        "alltoall-shape": lambda: kf.alltoall(np.ones((n, 2 if r == 0 else 3), np.float32),
                                              name="mm/a2a"),
        # splits that do not add up on one rank only
        "alltoall-splits": lambda: kf.alltoall(np.ones((n, 2), np.float32),
                                               [n + 1] + [0] * (n - 1) if r == 0 else None,
                                               name="mm/a2a-splits"),
        "reducescatter-shape": lambda: kf.reducescatter(
            np.ones((3, 2) if r == 0 else (2, 3), np.float32), name="mm/rs"),
        "reducescatter-op": lambda: kf.reducescatter(np.ones((3, 2)), op="avg" if r else "sum",
                                                     name="mm/rs-op"),
        "reducescatter-scalar": lambda: kf.reducescatter(np.float32(1.0) if r == 0
                                                         else np.ones(1, np.float32),
                                                         name="mm/rs-scalar"),
    }
    for case, call in cases.items():
        start = time.time()
        try:
            call()
            err = None
        except errors.InvalidArgumentError as e:
            err = str(e)
        out[case] = {"error": err, "seconds": time.time() - start,
                     "after": kf.allreduce(np.ones(1), name=f"after/{case}").tolist()}
    return out


# -- TensorFlow -------------------------------------------------------------------------------

def tf_surface() -> dict:
    import tensorflow as tf

    import kungfu as kf
    from kungfu.tensorflow import ops

    r, n = kf.rank(), kf.size()
    out = {"rank": r, "size": n}
    graph = lambda f: tf.function(f, autograph=False)  # noqa: E731

    x = tf.constant(a2a_input(r, n))
    out["all_to_all"] = ops.all_to_all(x, a2a_splits(r, n), name="a2a").numpy().tolist()
    out["all_to_all/graph"] = graph(lambda: ops.all_to_all(x, tf.constant(a2a_splits(r, n)),
                                                           name="a2a-g"))().numpy().tolist()
    out["reduce_scatter"] = {
        op: ops.reduce_scatter(tf.constant(rs_input(r)), op=op, name=f"rs/{op}").numpy().tolist()
        for op in ("sum", "avg", "min", "max", "prod")}
    out["reduce_scatter/int-avg"] = ops.reduce_scatter(
        tf.constant(rs_int_input(r)), op="avg", name="rsi").numpy().tolist()
    out["all_reduce/avg"] = {
        "float32": ops.all_reduce(tf.constant([2.0, -4.0]) * (r + 1), op="avg",
                                  name="avg/f").numpy().tolist(),
        "int8": ops.all_reduce(tf.constant([100, 127, -128, r], tf.int8), op="avg",
                               name="avg/i8").numpy().tolist(),
        "group": [t.numpy().tolist() for t in ops.group_all_reduce(
            [tf.constant([1.0 * r]), tf.constant([2**62 + r], tf.int64)], op="avg",
            name="avg/group")],
    }
    try:
        ops.all_reduce(tf.ones([2]), op="avg" if r else "sum", name="mm/avg")
        out["avg-vs-sum"] = None
    except tf.errors.InvalidArgumentError as e:
        out["avg-vs-sum"] = e.message

    # Gradients: a loss through each collective, v_r = [0, 1, 2, 3] + r.
    v = tf.Variable(np.arange(4, dtype=np.float32) + r)
    a2a_splits_v = [4 - (n - 1)] + [1] * (n - 1)

    def losses():
        return {
            "all_reduce": tf.reduce_sum(ops.all_reduce(v * v, name="g/ar")),
            "all_reduce/avg": tf.reduce_sum(ops.all_reduce(v * v, op="avg", name="g/avg")),
            "group_all_reduce": tf.add_n([tf.reduce_sum(t) for t in ops.group_all_reduce(
                [v * 2.0, v * v], name="g/group")]),
            "broadcast": tf.reduce_sum(ops.broadcast(v * 2.0, root=n - 1, name="g/bc")),
            "all_gather": tf.reduce_sum(
                tf.square(ops.all_gather(tf.reshape(v, [2, 2]) * (r + 1), name="g/ag"))),
            "all_to_all": tf.reduce_sum(tf.square(
                ops.all_to_all(tf.reshape(v, [4, 1]), a2a_splits_v, name="g/a2a"))),
            "reduce_scatter": tf.reduce_sum(
                ops.reduce_scatter(tf.reshape(v, [4, 1]) * 3.0, name="g/rs")),
            "reduce_scatter/avg": tf.reduce_sum(
                ops.reduce_scatter(tf.reshape(v, [4, 1]) * 3.0, op="avg", name="g/rs-avg")),
        }

    with tf.GradientTape(persistent=True) as tape:
        eager = losses()
    out["grad/eager"] = {k: tape.gradient(loss, v).numpy().tolist() for k, loss in eager.items()}

    @graph
    def in_function():
        with tf.GradientTape() as t:
            total = tf.add_n(list(losses().values()))
        return t.gradient(total, v)

    out["grad/function"] = in_function().numpy().tolist()
    # A model that calls a collective in its forward pass trains (Keras).
    out["keras"] = _keras_model_with_a_collective(r)

    sparse = tf.IndexedSlices(tf.constant([[1.0 * r, 1.0], [2.0, 2.0 * r]]),
                              tf.constant([r, n]), dense_shape=tf.constant([n + 1, 2]))
    out["sparse/sum"] = tf.convert_to_tensor(ops.all_reduce(sparse, name="sp")).numpy().tolist()
    out["sparse/avg"] = tf.convert_to_tensor(
        ops.all_reduce(sparse, op="avg", name="sp-avg")).numpy().tolist()
    return out


def _keras_model_with_a_collective(r: int) -> list:
    """A layer that averages its activations over the workers, trained two steps with plain SGD
    on this worker's data: the gradients flow through the collective."""
    import keras
    import tensorflow as tf

    from kungfu.tensorflow import ops

    class WorkerMean(keras.layers.Layer):
        def call(self, x):
            return ops.all_reduce(x, op="avg", name="model/mean")

    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2), WorkerMean(),
                              keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", jit_compile=False)
    x = np.full((4, 3), float(r + 1), np.float32)
    y = np.full((4, 1), float(r), np.float32)
    before = model.get_weights()[0].copy()
    model.fit(x, y, batch_size=4, epochs=2, verbose=0, shuffle=False)
    return np.abs(model.get_weights()[0] - before).sum().tolist()
