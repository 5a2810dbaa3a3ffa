"""Per-worker batch sizes in kf.ElasticData (the split of each step's slice), the check of a
split, and the emulated compute of experiments (KUNGFU_SAMPLE_TIME, KUNGFU_SLOWDOWN)."""
from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np
import pytest

import kungfu as kf
from kungfu import _env
from kungfu.elastic import Round, TrainingState

tf = pytest.importorskip("tensorflow")

from kungfu.tensorflow.data import ElasticData, _apportion  # noqa: E402


def test_apportion_is_proportional_and_splits_equal_weights_as_array_split():
    assert _apportion(12, [1, 2, 3]) == [2, 4, 6]
    assert _apportion(5, [1, 2, 3]) == [1, 2, 2]  # quotas .83, 1.67, 2.5: largest remainders
    assert _apportion(0, [4, 4]) == [0, 0]
    for total in range(12):
        want = [len(p) for p in np.array_split(np.arange(total), 4)]
        assert _apportion(total, [3, 3, 3, 3]) == want


@pytest.mark.parametrize("sizes", [[1, 5], [3, 1, 4]], ids=["np2", "np3"])
def test_every_sample_once_per_epoch_with_an_uneven_split(sizes):
    """Each step's slice is split in proportion to the sizes, the epoch's last one too; every
    sample is served once, and each part's weight makes the weighted mean over the workers the
    mean over the slice."""
    n, d = len(sizes), ElasticData(np.arange(29), batch_size=2, seed=5)
    d.set_batch_sizes(sizes)
    assert d.sizes(n) == sizes and d.sizes(n + 1) == [2] * (n + 1)  # a split is for its size
    seen = []
    while not d.epoch_done():
        parts = [d.part(d.offset, r, n) for r in range(n)]
        length = parts[0][2]
        if length == sum(sizes):
            assert [len(p[0]) for p in parts] == sizes
        for idx, weight, _ in parts:
            if weight:
                seen += idx.tolist()
        # Worker r's loss is the mean of weight x sample loss over its part, and the workers'
        # gradients are averaged: every sample of the slice counts 1 / length.
        for idx, weight, _ in parts:
            if weight:
                assert weight / (n * len(idx)) == pytest.approx(1 / length)
        d.offset += length
    assert sorted(seen) == list(range(29))
    d.set_batch_size(3)
    assert d.batch_sizes is None and d.sizes(n) == [3] * n


def test_a_split_is_checked_against_the_cluster_and_the_global_batch():
    state = TrainingState(cluster_size=3, global_batch_size=12)
    r = Round(SimpleNamespace(state=state, policies=[]), None, "test")
    r.open()
    try:
        kf.set_batch_sizes((2, 4, 6))
        assert r.decisions == {"batch_sizes": [2, 4, 6]}
        for bad, why in [([4, 8], "3 workers"), ([2, 4, 7], "sum to 13"),
                         ([0, 6, 6], "positive integer"), ([-2, 8, 6], "positive integer"),
                         ([2.5, 4, 5.5], "positive integer"), ("246", "one size per worker")]:
            with pytest.raises(ValueError, match=why):
                kf.set_batch_sizes(bad)
    finally:
        r.close()
    assert r.decisions == {}
    with pytest.raises(RuntimeError, match="kf.Hook"):
        kf.set_batch_sizes([4, 4, 4])  # outside a policy hook


def test_slowdown_parses_and_refuses_by_name():
    assert _env.SLOWDOWN.get({"KUNGFU_SLOWDOWN": "1:2@100, 0:1.5,1:1@200"}) == [
        (0, 1.5, 0), (1, 2.0, 100), (1, 1.0, 200)]
    for bad in ("1", "1:0", "x:2", "1:2@-1", "-1:2"):
        with pytest.raises(ValueError, match="KUNGFU_SLOWDOWN.*RANK:FACTOR"):
            _env.SLOWDOWN.get({"KUNGFU_SLOWDOWN": bad})
    with pytest.raises(ValueError, match="KUNGFU_SAMPLE_TIME"):
        _env.SAMPLE_TIME.get({"KUNGFU_SAMPLE_TIME": "-1"})


def test_emulated_compute_takes_factor_times_sample_time_per_sample(monkeypatch):
    monkeypatch.setenv("KUNGFU_SAMPLE_TIME", "0.01")
    monkeypatch.setenv("KUNGFU_SLOWDOWN", "0:3@2")  # rank 0 (this process), from batch 2 on
    d = ElasticData(np.arange(100), batch_size=10, shuffle=False)
    took = []
    for _ in range(4):
        start = time.perf_counter()
        d.step_batch()
        took.append(time.perf_counter() - start)
    assert 0.1 <= took[0] < 0.2 and 0.1 <= took[1] < 0.2  # 10 samples x 10 ms
    assert 0.3 <= took[2] < 0.45 and 0.3 <= took[3] < 0.45  # x 3
