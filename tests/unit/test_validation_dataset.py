"""kf.validation_dataset takes its share from the cluster as it is at each iteration."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

from kungfu.tensorflow import data as kdata  # noqa: E402


def test_every_iteration_takes_the_share_of_the_cluster_as_it_is_then(monkeypatch):
    x = np.arange(10, dtype=np.float32).reshape(10, 1)
    ds = kdata.validation_dataset(x, x * 2, batch_size=3)
    me = SimpleNamespace(rank=0, size=2)
    monkeypatch.setattr(kdata._peer, "identity", lambda: me)

    def rows():
        got = [(bx[:, 0].tolist(), by[:, 0].tolist()) for bx, by in ds.as_numpy_iterator()]
        xs = [v for bx, _ in got for v in bx]
        assert [v for _, by in got for v in by] == [2 * v for v in xs]
        assert all(len(bx) <= 3 for bx, _ in got)
        return xs

    assert rows() == [0, 1, 2, 3, 4]
    me.rank = 1
    assert rows() == [5, 6, 7, 8, 9]
    seen = []
    for r in range(3):  # the same dataset after a resize to 3 workers
        me.rank, me.size = r, 3
        seen += rows()
    assert seen == list(range(10))


def test_arrays_of_different_lengths_are_refused():
    with pytest.raises(ValueError, match=r"one length, got \[3, 2\]"):
        kdata.validation_dataset(np.zeros(3), np.zeros(2))
