"""kungfu's TensorFlow ops in real worker processes, eagerly and inside tf.function.

Each spawn imports TensorFlow once per worker and runs a whole batch of checks (see
_w_tf_ops.py); the tests below judge the raw results against numpy.
"""
import importlib.util

import numpy as np
import pytest

import _w_tf_ops as W

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.skipif(importlib.util.find_spec("tensorflow") is None,
                       reason="TensorFlow is not installed"),
]

TF_ENV = {"TF_CPP_MIN_LOG_LEVEL": "3"}
CRASH_MARKERS = ("Fatal Python error", "terminate called", "Segmentation fault", "Aborted",
                 "core dumped", "AddressSanitizer")
NPS = [1, 2, 3]


@pytest.fixture(scope="module")
def values(session_spawn):
    """values(n): every rank's result of W.values() on n workers (one spawn per n)."""
    cache = {}

    def get(n):
        if n not in cache:
            cache[n] = session_spawn.run(n, W.values, env=TF_ENV, timeout=150, fail_fast=True)
        return cache[n].check()

    return get


def expected_reduce(dtype, op, n):
    xs = np.stack([W.reduce_input(dtype, op, r) for r in range(n)])
    if dtype == "bool":
        return xs.all(axis=0) if op == "min" else xs.any(axis=0)
    return {"sum": xs.sum, "min": xs.min, "max": xs.max, "prod": xs.prod}[op](axis=0)


def same(packed, dtype, shape, want):
    """'' if the packed tensor has this dtype, shape and values, else what differs."""
    got_dtype, got_shape, got = packed
    want = np.asarray(want)
    if got_dtype != dtype:
        return f"dtype {got_dtype}, want {dtype}"
    if tuple(got_shape) != tuple(shape):
        return f"shape {got_shape}, want {tuple(shape)}"
    if not np.array_equal(got, want):
        return f"values {got.tolist()}, want {want.tolist()}"
    return ""


def error_text(o):
    return f"{o.get('error')}: {o.get('message', '')}"


# -- all_reduce --------------------------------------------------------------------------------

@pytest.mark.parametrize("n", NPS)
@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_all_reduce_every_dtype_and_op(values, n, mode):
    results = values(n)
    cases = [(dt, op) for dt in W.REDUCE_DTYPES for op in W.REDUCE_OPS]
    cases += [("bool", "min"), ("bool", "max")]
    problems = []
    for res in results:
        got = res[f"all_reduce/{mode}"]
        assert sorted(got) == sorted(cases)
        for dt, op in cases:
            d = same(got[(dt, op)], dt, W.SHAPE, expected_reduce(dt, op, n))
            if d:
                problems.append(f"rank {res['rank']} {dt} {op}: {d}")
    assert not problems, "\n".join(problems)


def test_all_reduce_inputs_are_meaningful():
    """The inputs differ per rank and make min, max, sum and prod differ at np 3."""
    for dt in W.REDUCE_DTYPES:
        results = {op: expected_reduce(dt, op, 3) for op in W.REDUCE_OPS}
        assert not np.array_equal(results["min"], results["max"]), dt
        assert not np.array_equal(results["sum"], results["prod"]), dt
    assert expected_reduce("bool", "min", 3).tolist() == [[False] * 4, [False] * 3 + [True]]
    assert expected_reduce("bool", "max", 3).sum() == 7


@pytest.mark.parametrize("n", [2, 3])
def test_graph_default_names_match_across_workers(values, n):
    results = values(n)
    names = results[0]["all_reduce/graph_names"]
    assert len(set(names)) == len(W.REDUCE_DTYPES) * len(W.REDUCE_OPS) + 2
    assert all(name.startswith("all_reduce:") for name in names), names[:3]
    for res in results[1:]:
        assert res["all_reduce/graph_names"] == names


@pytest.mark.parametrize("n", NPS)
def test_tf_function_over_several_steps(values, n):
    for res in values(n):
        r = res["rank"]
        assert res["steps_traces"] == 1, "the step function was traced more than once"
        assert len(res["steps"]) == 5
        for k, (s, m, mn) in enumerate(res["steps"]):
            xs = np.array([[q + 10 * k, -q, k * q] for q in range(n)], np.float64)
            where = f"rank {r} step {k}"
            assert not same(s, "float32", (3,), xs.sum(axis=0)), (where, s)
            assert not same(m, "float32", (3,), xs.max(axis=0)), (where, m)
            assert not same(mn, "int64", (3,), xs.min(axis=0)), (where, mn)
        total = n * (n + 1) / 2
        assert res["variable_steps"] == [total, total * n, total * n * n], r


# -- group_all_reduce --------------------------------------------------------------------------

