"""Elastic data for TensorFlow: kungfu.elastic's ElasticData (training samples addressed by
global offset, batch size changeable per step; its module doc says how) with tf.data datasets of
its batches, plus TFRecord files as a random-access source, sharding and validation helpers.

    data = kf.ElasticData(x, y, batch_size=32)           # per-worker batch size
    model.fit(data.dataset(), epochs=5, callbacks=[kf.Hook(policy, data=data)])

In model.fit with a Hook, batch s is made only once the Hook has released step s (after the
decisions of step s - 1 were applied), so tf.data's read-ahead cannot make a batch with an
outdated size. Use steps_per_execution=1 (the default). In a custom loop, iterate
`epoch_batches()`: each batch is made when the loop asks for it.
"""
from __future__ import annotations

import glob
import os
import struct
import threading
from typing import Callable, List, Sequence, Union

import numpy as np

from kungfu import _peer
from kungfu.elastic import _data, check_batch_size
from kungfu.elastic._data import RELEASE_TIMEOUT, _apportion  # noqa: F401
from kungfu.tensorflow import _internals


class ElasticData(_data.ElasticData):
    __doc__ = _data.ElasticData.__doc__

    def dataset(self):
        """A tf.data.Dataset of this worker's batches, one epoch per iteration."""
        ds = self._dataset_of(self.epoch_batches)
        ds._kungfu_elastic = True
        _keep_keras_from_fixing_epoch_length()
        return ds

    def step_dataset(self):
        """step_batch() as a dataset of that one batch."""
        batch = self.step_batch()
        return self._dataset_of(lambda: iter([batch]))

    def rehearsal_dataset(self):
        """One batch shaped like this data's (its first samples, all of weight 0), as a dataset
        of the same element spec as dataset(): a training step run on it traces the step function
        that model.fit then uses, and leaves the position alone."""

        def one_batch():
            parts = self._sample if self.stream is not None else self._fetch(
                np.arange(min(self.batch_size, len(self))))
            yield (*parts, np.zeros(len(parts[0]), dtype=np.float32))

        return self._dataset_of(one_batch)

    def _dataset_of(self, generator):
        import tensorflow as tf

        def spec(a):
            return tf.TensorSpec((None,) + a.shape[1:], tf.as_dtype(a.dtype))

        signature = tuple(spec(a) for a in self._sample) + (tf.TensorSpec((None,), tf.float32),)
        ds = tf.data.Dataset.from_generator(generator, output_signature=signature)
        # No autotuning: Keras makes a new iterator every epoch, and tearing one down waits for
        # the autotuning thread, which sleeps longer and longer (seen: seconds at epoch ends,
        # up to a minute at exit). One batch is made per released step anyway.
        options = tf.data.Options()
        options.autotune.enabled = False
        return ds.with_options(options)


class RecordFiles:
    """Random access to the records of TFRecord files, for kf.ElasticData: the records of all
    `files` in order (a list, or a glob pattern, sorted), numbered from 0, each batch read by
    position and turned into arrays by `parse(records)`: a list of serialized records in, an
    array or a tuple of arrays out (e.g. `tf.io.parse_example` on them, then `.numpy()`).

    Opening scans each file's record headers (8-byte lengths; no payload is read) to index the
    records; nothing is held in memory but that index. Files must be uncompressed (a GZIP or
    ZLIB TFRecord file has no random access: the error says so)."""

    def __init__(self, files: Union[str, Sequence[str]], parse: Callable):
        paths = sorted(glob.glob(files)) if isinstance(files, str) else [os.fspath(f)
                                                                          for f in files]
        if not paths:
            raise ValueError(f"RecordFiles: no files match {files!r}")
        if not callable(parse):
            raise TypeError("RecordFiles needs parse=: a function from a list of serialized "
                            "records to an array or a tuple of arrays")
        self.paths = paths
        self.parse = parse
        files_, offsets, lengths = [], [], []
        for i, path in enumerate(paths):
            offs, lens = _index_records(path)
            files_.append(np.full(len(offs), i, np.int32))
            offsets.append(offs)
            lengths.append(lens)
        self._file = np.concatenate(files_)  # record -> its file
        self._offset = np.concatenate(offsets)  # record -> offset of its payload
        self._length = np.concatenate(lengths)
        self._fds = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._offset)

    def records(self, indices) -> List[bytes]:
        """The serialized records at these positions."""
        idx = np.asarray(indices, np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= len(self)):
            raise IndexError(f"RecordFiles: record index out of range 0..{len(self) - 1}")
        out = []
        with self._lock:
            for i in idx.tolist():
                f = int(self._file[i])
                fd = self._fds.get(f)
                if fd is None:
                    fd = self._fds[f] = os.open(self.paths[f], os.O_RDONLY)
                n = int(self._length[i])
                data = os.pread(fd, n, int(self._offset[i]))
                if len(data) != n:
                    raise ValueError(f"RecordFiles: {self.paths[f]} changed since it was "
                                     f"indexed (record {i} is cut short)")
                out.append(data)
        return out

    def read(self, indices):
        return self.parse(self.records(indices))

    def __del__(self):
        for fd in getattr(self, "_fds", {}).values():
            try:
                os.close(fd)
            except OSError:
                pass


def _crc32c_table() -> List[int]:
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


_CRC32C = _crc32c_table()


