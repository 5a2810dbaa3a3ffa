"""Workers prove the job's token (KUNGFU_JOB_TOKEN) to each other: the same token connects, a
different one is refused at once on both sides with an error that names the cause."""
import time

import numpy as np
import pytest

pytestmark = pytest.mark.timeout(60)


def _sum():
    import kungfu as kf

    return float(kf.allreduce(np.ones(3, np.float32))[0])


def test_same_token_connects(spawn):
    assert spawn(2, _sum, env={"KUNGFU_JOB_TOKEN": "t0p-s3cret"}) == [2.0, 2.0]


def test_different_tokens_are_refused_at_once(spawn):
    # The worker that checks the other's proof first fails at once, naming the token; the other
    # may find it gone by then and fails when its connect timeout ends (under kungfu-run the
    # launcher stops the job at the first failure). Neither ever connects.
    start = time.time()
    run = spawn.run(2, _sum, env={"KUNGFU_CONNECT_TIMEOUT": "8s"},
                    rank_env={0: {"KUNGFU_JOB_TOKEN": "token-of-job-a"},
                              1: {"KUNGFU_JOB_TOKEN": "token-of-job-b"}}, timeout=40)
    for r in run.outcomes:
        assert r.status == "error", r
    first = min(run.outcomes, key=lambda r: r.error_time)
    assert first.error_time - start < 6, first  # well before the 8 s connect timeout
    assert first.error_type == "InvalidArgumentError" and "token" in first.error_message, first
