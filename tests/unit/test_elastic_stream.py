"""kf.ElasticData over a tf.data.Dataset read as a stream (no random access), in one process:
every worker's part of every step, epochs, shuffling, going back, bad input."""
from __future__ import annotations

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

from kungfu.tensorflow.data import ElasticData  # noqa: E402

N = 23


def arrays():
    x = np.arange(N * 2, dtype=np.float32).reshape(N, 2)
    y = np.arange(N, dtype=np.int64) * 10
    return x, y


def stream(**kw):
    return ElasticData(tf.data.Dataset.from_tensor_slices(arrays()), batch_size=4, **kw)


def step_parts(data, size):
    """Every rank's (x, y, weight) of the step at data's position, then moves past it."""
    parts = []
    for rank in range(size):
        idx, weight, length = data.part(data.offset, rank, size)
        parts.append((*data._fetch(idx), weight))
    data.offset += length
    return parts, length


def test_every_workers_part_equals_the_arrays_one_across_sizes_and_batch_sizes():
    """Unshuffled, the stream and the arrays give every worker the same batches, whatever
    the cluster size and batch size of each step; epochs end at the same step."""
    s, a = stream(), ElasticData(*arrays(), batch_size=4, shuffle=False)
    for epoch in range(2):
        sizes = iter([3, 3, 2, 1, 4, 2, 2, 2, 2, 2])
        steps = 0
        while not a.epoch_done():
            assert not s.epoch_done()
            size = next(sizes)
            if steps == 2:
                s.set_batch_size(3)
                a.set_batch_size(3)
            (ps, ls), (pa, la) = step_parts(s, size), step_parts(a, size)
            assert ls == la
            for got, want in zip(ps, pa):
                for g, w in zip(got[:2], want[:2]):
                    np.testing.assert_array_equal(g, w)
                assert got[2] == want[2]
            steps += 1
        assert s.epoch_done() and s.offset == N and len(s) == N
        for d in (s, a):
            d.next_epoch()
            d.set_batch_size(4)


def test_a_shuffled_stream_is_the_same_on_every_worker_and_new_each_epoch():
    one, two = stream(shuffle_buffer=8, seed=3), stream(shuffle_buffer=8, seed=3)
    orders = []
    for epoch in range(3):
        got = []
        for d in (one, two):
            ys = []
            while not d.epoch_done():
                idx, _, length = d.part(d.offset, 0, 1)
                ys += d._fetch(idx)[1].tolist()
                d.offset += length
            d.next_epoch()
            got.append(ys)
        assert got[0] == got[1]  # the same stream on two workers
        assert sorted(got[0]) == [10 * i for i in range(N)]  # each sample once
        orders.append(got[0])
    assert orders[0] != orders[1] != orders[2]
    assert orders[0] != sorted(orders[0])
    other = stream(shuffle_buffer=8, seed=4)
    ys = []
    while not other.epoch_done():
        idx, _, length = other.part(other.offset, 0, 1)
        ys += other._fetch(idx)[1].tolist()
        other.offset += length
    assert ys != orders[0]


def test_a_step_is_made_again_and_an_earlier_position_is_read_again():
    """A failed step is made again from the slice kept; a rollback or a joiner reads the
    epoch's stream again up to its position."""
    d = stream(shuffle_buffer=5, seed=1)
    first = d.step_batch()
    d.offset = 4 * 3
    later = d.step_batch()
    again = d.step_batch()
    np.testing.assert_array_equal(later[1], again[1])
    d.offset = 0
    np.testing.assert_array_equal(d.step_batch()[1], first[1])
    joiner = stream(shuffle_buffer=5, seed=1)
    joiner.offset = 12
    np.testing.assert_array_equal(joiner.step_batch()[1], later[1])


def test_model_fit_trains_on_the_stream_one_epoch_per_iteration():
    import keras

    d = stream()
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    hist = model.fit(d.dataset(), epochs=2, verbose=0)
    assert len(hist.history["loss"]) == 2 and d.epoch == 2 and d.offset == 0


def test_bad_streams_are_refused_by_name():
    ds = tf.data.Dataset.from_tensor_slices(arrays())
    with pytest.raises(ValueError, match="infinite"):
        ElasticData(ds.repeat())
    with pytest.raises(ValueError, match="y must be None"):
        ElasticData(ds, arrays()[1])
    with pytest.raises(ValueError, match="shuffle_buffer must be an int >= 0"):
        ElasticData(ds, shuffle_buffer=-1)
    with pytest.raises(ValueError, match="shuffle_buffer is for a tf.data.Dataset"):
        ElasticData(*arrays(), shuffle_buffer=8)
    with pytest.raises(ValueError, match="no samples"):
        ElasticData(ds.take(0))
    with pytest.raises(ValueError, match="must be an array or a tuple of arrays.*got dict"):
        ElasticData(ds.map(lambda x, y: {"x": x, "y": y}))
    with pytest.raises(TypeError, match="known once its first epoch"):
        len(ElasticData(ds))
