"""Worker bodies for test_kungfu_names.py: KungFu's own surface (TF adaptation ops, versioned
save/request, the re-exported names, kungfu.tensorflow.policy, MULTI_STAR)."""
import numpy as np

import kungfu as kf


def error_of(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test compares the kind and the message
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        # A tf.function's error: the whole text (TensorFlow puts its own lines first).
        traced = lines[0] in ("in user code:", "Graph execution error:")
        return [type(e).__name__, " | ".join(lines) if traced else lines[0]]
    return None


def tf_kungfu_ops():
    import tensorflow as tf

    import kungfu.tensorflow as kft  # noqa: F401 - loads the op library
    from kungfu.policy import current_strategy, strategy_stats
    from kungfu.tensorflow import ops

    r, n = kf.rank(), kf.size()
    out = {}

    # set_tree as KungFu's examples call it: every worker installs rank 0's tree.
    mine = [0] * n if r == 0 else [-1] * n  # only rank 0's reaches the others
    tree = ops.broadcast(tf.constant(mine if r == 0 else [0] * n, tf.int32), name="tree")
    out["set_tree"] = bool(ops.set_tree(tree).numpy())
    out["strategy"] = current_strategy()
    out["after_tree"] = ops.all_reduce(tf.constant([r + 1.0, 2.0 * r]), name="after").numpy().tolist()

    # A tree that differs on one worker fails on every worker, and changes nothing.
    bad = list(range(n)) if r == n - 1 else [0] * n  # a forest on the last rank only
    out["bad_tree"] = error_of(lambda: ops.set_tree(tf.constant(bad, tf.int32)))
    out["strategy_after_bad"] = current_strategy()

    @tf.function
    def traced():
        return ops.set_tree(tf.constant([0] * n, tf.int32))

    out["traced_set_tree"] = error_of(traced)

    # monitored_all_reduce: all_reduce, counted per strategy.
    kf.set_strategy("STAR")
    before = strategy_stats().get("STAR", {}).get("ops", 0)
    x = tf.constant(np.arange(6, dtype=np.float32) * (r + 1))
    out["monitored"] = ops.monitored_all_reduce(x, name="monitored").numpy().tolist()
    out["monitored_ops"] = strategy_stats()["STAR"]["ops"] - before
    out["monitored_tree"] = error_of(lambda: ops.monitored_all_reduce(x, tree=[0] * n,
                                                                      name="mt"))

    # resize outside kungfu-run -w: refused on every worker, nothing changes.
    out["resize"] = error_of(lambda: ops.resize(n + 1))
    out["resize_from_url"] = [bool(v.numpy()) for v in ops.resize_cluster_from_url()]
    out["size_after"] = kf.size()

    # Versioned blobs: versions 0..4 saved, the last 3 kept.
    for v in range(5):
        ops.save_variable(tf.constant([100.0 * r + v, float(v)]), version=v, name="w")
    ops.save_variable(tf.constant([-1.0, -1.0]), name="w")  # unversioned: a blob of its own
    kf.barrier()
    target = (r + 1) % n
    got = {}
    for v in range(5):
        got[v] = error_of(lambda v=v: ops.request_variable(target, version=v, name="w",
                                                           shape=[2], dtype=tf.float32))
        if got[v] is None:
            got[v] = ops.request_variable(target, version=v, name="w", shape=[2],
                                          dtype=tf.float32).numpy().tolist()
    out["versions"] = got
    out["unversioned"] = ops.request_variable(target, name="w", shape=[2],
                                              dtype=tf.float32).numpy().tolist()
    out["template"] = ops.request_variable_with_template(
        target, tf.zeros([2]), version=4, name="w").numpy().tolist()

    # In a tf.function, with the version a tensor (a step counter).
    @tf.function
    def step(v):
        ops.save_variable(tf.cast(tf.fill([3], v), tf.float32) + 10.0 * r, version=v, name="f")
        return v

    for v in range(4):
        step(tf.constant(v, tf.int64))
    kf.barrier()

    @tf.function
    def fetch(v):
        return ops.request_variable(target, version=v, name="f", shape=[3], dtype=tf.float32)

    out["traced_versions"] = [fetch(tf.constant(v, tf.int64)).numpy().tolist() for v in (1, 3)]
    out["traced_dropped"] = error_of(lambda: fetch(tf.constant(0, tf.int64)))
    out["negative"] = error_of(lambda: ops.save_variable(tf.constant([1.0]), version=-1,
                                                         name="neg"))
    kf.barrier()  # nobody exits while another may still request its blobs

    # KungFu's names that kungfu does not have: importable, and say what to use instead.
    from kungfu.tensorflow.ops import calc_stats, group_nccl_all_reduce, subset_all_reduce

    out["missing"] = [error_of(f) for f in (calc_stats, group_nccl_all_reduce,
                                            lambda: subset_all_reduce(x, [0] * n))]

    # kungfu.tensorflow.policy
    from kungfu.tensorflow.policy import BasePolicy, PolicyHook

    class After(BasePolicy):
        def after_step(self):
            pass

    hook = PolicyHook([After()], epoch_size=100, epoch_num=2, init_batch_size=32)
    out["policy"] = [BasePolicy is kf.BasePolicy, isinstance(hook, kf.Hook),
                     len(hook.policies), error_of(lambda: PolicyHook(After()))]
    return out


def multi_star(counts):
    """allreduce, reduce and broadcast under MULTI_STAR, checked against numpy here."""

    r, n = kf.rank(), kf.size()
    kf.set_strategy("MULTI_STAR")
    from kungfu.policy import current_strategy, strategy_stats

    out = {"strategy": current_strategy()}
    for count in counts:
        x = (np.arange(count, dtype=np.float32) % 97) * (r + 1)
        want = (np.arange(count, dtype=np.float32) % 97) * sum(range(1, n + 1))
        got = kf.allreduce(x, name=f"ms/{count}")
        out[f"allreduce/{count}"] = bool(np.array_equal(got, want))
        ints = np.arange(count, dtype=np.int64) + 1000 * r
        got = kf.allreduce(ints, op="max", name=f"ms/max/{count}")
        out[f"max/{count}"] = bool(np.array_equal(got, np.arange(count) + 1000 * (n - 1)))
        b = kf.broadcast(x, root=n - 1, name=f"ms/bcast/{count}")
        out[f"broadcast/{count}"] = bool(np.array_equal(b, (np.arange(count, dtype=np.float32)
                                                            % 97) * n))
    red = kf.reduce(np.full(5, r + 1, np.int32), root=0, name="ms/reduce")
    out["reduce"] = red.tolist() if r == 0 else None
    out["stats"] = sorted(strategy_stats())
    return out