def check_group(results, key, n, op="sum"):
    problems = []
    for res in results:
        got = res[key]
        specs = W.group_inputs(0)
        assert len(got) == len(specs), f"rank {res['rank']}: {len(got)} results"
        for i, (dt, shape, _) in enumerate(specs):
            xs = np.stack([W.group_inputs(r)[i][2] for r in range(n)])
            want = xs.sum(axis=0) if op == "sum" else xs.max(axis=0)
            d = same(got[i], dt, shape, want)
            if d:
                problems.append(f"rank {res['rank']} tensor {i}: {d}")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("n", NPS)
def test_group_all_reduce_eager(values, n):
    results = values(n)
    check_group(results, "group/eager", n)  # several buckets (bucket_bytes=32)
    check_group(results, "group/eager_max", n, op="max")  # one bucket per dtype


@pytest.mark.parametrize("n", NPS)
def test_group_all_reduce_in_tf_function(values, n):
    results = []
    for res in values(n):
        o = res["group/graph"]
        assert o["error"] is None, f"rank {res['rank']}: {error_text(o)}"
        assert res["group/graph_buckets"] == sorted(W.GROUP_BUCKET_NAMES)
        results.append({"rank": res["rank"], "group/graph": o["value"]})
    check_group(results, "group/graph", n)


@pytest.mark.parametrize("n", NPS)
def test_collectives_in_tf_function_need_no_program_order(values, n):
    for res in values(n):
        r = res["rank"]
        assert res["crossed/chained"] == [], res["crossed/chained"]
        o = res["crossed"]
        assert o["error"] is None, f"rank {r}: {error_text(o)}"
        assert o["seconds"] < 10, o
        total = sum(range(n))
        want = [[float(10 * i * n + total)] * 3 for i in range(4)]
        want += [[float(n - 1)] * 2, [float(q) for q in range(n)]]
        assert o["value"] == want, (r, o["value"])


@pytest.mark.parametrize("n", NPS)
def test_ordering_same_name_ops_keeps_no_graph_alive(values, n):
    for res in values(n):
        assert res["twice"] == [2.0 * n] * 2, res["twice"]
        assert res["twice/graph_freed"], f"rank {res['rank']}: the traced graph is still alive"


@pytest.mark.parametrize("n", NPS)
def test_collectives_in_a_loop_pair_iterations_in_order(values, n):
    want = float(sum((10 * i * n + sum(range(n))) * (i + 1) for i in range(6)))
    for res in values(n):
        o = res["looped"]
        assert o["error"] is None, f"rank {res['rank']}: {error_text(o)}"
        assert o["value"] == [[want]] * 10, (res["rank"], o["value"])


@pytest.mark.parametrize("n", NPS)
def test_group_all_reduce_default_is_one_op_per_dtype_without_copies(values, n):
    results = values(n)
    for res in results:
        # One list op per dtype, named by the dtype's first tensor; no concat or split.
        assert res["group/default_ops"] == sorted(
            ("KungfuGroupAllReduce", name) for name in
            ("gd/float32/0", "gd/int32/2", "gd/float64/4", "gd/int64/9")), res["group/default_ops"]
        assert res["group/default_copies"] == [], res["group/default_copies"]
    check_group(results, "group/default", n)


# -- broadcast, all_gather ---------------------------------------------------------------------

@pytest.mark.parametrize("n", NPS)
def test_broadcast_from_each_root(values, n):
    problems = []
    for res in values(n):
        bc = res["broadcast"]
        assert len(bc) == 5 * n
        for (mode, root, dt), packed in bc.items():
            want = W.broadcast_input(root)
            if dt == "uint8":
                want = want % 256
            d = same(packed, dt, (2, 3), want)
            if d:
                problems.append(f"rank {res['rank']} {mode} root {root} {dt}: {d}")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("n", NPS)
def test_all_gather_rank_order_and_ragged_rows(values, n):
    want = np.concatenate([W.gather_input(r) for r in range(n)])
    want_ragged = np.concatenate([W.gather_input_ragged(r) for r in range(n)])
    rows = sum(r + 1 for r in range(n))
    for res in values(n):
        where = f"rank {res['rank']}"
        assert not same(res["all_gather/eager"], "float32", (rows, 3), want), where
        assert not same(res["all_gather/eager_ragged"], "int8", want_ragged.shape,
                        want_ragged), where
        a, b, c = res["all_gather/graph"]
        assert not same(a, "float32", (rows, 3), want), where
        assert not same(b, "int16", want_ragged.shape, want_ragged), where
        assert not same(c, "float64", (rows, 2, 3), np.zeros((rows, 2, 3))), where
        # Shape inference: axis 0 unknown (it depends on the other workers), the rest kept.
        assert res["all_gather/static"] == {"a": [None, 3], "b": [None, 2], "c": [None, 2, 3]}