def _masked_crc32c(data: bytes) -> int:
    """The checksum TFRecord keeps of a record's length: CRC-32C, rotated and offset."""
    c = 0xFFFFFFFF
    for b in data:
        c = _CRC32C[(c ^ b) & 0xFF] ^ (c >> 8)
    c ^= 0xFFFFFFFF
    return (((c >> 15) | (c << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _index_records(path: str):
    """(payload offsets, lengths) of the records of one TFRecord file, from their headers."""
    offsets, lengths = [], []
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        pos = 0
        while pos < size:
            f.seek(pos)
            header = f.read(12)  # length (8 bytes, little-endian) and its masked CRC-32C (4)
            (crc,) = struct.unpack("<I", header[8:]) if len(header) == 12 else (None,)
            if crc != _masked_crc32c(header[:8]):
                raise ValueError(
                    f"RecordFiles: {path}: byte {pos} does not start a TFRecord record (its "
                    "length's checksum does not match). Is the file compressed? GZIP and ZLIB "
                    "TFRecord files have no random access: write them uncompressed")
            (n,) = struct.unpack("<Q", header[:8])
            if pos + 12 + n + 4 > size:
                raise ValueError(f"RecordFiles: {path} is cut short: the record at byte {pos} "
                                 f"needs {pos + 16 + n - size} bytes more than the file has")
            offsets.append(pos + 12)
            lengths.append(n)
            pos += 12 + n + 4
    return np.asarray(offsets, np.int64), np.asarray(lengths, np.int64)


def _keep_keras_from_fixing_epoch_length() -> None:
    """Keras (3.x) takes the number of steps of a dataset of unknown length from its first
    epoch and ends every later epoch after that many steps. An elastic epoch's step count
    changes with the batch size and the cluster size (and a joining worker's first epoch is only
    the rest of one), so for kungfu's datasets Keras must let the data end each epoch."""
    _internals.let_data_end_epochs(_is_elastic)


def _is_elastic(dataset) -> bool:
    return getattr(dataset, "_kungfu_elastic", False)


def shard(data, rank=None, size=None):
    """This worker's equal share of `data`, for plain model.fit or tf.data users: every worker
    gets the same number of samples, so the same number of steps (x[rank::size] does not: with
    10 samples on 4 workers, two get 3 and two get 2, and the workers with more steps wait for the
    others at the end of every epoch until the op deadline).

    data: an array, a tuple/list/dict of arrays of one length, or a tf.data.Dataset of known
    finite length (before batching). The first len - len % size samples are split by stride
    (worker r takes samples r, r + size, ...); the last len % size (fewer than size) are left
    out. For exact epochs without leaving any out, and batch sizes that change, use
    kf.ElasticData."""
    me = _peer.identity()
    rank = me.rank if rank is None else rank
    size = me.size if size is None else size
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} is not in a cluster of {size}")
    import tensorflow as tf

    if isinstance(data, tf.data.Dataset):
        n = int(data.cardinality())
        if n < 0:
            raise ValueError(
                "kf.shard needs a dataset of known, finite length (before .batch and without "
                ".repeat); give it one with dataset.apply(tf.data.experimental."
                "assert_cardinality(N)), or use kf.ElasticData")
        return data.take(n - n % size).shard(size, rank)
    if isinstance(data, dict):
        lengths = {k: len(v) for k, v in data.items()}
        arrays = dict(data)
    elif isinstance(data, (tuple, list)):
        lengths = {i: len(v) for i, v in enumerate(data)}
        arrays = None
    else:
        return _stride(data, len(data), rank, size)
    if len(set(lengths.values())) > 1:
        raise ValueError(f"kf.shard: the arrays differ in length: {lengths}")
    n = next(iter(lengths.values()), 0)
    if arrays is not None:
        return {k: _stride(v, n, rank, size) for k, v in arrays.items()}
    return type(data)(_stride(v, n, rank, size) for v in data)


def _stride(a, n: int, rank: int, size: int):
    return a[rank:n - n % size:size]


def validation_dataset(x, y=None, sample_weight=None, batch_size: int = 32):
    """Validation data for model.fit that stays right across resizes: a tf.data.Dataset of this
    worker's share of (x, y, sample_weight) in batches, the share taken again from the cluster as
    it is at every iteration (every validation). With kf.Hook combining the metrics over the
    workers, each sample is evaluated once per validation at any cluster size. (kf.shard's share
    is fixed when it is made: after a resize some samples would count twice and others not at
    all.) Shares differ by at most one sample; a worker whose share is empty (more workers than
    samples) evaluates nothing."""
    import tensorflow as tf

    batch_size = check_batch_size(batch_size)
    arrays = [np.asarray(a) for a in (x, y, sample_weight) if a is not None]
    n = len(arrays[0])
    if any(len(a) != n for a in arrays):
        raise ValueError(f"validation_dataset: x, y and sample_weight need one length, got "
                         f"{[len(a) for a in arrays]}")

    def batches():
        me = _peer.identity()
        share = np.array_split(np.arange(n), me.size)[me.rank]
        for start in range(0, len(share), batch_size):
            idx = share[start:start + batch_size]
            yield tuple(a[idx] for a in arrays)

    spec = tuple(tf.TensorSpec((None,) + a.shape[1:], tf.as_dtype(a.dtype)) for a in arrays)
    ds = tf.data.Dataset.from_generator(batches, output_signature=spec)
    ds._kungfu_elastic = True  # its number of batches changes with the cluster size
    _keep_keras_from_fixing_epoch_length()
    return ds
