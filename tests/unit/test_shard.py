"""kf.shard: equal shares for every worker, clear errors (one process: rank and size given)."""
from __future__ import annotations

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

from kungfu.tensorflow.data import shard  # noqa: E402


def test_every_worker_gets_as_many_samples_and_none_twice():
    x = np.arange(10)
    shares = [shard(x, r, 4) for r in range(4)]
    assert [s.tolist() for s in shares] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    xs, ys = shard((x, x * 10), 1, 4)
    assert xs.tolist() == [1, 5] and ys.tolist() == [10, 50]
    assert shard({"a": x}, 3, 4)["a"].tolist() == [3, 7]
    ds = [list(shard(tf.data.Dataset.range(10), r, 4).as_numpy_iterator()) for r in range(4)]
    assert ds == [s.tolist() for s in shares]


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="known, finite length"):
        shard(tf.data.Dataset.range(10).repeat(), 0, 2)
    with pytest.raises(ValueError, match="differ in length"):
        shard((np.zeros(4), np.zeros(5)), 0, 2)
    with pytest.raises(ValueError, match="rank 2 is not in a cluster of 2"):
        shard(np.zeros(4), 2, 2)
