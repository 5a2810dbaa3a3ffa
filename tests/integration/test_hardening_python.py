"""The Python edge keeps the runtime's promises: buffers owned by their operation, bad input on
one rank failing every rank with numbering intact, shapes kept, NaN propagated."""
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
