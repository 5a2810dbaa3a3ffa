"""Collectives in real worker processes, checked value by value against numpy.

Process start-up dominates on small machines, so each world size runs every case in one spawn
(`_w_collectives.run_batch`, started once per session and shared); each test below then checks
one group of cases (one collective under one strategy, or one feature) and names every case that
went wrong: "allreduce/RING/bfloat16/avg/3x5x7 (rank 2 of 4): ...".
"""
import pytest

import _w_collectives as W

WORLD_SIZES = [1, 2, 3, 4, 7]
BATCH_TIMEOUT = 180.0

pytestmark = pytest.mark.timeout(BATCH_TIMEOUT + 30)


@pytest.fixture(scope="session")
def batch(session_spawn):
    """batch(n) -> per-rank results of run_batch at world size n (spawned once, then cached)."""
    cache = {}

    def get(n):
        if n not in cache:
            try:
                cache[n] = (True, session_spawn(n, W.run_batch, timeout=BATCH_TIMEOUT))
            except AssertionError as e:  # WorkerError from the spawn fixture
                cache[n] = (False, str(e))
        ok, value = cache[n]
        if not ok:
            pytest.fail(f"the batch at np={n} failed, so none of its cases ran:\n{value}",
                        pytrace=False)
        return value

    return get


def check_group(results, n: int, group: str) -> None:
    expected = W.expected_counts(n)[group]
    problems = []
    for rank, res in enumerate(results):
        ran = res["count"].get(group, 0)
        if ran != expected:
            problems.append(f"rank {rank} ran {ran} cases of {group}, expected {expected}")
        problems += res["failures"].get(group, [])
    if problems:
        shown = "\n".join(problems[:40])
        more = f"\n... and {len(problems) - 40} more" if len(problems) > 40 else ""
        pytest.fail(f"{len(problems)} problem(s) in {group} at np={n} "
                    f"({expected} cases per rank):\n{shown}{more}", pytrace=False)


@pytest.mark.parametrize("strategy", W.STRATEGIES)
@pytest.mark.parametrize("kind", W.STRATEGY_KINDS)
@pytest.mark.parametrize("n", WORLD_SIZES, ids=lambda n: f"np{n}")
def test_collective_per_strategy(batch, n, kind, strategy):
    """allreduce (sum/avg/min/max/prod x every dtype x sizes 0, 1, 7, 1009, 65537, 3x5x7),
    broadcast from every root (bit-exact, NaN/inf/-0.0 included) and reduce to every root."""
    check_group(batch(n), n, f"{kind}/{strategy}")


@pytest.mark.parametrize("group", W.OTHER_GROUPS)
@pytest.mark.parametrize("n", WORLD_SIZES, ids=lambda n: f"np{n}")
def test_collective_feature(batch, n, group):
    """allgather and gather (equal, ragged, empty, scalar rows; every root), barrier ordering,
    consensus (agree and disagree), scalar types, op-name reuse, identity, kungfu.python."""
    check_group(batch(n), n, group)


def test_every_rank_reports_the_same_cases(batch):
    for n in WORLD_SIZES:
        results = batch(n)
        assert len(results) == n
        counts = [r["count"] for r in results]
        assert all(c == W.expected_counts(n) for c in counts), counts


# 2**24 + 43 float32: just over 64 MiB per buffer, not a multiple of any chunk size.
BIG_COUNT = (1 << 24) + 43


@pytest.mark.timeout(150)
@pytest.mark.parametrize("n,strategies", [(2, ["AUTO", "STAR"]), (4, ["AUTO", "RING"])],
                         ids=["np2", "np4"])
def test_allreduce_over_64_mib(spawn, n, strategies):
    assert BIG_COUNT * 4 > 64 << 20
    times = spawn(n, W.big_allreduce, BIG_COUNT, strategies, timeout=120)
    assert len(times) == n and all(set(t) == set(strategies) for t in times)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("n,strategy", [(3 + i % 2, s) for i, s in enumerate(W.STRATEGIES)],
                         ids=[f"np{3 + i % 2}-{s}" for i, s in enumerate(W.STRATEGIES)])
def test_default_strategy_from_environment(spawn, n, strategy):
    """Every collective without a strategy argument, under KUNGFU_ALLREDUCE_STRATEGY."""
    results = spawn(n, W.default_strategy, env={"KUNGFU_ALLREDUCE_STRATEGY": strategy})
    problems = [f for r in results for f in r["failures"].get("default", [])]
    assert not problems, "\n".join(problems)
    assert all(r["count"]["default"] == 6 + 3 * n for r in results)


@pytest.mark.timeout(150)
def test_the_avg_of_half_floats_is_the_mean_where_the_sum_overflows(spawn):
    """2 workers: float16 64 (600 + r + i) sums to more than 65504, bfloat16 2^127 (1 + ...) to
    more than float32 holds; their means fit, exactly. Before, every avg of them was inf."""
    import math

    results = spawn(2, W.half_means, env={"TF_CPP_MIN_LOG_LEVEL": "3"}, timeout=140)
    i = range(6)
    f16 = [64.0 * (600.5 + k) for k in i]
    bf16 = [math.ldexp(1.0 + (1 + k) / 128.0, 127) for k in i]
    for rank, got in enumerate(results):
        assert got["numpy float16"] == f16, (rank, got)
        assert got["numpy bfloat16"] == bf16, (rank, got)
        assert all(math.isinf(v) for v in got["numpy float16 sum"]), got  # a sum is a sum
        assert got["numpy reducescatter"] == f16[3 * rank:3 * rank + 3], (rank, got)
        assert got["tf float16"] == f16 and got["tf group float16"] == f16, (rank, got)
        assert got["tf group float32"] == [2.0, 4.0] == got["tf gradients float32"], got
        assert got["tf gradients float16"] == f16, (rank, got)
        assert got["tf group bfloat16"] == bf16, (rank, got)
        if "torch float16" in got:
            assert got["torch float16"] == f16, (rank, got)
