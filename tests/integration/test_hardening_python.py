"""The Python edge keeps the runtime's promises: buffers owned by their operation, bad input on
one rank failing every rank with numbering intact, shapes kept, NaN propagated."""
import numpy as np
import pytest

import _w_hardening_python as W

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("n,rounds,wait_timeout", [(16384, 300, None), (1_000_000, 40, None),
                                                   (16384, 200, 0.0001), (1_000_000, 30, 0.0001)])
def test_dropped_handles_never_write_into_freed_memory(spawn, n, rounds, wait_timeout):
    # The probe: SIGABRT, SIGSEGV, or fresh zero arrays filled with 2.0 and exit 0.
    for r in spawn(2, W.dropped_handles, n, rounds, wait_timeout, timeout=90):
        assert r["dirty"] == 0
        assert r["final"] == [3.0] * 4


# The reason each rank gives, the rejecting one and the other (which names rank 1).
REASONS = {"op": "unknown reduce op", "dtype": "not supported", "out": "out has shape",
           "avg-bool": "not defined for bool", "timeout": "timeout must be",
           "reduce-root": "root must be an int", "broadcast-out": "writeable",
           "allgather-type": "expected a numpy array", "gather-root": "root must be an int",
           "consensus-type": "expected a numpy array"}


@pytest.mark.parametrize("bad", sorted(REASONS))
def test_bad_input_on_one_rank_fails_every_rank_and_keeps_numbering(spawn, bad):
    r0, r1 = spawn(2, W.bad_input_on_one_rank, bad, env={"KUNGFU_OP_TIMEOUT": "30s"})
    assert r1["error"] is not None and REASONS[bad] in r1["error"], r1
    assert r0["error"] is not None and "rank 1" in r0["error"], r0
    assert REASONS[bad] in r0["error"], r0
    assert r0["seconds"] < 5, r0  # at once, not after the 30 s deadline
    # The next two allreduces of 'x' pair with each other: 10+10 and 100+100 ([11, 11] before).
    for r in (r0, r1):
        assert r["after"] == [[20.0, 20.0], [200.0, 200.0]]


def test_input_that_concerns_one_worker_is_rejected_there(spawn):
    [r] = spawn(1, W.rejected_here)
    assert "name must be a str" in r["name"]
    assert "timeout must be" in r["timeout-inf"] and "timeout must be" in r["timeout-str"]
    assert "overlaps" in r["out-overlap"]
    assert "timeout must be" in r["wait-nan"]
    assert r["in-place"] == list(range(8))


def test_zero_d_arrays_keep_their_shape(spawn):
    for r in spawn(2, W.zero_d):
        assert r["allreduce"] == () and r["broadcast"] == ()
        assert r["allgather"] == (2,)
        assert r["value"] == 5.0


def test_allgather_rows_of_different_shapes_fail_every_rank(spawn):
    for r in spawn(2, W.allgather_shapes, env={"KUNGFU_OP_TIMEOUT": "30s"}):
        assert r["error"] is not None and "shape" in r["error"], r
        assert r["seconds"] < 5
        assert r["after"] == [[0, 0, 0], [1, 1, 1]]


def test_nan_wins_max_and_min(spawn):
    for r in spawn(2, W.nan_max):
        assert r == [[True, True], [True, True]]


# What each disagreement's message must name (beyond the operation), on every rank.
DISAGREEMENT_WORDS = {"sum-vs-avg": ("sum", "avg"), "int-sum-vs-avg": ("sum", "avg"),
                      "allreduce-shape": ("shape",), "allreduce-flat": ("shape",),
                      "broadcast-shape": ("shape",)}


@pytest.mark.parametrize("n", [2, 3])
def test_disagreements_fail_every_rank_at_once(spawn, n):
    # Before: sum on one rank and avg on another returned [3, 6, 9] and [1.5, 3, 4.5]; shapes
    # (2, 3) and (3, 2), or (4, 4) and (16,), were accepted with each rank's own shape.
    results = spawn(n, W.disagreements, env={"KUNGFU_OP_TIMEOUT": "30s"})
    assert set(results[0]) == set(DISAGREEMENT_WORDS)
    for rank, res in enumerate(results):
        for case, words in DISAGREEMENT_WORDS.items():
            o = res[case]
            assert o["error"] is not None, (rank, case, o)
            for w in words:
                assert w in o["error"], (rank, case, o)
            assert o["seconds"] < 5, (rank, case, o)  # at once, not at the 30 s deadline
            assert o["after"] == [10.0 * n] * 2, (rank, case, o)


