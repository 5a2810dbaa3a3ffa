"""Workers prove the job's token (KUNGFU_JOB_TOKEN) to each other: the same token connects, a
different one is refused at once on both sides with an error that names the cause."""
import time

import numpy as np
import pytest

pytestmark = pytest.mark.timeout(90)


def _sum():
    import kungfu as kf

    return float(kf.allreduce(np.ones(3, np.float32))[0])


def test_same_token_connects(spawn):
    assert spawn(2, _sum, env={"KUNGFU_JOB_TOKEN": "t0p-s3cret"}) == [2.0, 2.0]


def test_different_tokens_are_refused_at_once(spawn):
    # Each worker dials the other, finds its proof wrong and gives up at once, naming the other
    # and the cause; a worker that gives up keeps answering hellos until the other's is answered
    # (at most 2 s), so neither waits for its connect timeout. Neither ever connects.
    start = time.time()
    run = spawn.run(2, _sum, env={"KUNGFU_CONNECT_TIMEOUT": "60s"},
                    rank_env={0: {"KUNGFU_JOB_TOKEN": "token-of-job-a"},
                              1: {"KUNGFU_JOB_TOKEN": "token-of-job-b"}}, timeout=50)
    for rank, r in enumerate(run.outcomes):
        assert r.status == "error", r
        assert r.error_time - start < 30, r  # not the 60 s connect timeout
        assert r.error_type == "InvalidArgumentError", r
        assert (f"(rank {1 - rank}) refused this peer: wrong job token "
                "(KUNGFU_JOB_TOKEN differs)") in r.error_message, r