# -- barrier, consensus, peer_info, counter ----------------------------------------------------

@pytest.mark.parametrize("n", [2, 3])
def test_barrier_waits_for_the_last_worker(values, n):
    results = values(n)
    # Rank r arrives 0.3 r s late; nobody may leave before the last one arrived.
    for key in ("eager", "graph0", "graph1"):
        if key == "eager":
            times = [res["barrier/eager"] for res in results]
        else:
            times = [res["barrier/graph"][int(key[-1])] for res in results]
        last_arrival = max(arrived for arrived, _ in times)
        for r, (arrived, left) in enumerate(times):
            assert left >= last_arrival - 0.01, (key, r, times)


@pytest.mark.parametrize("n", NPS)
def test_consensus(values, n):
    for res in values(n):
        where = f"rank {res['rank']}"
        assert res["consensus/eager"] == {"same": True, "differ": n == 1, "length": n == 1,
                                          "same_again": True}, where
        assert res["consensus/graph"] == [True, n == 1, n == 1], where


@pytest.mark.parametrize("n", NPS)
def test_peer_info_rank_cluster_size_counter(values, n):
    for r, res in enumerate(values(n)):
        assert (res["rank"], res["size"]) == (r, n)
        assert res["peer_info/eager"] == ("int32", r, "int32", n, r, n)
        assert res["peer_info/graph"] == (r, n, r, n)
        assert res["counter"] == [(0, 5), (1, 8), (2, 11), (3, 14)]


def test_fuse_defuse_round_trip(values):
    res = values(1)[0]
    parts = res["fuse/parts"]
    flat = np.concatenate([p.reshape(-1) for p in parts])
    for mode in ("fuse/eager", "fuse/graph"):
        fused, back = res[mode]
        assert not same(fused, "float32", (flat.size,), flat), (mode, fused)
        assert len(back) == len(parts)
        for p, b in zip(parts, back):
            assert not same(b, "float32", p.shape, p), (mode, b, p)


# -- save_variable / request_variable ----------------------------------------------------------

@pytest.mark.parametrize("n", NPS)
def test_save_and_request_variable(values, n):
    for res in values(n):
        r = res["rank"]
        peer = (r + 1) % n
        p2p = res["p2p"]
        where = f"rank {r}"
        assert not same(p2p["peer/1"], "float32", (2, 3), np.full((2, 3), 10 * peer + 1)), where
        assert not same(p2p["self/1"], "float32", (2, 3), np.full((2, 3), 10 * r + 1)), where
        # A new save replaces the blob.
        assert not same(p2p["peer/2"], "float32", (2, 3), np.full((2, 3), 10 * peer + 2)), where
        assert not same(p2p["int64"], "int64", (3,), [peer, -peer, 7 * peer]), where
        for key in ("missing/peer", "missing/self"):
            o = p2p[key]
            assert o["error"] == "NotFoundError", (where, key, o)
            assert "no-such-blob" in o["message"], (where, key, o)
        for key, wants in (("size/peer", "5 x float32"), ("size/self", "4 x float32")):
            o = p2p[key]
            assert o["error"] == "InvalidArgumentError", (where, key, o)
            assert "6 x float32" in o["message"] and wants in o["message"], (where, key, o)
        for key in ("dtype/peer", "dtype/self"):  # before: float32 bits read as int32
            o = p2p[key]
            assert o["error"] == "InvalidArgumentError", (where, key, o)
            assert "float32" in o["message"] and "int32" in o["message"], (where, key, o)
        # Errors leave the store usable.
        assert not same(p2p["after_errors"], "float32", (2, 3),
                        np.full((2, 3), 10 * peer + 2)), where
        # KungFu's argument order means the same; a version is refused by name.
        assert not same(p2p["kungfu_order"], "float32", (2, 3),
                        np.full((2, 3), 10 * peer + 2)), where
        # A version never saved (versioned blobs: test_kungfu_names.py).
        assert p2p["version"]["error"] == "NotFoundError", (where, p2p["version"])
        assert "w@v3" in p2p["version"]["message"], (where, p2p["version"])
        # Lent, not copied, yet unchanged by later updates of the variable.
        assert not same(p2p["lent/self"], "float32", (1000,), np.full(1000, 5.0 + r)), where
        assert not same(p2p["lent/peer"], "float32", (1000,), np.full(1000, 5.0 + peer)), where
        assert not same(p2p["lent/variable"], "float32", (1000,), np.full(1000, -3.0)), where
        # In a tf.function, over several steps, with default names from the variable.
        for k, got in enumerate(p2p["graph"]):
            assert not same(got, "float32", (2, 3), np.full((2, 3), 100 * k + peer)), (where, k)


