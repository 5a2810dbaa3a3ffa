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
    start = time.time()
    run = spawn.run(2, _sum, env={"KUNGFU_CONNECT_TIMEOUT": "30s"},
                    rank_env={0: {"KUNGFU_JOB_TOKEN": "token-of-job-a"},
                              1: {"KUNGFU_JOB_TOKEN": "token-of-job-b"}}, timeout=40)
    assert time.time() - start < 15  # not the 30 s connect timeout
    for r in run.outcomes:
        assert r.status == "error", r
        assert r.error_type == "InvalidArgumentError" and "token" in r.error_message, r
