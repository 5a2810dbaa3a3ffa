"""Workers prove the job's token (KUNGFU_JOB_TOKEN) to each other: the same token connects, a
different one is refused at once on both sides with an error that names the cause; a weak one
is refused by the worker itself."""
import secrets
import time

import numpy as np
import pytest

pytestmark = pytest.mark.timeout(90)
TOKEN_A, TOKEN_B = secrets.token_hex(32), secrets.token_hex(32)


def _sum():
    import kungfu as kf

    return float(kf.allreduce(np.ones(3, np.float32))[0])


def test_same_token_connects(spawn):
    assert spawn(2, _sum, env={"KUNGFU_JOB_TOKEN": TOKEN_A}) == [2.0, 2.0]


def test_different_tokens_are_refused_at_once(spawn):
    # Each worker dials the other, finds its proof wrong and gives up at once, naming the other
    # and the cause; a worker that gives up keeps answering hellos until the other's is answered
    # (at most 2 s), so neither waits for its connect timeout. Neither ever connects.
    start = time.time()
    run = spawn.run(2, _sum, env={"KUNGFU_CONNECT_TIMEOUT": "60s"},
                    rank_env={0: {"KUNGFU_JOB_TOKEN": TOKEN_A},
                              1: {"KUNGFU_JOB_TOKEN": TOKEN_B}}, timeout=50)
    for rank, r in enumerate(run.outcomes):
        assert r.status == "error", r
        assert r.error_time - start < 30, r  # not the 60 s connect timeout
        assert r.error_type == "InvalidArgumentError", r
        assert (f"(rank {1 - rank}) refused this peer: wrong job token "
                "(KUNGFU_JOB_TOKEN differs)") in r.error_message, r


def test_a_weak_token_is_refused_by_the_worker(spawn):
    # Workers started by hand (no kungfu-run) read KUNGFU_JOB_TOKEN themselves: one of under 128
    # bits (a 4-digit one fell to an offline search in 0.02 s) fails the first collective on
    # every rank with the reason, and the token is not shown.
    run = spawn.run(2, _sum, env={"KUNGFU_JOB_TOKEN": "4821-etcd-test"}, timeout=50)
    for r in run.outcomes:
        assert r.status == "error", r
        assert r.error_type == "ValueError", r
        assert "KUNGFU_JOB_TOKEN is invalid: the job token is too weak" in r.error_message, r
        assert "secrets.token_hex(32)" in r.error_message and "4821" not in r.error_message, r
