"""KungFu's own surface with real workers at np 2 and 3: the set_tree, resize and
monitored_all_reduce TF ops, versioned save_variable/request_variable, the names KungFu's
examples import from kungfu.tensorflow.ops, kungfu.tensorflow.policy, and MULTI_STAR (values
checked against numpy, across two loopback "hosts" so that it has two graphs)."""
import pytest

import _w_kungfu_names as W
from kungfu._ports import free_port_range

pytestmark = pytest.mark.timeout(240)
NPS = [2, 3]
TF_ENV = {"TF_CPP_MIN_LOG_LEVEL": "2", "KUNGFU_OP_TIMEOUT": "30s"}


@pytest.mark.parametrize("n", NPS)
def test_tf_kungfu_ops(spawn, n):
    outs = spawn(n, W.tf_kungfu_ops, env=TF_ENV, timeout=200)
    for r, o in enumerate(outs):
        target = (r + 1) % n
        # set_tree(broadcast(tree)): rank 0's star everywhere; the sum is right under it.
        assert o["set_tree"] is True
        assert o["strategy"] == {"tree": [0] * n}
        assert o["after_tree"] == [sum(k + 1.0 for k in range(n)), sum(2.0 * k for k in range(n))]
        # A tree that differs on one worker: ValueError on every worker, the old tree stays.
        assert o["bad_tree"][0] == "InvalidArgumentError", o["bad_tree"]  # a ValueError
        assert "different strategies or trees" in o["bad_tree"][1]
        assert o["strategy_after_bad"] == {"tree": [0] * n}
        assert o["traced_set_tree"][0] == "RuntimeError"
        assert "outside tf.function" in o["traced_set_tree"][1]
        # monitored_all_reduce: the sum, and one more STAR operation counted.
        assert o["monitored"] == [float(i * sum(range(1, n + 1))) for i in range(6)]
        assert o["monitored_ops"] >= 1
        assert o["monitored_tree"][0] == "NotImplementedError"
        assert "set_tree" in o["monitored_tree"][1]
        # resize outside kungfu-run -w: refused, saying so; nothing waits for the config store.
        assert o["resize"] == ["ResizeError", "kf.resize needs an elastic job: start it with "
                               "kungfu-run -w"]
        assert o["resize_from_url"] == [False, False] and o["size_after"] == n
        # Versions 0..4 saved, 2..4 kept (the window of 3), each its own value.
        for v in range(2):
            kind, message = o["versions"][str(v)] if str(v) in o["versions"] else o["versions"][v]
            assert kind == "NotFoundError" and f"w@v{v}" in message, (v, message)
        for v in range(2, 5):
            got = o["versions"][v]
            assert got == [100.0 * target + v, float(v)], (v, got)
        assert o["unversioned"] == [-1.0, -1.0]
        assert o["template"] == [100.0 * target + 4, 4.0]
        assert o["traced_versions"] == [[1.0 + 10 * target] * 3, [3.0 + 10 * target] * 3]
        assert o["traced_dropped"][0] == "NotFoundError" and "f@v0" in o["traced_dropped"][1]
        assert o["negative"] == ["ValueError", "save_variable: version must be an integer >= 0, "
                                               "got -1"]
        # Names KungFu has and kungfu not: NotImplementedError naming the alternative.
        stats, nccl, subset = o["missing"]
        assert stats[0] == "NotImplementedError" and "strategy_stats" in stats[1]
        assert nccl[0] == "NotImplementedError" and "group_all_reduce" in nccl[1]
        assert subset[0] == "NotImplementedError" and "process set" in subset[1]
        assert o["policy"] == [True, True, 1, ["TypeError", "PolicyHook takes a list of "
                                               "policies, got After"]]


def two_hosts(n):
    """rank_env for n workers on two loopback hosts: ranks 0..n-2 on 127.0.0.1, the last on
    127.0.0.2 (MULTI_STAR then has one graph per host)."""
    first = int(free_port_range(n, hosts=("127.0.0.1", "127.0.0.2")).split("-")[0])
    peers = [f"127.0.0.1:{first + i}" for i in range(n - 1)] + [f"127.0.0.2:{first}"]
    return lambda r: {"KUNGFU_SELF_SPEC": peers[r], "KUNGFU_INIT_PEERS": ",".join(peers)}


@pytest.mark.parametrize("n", NPS)
def test_multi_star_values(spawn, n):
    # 1, 7 and 3 M elements: one chunk, and many chunks spread over both graphs.
    counts = [1, 7, 3 << 20]
    outs = spawn(n, W.multi_star, counts, rank_env=two_hosts(n),
                 env={"KUNGFU_OP_TIMEOUT": "30s"}, timeout=120)
    for r, o in enumerate(outs):
        assert o["strategy"] == {"name": "MULTI_STAR"}
        for c in counts:
            assert o[f"allreduce/{c}"] and o[f"max/{c}"] and o[f"broadcast/{c}"], (r, c, o)
        assert "MULTI_STAR" in o["stats"]
    assert outs[0]["reduce"] == [sum(range(1, n + 1))] * 5