@pytest.mark.parametrize("n", NPS)
def test_broadcast_variables_in_a_graph_session(values, n):
    for res in values(n):
        assert res["tf1/first"] == [[float(n)] * 3, [10.0 * n] * 2], res["tf1/first"]
        assert res["tf1/second"] == [-1.0, -1.0], res["tf1/second"]
        o = res["tf1/keras"]  # Keras 3 cannot assign its variables there: said, not ignored
        assert o["error"] == "TypeError" and "keras.Variable" in o["message"], o


# -- eager mode needs names --------------------------------------------------------------------

def test_eager_ops_without_name_raise_value_error(values):
    res = values(1)[0]
    for op, o in res["noname"].items():
        assert o["error"] == "ValueError", (op, o)
        assert "name=" in o["message"], (op, o)
        # The message says which call needs it (save_variable speaks of its "blob").
        assert op in o["message"] or (op == "save_variable" and "blob" in o["message"]), (op, o)
        if op != "request_variable":  # which needs a name (or like=) in graph mode too
            assert "eager" in o["message"], (op, o)
    assert res["bad_op"]["error"] == "ValueError", res["bad_op"]
    assert "mean" in res["bad_op"]["message"], res["bad_op"]


# -- errors become TensorFlow errors -----------------------------------------------------------

def assert_clean_exit(outcome):
    assert outcome.returncode == 0, outcome.describe()
    for marker in CRASH_MARKERS:
        assert marker not in outcome.stderr, outcome.describe()


@pytest.fixture(scope="module")
def errors_run(session_spawn):
    # A hang would end at the 15 s op deadline and show up below as DeadlineExceededError.
    return session_spawn.run(3, W.errors, env=dict(TF_ENV, KUNGFU_OP_TIMEOUT="15s"),
                             timeout=150)


def test_mismatched_workers_raise_invalid_argument_everywhere(errors_run):
    for o in errors_run.outcomes:
        assert_clean_exit(o)
    results = errors_run.check()
    problems = []
    for res in results:
        for c in res["mismatch"] + res["local"]:
            where = f"rank {res['rank']} {c['case']}"
            if c["error"] != "InvalidArgumentError":
                problems.append(f"{where}: {error_text(c)}")
            elif c["seconds"] > 10:
                problems.append(f"{where}: took {c['seconds']:.1f} s")
            if not c["recovered"]:
                problems.append(f"{where}: the next all_reduce failed")
    assert not problems, "\n".join(problems)
    for res in results:
        for c in res["mismatch"]:
            if c["case"].endswith("-shape") or c["case"].startswith("all_gather-"):
                assert "shape" in c["message"], c
        bool_sum = res["local"][0]
        assert "bool" in bool_sum["message"], bool_sum


def test_per_op_timeout_raises_deadline_exceeded(errors_run):
    results = errors_run.check()
    res = results[0]
    for key, lo, hi in (("timeout/eager", 0.9, 5.0), ("timeout/graph", 0.9, 5.0),
                        ("timeout/barrier", 0.4, 5.0)):
        o = res[key]
        assert o["error"] == "DeadlineExceededError", (key, o)
        assert lo <= o["seconds"] <= hi, (key, o)
    assert all(r["recovered_after_timeouts"] for r in results)


def test_failed_request_does_not_disturb_other_workers(errors_run):
    results = errors_run.check()
    wrong = results[0]["p2p/wrong"]
    assert wrong["error"] == "InvalidArgumentError", wrong
    n = len(results)
    problems = []
    for res in results:
        r = res["rank"]
        o = res["p2p/right"]
        if o["error"] is not None or o["value"] != [float((r + 1) % n)] * 4:
            problems.append(f"rank {r}: {o}")
    assert not problems, "\n".join(problems)


def test_killed_peer_fails_survivors_with_unavailable(spawn):
    victim = 1
    run = spawn.run(3, W.peer_killed, victim, env=TF_ENV, timeout=90)
    assert not run.timed_out, run.check()
    v = run.outcomes[victim]
    assert v.returncode == -9, v.describe()
    dead = run.peers[victim]
    for o in run.outcomes:
        if o.rank == victim:
            continue
        assert_clean_exit(o)
        assert o.status == "ok", o.describe()
        first, later = o.value["first"], o.value["later"]
        where = f"rank {o.rank}: {first}"
        assert first["error"] == "UnavailableError", where
        assert dead in first["message"], f"message does not name {dead}: {where}"
        assert first["steps"] > 0, where
        assert first["after_kill"] < 10.0, where
        assert later["error"] == "UnavailableError", f"rank {o.rank} later: {later}"
        assert later["seconds"] < 5.0, f"rank {o.rank} later: {later}"
        assert dead in later["message"], f"rank {o.rank} later: {later}"
