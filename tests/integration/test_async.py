"""Asynchronous collectives: many ops in flight, issued in a different order on every rank;
handles (wait, done, wait with a timeout) and done callbacks.

One spawn per world size runs every case (`_w_async.run_batch`); each test checks one group.
"""
import pytest

import _w_async as W

WORLD_SIZES = [1, 2, 3, 7]
BATCH_TIMEOUT = 90.0

pytestmark = pytest.mark.timeout(BATCH_TIMEOUT + 30)


@pytest.fixture(scope="session")
def async_batch(session_spawn):
    cache = {}

    def get(n):
        if n not in cache:
            try:
                cache[n] = (True, session_spawn(n, W.run_batch, timeout=BATCH_TIMEOUT))
            except AssertionError as e:  # WorkerError from the spawn fixture
                cache[n] = (False, str(e))
        ok, value = cache[n]
        if not ok:
            pytest.fail(f"the async batch at np={n} failed:\n{value}", pytrace=False)
        return value

    return get


@pytest.mark.parametrize("group", W.GROUPS)
@pytest.mark.parametrize("n", WORLD_SIZES, ids=lambda n: f"np{n}")
def test_async(async_batch, n, group):
    """many_allreduces: 50 named allreduce_async in a per-rank shuffled order, waited in another;
    mixed: every kind of collective in flight at once; same_name: one name in flight 6 times;
    callbacks: each add_done_callback fires exactly once (also when added after completion and
    for a failed op), a raising callback harms nothing; wait_timeout: wait(0.05) raises
    TimeoutError while the op goes on to complete."""
    results = async_batch(n)
    want = W.expected_counts(n)[group]
    problems = []
    for rank, res in enumerate(results):
        ran = res["count"].get(group, 0)
        if ran != want:
            problems.append(f"rank {rank} ran {ran} cases of {group}, expected {want}")
        problems += res["failures"].get(group, [])
    assert not problems, "\n".join(problems)
