"""kf.RecordFiles (random access to TFRecord files) and ElasticData over a source."""
from __future__ import annotations

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

from kungfu.tensorflow.data import ElasticData, RecordFiles  # noqa: E402

SPEC = {"x": tf.io.FixedLenFeature([2], tf.float32), "y": tf.io.FixedLenFeature([1], tf.int64)}


def parse(records):
    got = tf.io.parse_example(records, SPEC)
    return got["x"].numpy(), got["y"].numpy()


def write(path, rows, options=None):
    with tf.io.TFRecordWriter(str(path), options=options) as w:
        for i in rows:
            w.write(tf.train.Example(features=tf.train.Features(feature={
                "x": tf.train.Feature(float_list=tf.train.FloatList(value=[i, -i])),
                "y": tf.train.Feature(int64_list=tf.train.Int64List(value=[i])),
            })).SerializeToString())


@pytest.fixture()
def files(tmp_path):
    write(tmp_path / "b.tfrecord", range(7, 20))  # sorted by name: a (0..6), then b (7..19)
    write(tmp_path / "a.tfrecord", range(7))
    return tmp_path


def test_records_are_read_by_position_across_files(files):
    src = RecordFiles(str(files / "*.tfrecord"), parse)
    assert len(src) == 20
    x, y = src.read([19, 0, 7, 6, 6])
    assert y[:, 0].tolist() == [19, 0, 7, 6, 6] and x[:, 1].tolist() == [-19, 0, -7, -6, -6]
    with pytest.raises(IndexError, match="out of range 0..19"):
        src.read([20])


def test_elastic_data_serves_a_source_like_arrays(files):
    src = RecordFiles(str(files / "*.tfrecord"), parse)
    arrays = ElasticData(np.stack([np.arange(20.0), -np.arange(20.0)], 1).astype(np.float32),
                         np.arange(20)[:, None], batch_size=6, seed=3)
    data = ElasticData(src, batch_size=6, seed=3)
    for a, b in zip(arrays.step_batch(), data.step_batch()):
        assert np.array_equal(a, b)
    with pytest.raises(ValueError, match="y must be None"):
        ElasticData(src, np.zeros(20))


def test_bad_files_are_refused_by_name(tmp_path):
    write(tmp_path / "z.tfrecord", range(3), options="GZIP")
    with pytest.raises(ValueError, match="z.tfrecord: byte 0 does not start a TFRecord .*GZIP"):
        RecordFiles([tmp_path / "z.tfrecord"], parse)
    write(tmp_path / "cut.tfrecord", range(3))
    data = (tmp_path / "cut.tfrecord").read_bytes()
    (tmp_path / "cut.tfrecord").write_bytes(data[:-5])
    with pytest.raises(ValueError, match="cut.tfrecord is cut short"):
        RecordFiles([tmp_path / "cut.tfrecord"], parse)
    with pytest.raises(ValueError, match="no files match"):
        RecordFiles(str(tmp_path / "none-*.tfrecord"), parse)
    with pytest.raises(TypeError, match="parse="):
        RecordFiles([tmp_path / "cut.tfrecord"], None)