def _floor_mean(rows) -> list:
    """The exact floor of the mean of each column, in Python integers."""
    flat = [np.asarray(r, dtype=object).reshape(-1) for r in rows]
    return [sum(int(x[i]) for x in flat) // len(flat) for i in range(len(flat[0]))]


@pytest.mark.parametrize("n", [2, 3])
def test_avg_is_made_once_and_exact_for_integers(spawn, n):
    # Before: a second wait() divided again ([4, 8] then [2, 4], the first array changed too);
    # int8 avg(100, 100) was -28 and int64 avg(2**62, 2**62) was -2**62 (the sum wrapped).
    mean = (n + 1) / 2
    for r, res in enumerate(spawn(n, W.avg_results)):
        t = res["twice"]
        assert t["first"] == [4.0 * mean, 8.0 * mean] and t["second"] == t["first"], (r, t)
        assert t["kept"] == t["first"] and t["same_object"], (r, t)
        want = _floor_mean([[7 * (k + 1), -7 * (k + 1)] for k in range(n)])
        assert res["twice-int"] == [want, want], (r, res["twice-int"])
        for key, (dtype, values) in W.INTEGER_MEANS.items():
            got = res[key]
            rows = [np.array(values(k), dtype=dtype) for k in range(n)]
            assert got["dtype"] == dtype and got["shape"] == list(rows[0].shape), (r, key, got)
            assert np.array(got["values"], dtype=object).reshape(-1).tolist() == \
                _floor_mean(rows), (r, key, got)
        assert res["out"] == {"values": [100, -100], "is_out": True}, (r, res["out"])
        assert res["scalar"] == _floor_mean([[30000 - k] for k in range(n)])[0], (r, res)


@pytest.mark.parametrize("strategy", [None, "STAR"], ids=["fused", "STAR"])
def test_names_that_differ_fail_every_rank_fast(spawn, strategy):
    # Before: both waited for the op deadline (30 s here) and raised OpTimeoutError.
    results = spawn(2, W.names_that_differ, strategy,
                    env={"KUNGFU_OP_TIMEOUT": "30s", "KUNGFU_MISMATCH_GRACE": "1s"})
    for rank, r in enumerate(results):
        assert r["error"] is not None, (rank, r)
        assert "different names" in r["error"] and "'a'" in r["error"] and "'b'" in r["error"], r
        assert 0.9 <= r["seconds"] < 10, (rank, r)  # after the grace period, long before 30 s
        assert r["after"] == [20.0, 20.0], (rank, r)


@pytest.mark.parametrize("strategy", [None, "STAR", "RING", "BINARY_TREE_STAR"],
                         ids=["fused", "STAR", "RING", "BINARY_TREE_STAR"])
def test_equal_timeouts_give_one_outcome_on_every_rank(spawn, strategy):
    # The probe (2m'): 1 op in 200 succeeded on one rank and timed out on the other.
    rows = spawn(2, W.equal_timeouts, 100, strategy, timeout=90)[0]
    split = [(i, row) for i, row in enumerate(rows) if len(set(row)) > 1]
    assert not split, f"ops whose outcome differs between ranks (1 ok, 0 timeout): {split}"
    assert all(set(row) <= {0, 1} for row in rows), rows  # 2: a wrong sum


@pytest.mark.parametrize("n,root", [(2, 0), (3, 2)], ids=["np2-root0", "np3-root2"])
def test_broadcast_object_root_cannot_pickle_fails_everywhere_with_its_reason(spawn, n, root):
    # Before: root raised before the collective and the others failed on a name mismatch
    # ("kungfu::broadcast_object/size" against whatever root called next) 2 s later.
    results = spawn(n, W.broadcast_unpicklable, root, env={"KUNGFU_MISMATCH_GRACE": "1s"})
    for rank, r in enumerate(results):
        assert r["error"] is not None and "cannot pickle" in r["error"], (rank, r)
        assert "_thread.lock" in r["error"], (rank, r)  # root's reason
        if rank != root:
            assert f"rank {root}" in r["error"] and "PicklingError" in r["error"], (rank, r)
        assert r["after"] == ("ok", root), (rank, r)
