"""Elastic data: training samples addressed by global offset, batch size changeable per step.
Framework-neutral (numpy batches): kungfu.tensorflow.data adds tf.data datasets of its batches
for model.fit, kungfu.torch iterates epoch_batches() in its loop.

    data = ElasticData(x, y, batch_size=32)               # per-worker batch size
    for x, y, w in data.epoch_batches(): ...               # this worker's batches of an epoch

Each epoch has one global order of the samples (a permutation seeded by (seed, epoch), the same
on every worker). Step s consumes the next slice of that order, of the global batch
(local batch size x workers, fewer at the end of the epoch); worker r takes the r-th part of the
slice. So every sample of an epoch is used exactly once, whatever batch sizes the steps had, and
every worker's epoch has the same number of steps.

Batches come as (x, y, sample_weight). The weights make the averaged gradient exactly the mean over
the slice even when parts differ in size (at the end of an epoch): a sample of a part of p
samples, in a slice of L over n workers, weighs n p / L (1 when all parts are equal). A worker
whose part is empty gets one sample of weight 0.

The samples come from in-memory arrays, arrays on disk (np.memmap), a random-access source
(kf.RecordFiles over TFRecord files: each worker reads only its part), or a tf.data.Dataset of
single samples, read as a stream: every worker reads the whole stream of each epoch in the same
order and keeps its part of each step's slice, so epochs stay exact and steps equal on every
worker at any size (the cost: each worker reads all the data).

In model.fit with a Hook, batch s is made only once the Hook has released step s (after the
decisions of step s - 1 were applied), so tf.data's read-ahead cannot make a batch with an
outdated size. Use steps_per_execution=1 (the default). In a custom loop, iterate
`epoch_batches()`: each batch is made when the loop asks for it.
"""
from __future__ import annotations

import atexit
import threading
import time
from typing import List, Optional, Sequence

import numpy as np

from kungfu import _env, _peer
from kungfu.elastic._actions import check_batch_size

RELEASE_TIMEOUT = 600.0  # seconds a batch waits for the Hook to release its step


def _is_source(x) -> bool:
    """A random-access source: an object with __len__ and read(indices) (see ElasticData)."""
    return (not isinstance(x, np.ndarray) and callable(getattr(x, "read", None))
            and hasattr(x, "__len__"))


class _Stream:
    """The samples of a tf.data.Dataset, read in order, addressed by their position in an
    epoch's stream. The dataset is iterated anew each epoch (shuffled first, with a seed of
    (seed, epoch), when a shuffle buffer is given); the samples of the last slice read are
    kept, so a step can be made again (after a failure), and an earlier position restarts the
    epoch's stream and skips to it (a joiner, a rollback)."""

    def __init__(self, dataset, shuffle_buffer: int, seed: int):
        self.dataset = dataset
        self.shuffle_buffer = shuffle_buffer
        self.seed = seed
        self.lengths = {}  # epoch -> its number of samples, once its stream ended
        self._epoch = None
        self._it = None
        self._pos = 0  # position of the next sample of self._it
        self._start = 0  # position of self._kept[0]
        self._kept: list = []

    def _restart(self, epoch: int) -> None:
        ds = self.dataset
        if self.shuffle_buffer:
            seed = int(np.random.default_rng([self.seed, epoch]).integers(2 ** 31))
            ds = ds.shuffle(self.shuffle_buffer, seed=seed, reshuffle_each_iteration=False)
        self._it = iter(ds.as_numpy_iterator())
        self._epoch, self._pos, self._start, self._kept = epoch, 0, 0, []

    def positions(self, epoch: int, start: int, stop: int) -> np.ndarray:
        """The positions in [start, stop) that epoch's stream has (fewer at its end); the
        samples there stay available to samples() until a later start."""
        if epoch != self._epoch or start < self._start:
            self._restart(epoch)
        drop = min(start - self._start, len(self._kept))
        del self._kept[:drop]
        self._start += drop
        end = self.lengths.get(epoch)
        stop = stop if end is None else min(stop, end)
        while self._pos < stop:
            try:
                sample = next(self._it)
            except StopIteration:
                self.lengths[epoch] = self._pos
                break
            if self._pos >= start:
                self._kept.append(sample)
            else:
                self._start = self._pos + 1
            self._pos += 1
        return np.arange(start, max(start, min(stop, self._pos)), dtype=np.int64)

    def samples(self, positions: np.ndarray) -> tuple:
        """The samples at these positions (from the last slice read), as batch arrays."""
        rows = [self._kept[int(p) - self._start] for p in positions]
        if not isinstance(rows[0], tuple):
            return (np.stack(rows),)
        return tuple(np.stack([r[i] for r in rows]) for i in range(len(rows[0])))


def _apportion(total: int, weights: Sequence[int]) -> List[int]:
    """`total` split in proportion to `weights` (largest remainders; ties to the lower rank):
    equal weights split as np.array_split does."""
    whole = sum(weights)
    shares = [total * w // whole for w in weights]
    left = total - sum(shares)
    order = sorted(range(len(weights)), key=lambda i: (-(total * weights[i] % whole), i))
    for i in order[:left]:
        shares[i] += 1
    return shares


def _emulated_compute():
    """(seconds per sample, [(from batch, factor)] of this worker, jitter) from
    KUNGFU_SAMPLE_TIME, KUNGFU_SLOWDOWN and KUNGFU_SAMPLE_JITTER (kungfu/_env.py), or None: no
    emulated compute."""
    seconds = _env.SAMPLE_TIME.get()
    if seconds <= 0:
        return None
    rank = _peer.identity_from_env().rank  # the rank this worker started as
    jitter = _env.SAMPLE_JITTER.get()
    if jitter >= 1:
        raise ValueError(f"KUNGFU_SAMPLE_JITTER must be below 1, got {jitter}")
    return (seconds, [(step, f) for r, f, step in _env.SLOWDOWN.get() if r == rank], jitter)


def _is_dataset(x) -> bool:
    return type(x).__module__.startswith("tensorflow") and hasattr(x, "as_numpy_iterator")


def describe_data(spec: dict) -> str:
    """ElasticData.describe's record in words: "80 samples of float32[4] and int64[] (arrays,
    in order)"."""
    n = "an unknown number of" if spec.get("samples") is None else spec["samples"]
    parts = " and ".join(f"{dtype}{shape}" for dtype, shape in spec.get("sample", []))
    return f"{n} samples of {parts or 'unknown shape'} ({spec.get('source')}, {spec.get('order')})"


def data_mismatch(recorded: dict, ours: dict) -> bool:
    """Whether data described as `ours` is other data than `recorded` (ElasticData.describe):
    another number of samples (where both are known), source, sample shape or order."""
    known = recorded.get("samples") is not None and ours.get("samples") is not None
    return ((known and recorded["samples"] != ours["samples"])
            or any(recorded.get(k) != ours.get(k) for k in ("source", "order", "sample")))


class ElasticData:
    """Samples served as per-worker batches by global sample offset. `x` (and `y`) are arrays
    (an np.memmap too: nothing is copied but each batch), or `x` is a random-access source:
    an object with `__len__` and `read(indices)`, which returns the samples at those indices
    (an array, or a tuple such as (features, labels), each with len(indices) rows), e.g.
    kf.RecordFiles over TFRecord files. Only the samples of each batch are read.

    Or `x` is a tf.data.Dataset of single samples (an array or a tuple such as (features,
    label); not batched, not repeated), which must yield the same samples in the same order on
    every worker (no sharding, no unseeded shuffle): it is read as a stream (module doc).
    `shuffle_buffer=N` shuffles each epoch's stream with tf.data's shuffle buffer of N samples,
    seeded by (seed, epoch); `shuffle` applies to arrays and sources, which are permuted
    whole. Only the current step's slice is held in memory."""

    def __init__(self, x, y=None, batch_size: int = 32, shuffle: bool = True, seed: int = 0,
                 record: bool = False, shuffle_buffer: int = 0):
        self.stream: Optional[_Stream] = None
        if _is_dataset(x):
            if y is not None:
                raise ValueError("ElasticData: with a tf.data.Dataset, y must be None: the "
                                 "dataset's elements carry the labels")
            if int(x.cardinality()) == -1:  # tf.data.INFINITE_CARDINALITY
                raise ValueError("ElasticData: the dataset is infinite (.repeat()?): give it "
                                 "one epoch of samples; ElasticData makes the epochs")
            if isinstance(shuffle_buffer, bool) or not isinstance(shuffle_buffer, int) \
                    or shuffle_buffer < 0:
                raise ValueError(f"ElasticData: shuffle_buffer must be an int >= 0, got "
                                 f"{shuffle_buffer!r}")
            self.stream = _Stream(x, shuffle_buffer, int(seed))
            self.source, self.x, self.y = None, None, None
        elif shuffle_buffer:
            raise ValueError("ElasticData: shuffle_buffer is for a tf.data.Dataset; arrays and "
                             "sources are shuffled whole (shuffle=True)")
        elif _is_source(x):
            if y is not None:
                raise ValueError("ElasticData: with a source (x has read()), y must be None: the "
                                 "source returns the labels with the features")
            self.source, self.x, self.y = x, None, None
        else:
            self.source = None
            self.x = np.asarray(x)
            self.y = None if y is None else np.asarray(y)
            if self.y is not None and len(self.y) != len(self.x):
                raise ValueError(f"x has {len(self.x)} samples, y has {len(self.y)}")
        if self.stream is not None:
            if self.stream.positions(0, 0, 1).size == 0:
                raise ValueError("no samples")
            first = self.stream._kept[0]
            parts = first if isinstance(first, tuple) else (first,)
            if not all(isinstance(p, (np.ndarray, np.generic)) for p in parts):
                raise ValueError(f"ElasticData: the dataset's elements must be an array or a "
                                 f"tuple of arrays such as (features, label), got "
                                 f"{type(first).__name__}: map them to a tuple first")
            self._sample = self.stream.samples(np.arange(1))
        elif len(self) == 0:
            raise ValueError("no samples")
        else:
            # What one sample looks like (shapes and dtypes of the batches' parts).
            self._sample = self._fetch(np.arange(1))
        self.batch_size = check_batch_size(batch_size)
        self.batch_sizes: Optional[List[int]] = None  # per worker (set_batch_sizes)
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.epoch = 0  # the epoch being served
        self.offset = 0  # samples of this epoch already served, over all workers
        self.last_length = 0  # samples over all workers in the last batch made
        self.record = record
        self.served: List[np.ndarray] = []  # this worker's sample indices per step (if record)
        self._cv = threading.Condition()
        # With a Hook: the last (epoch since attach, step in epoch) it released, and this
        # object's epoch when it was attached.
        self._attached = False
        self._released = (-1, -1)
        self._base_epoch = 0
        self._closed = False  # the process is exiting: generators stop
        self._made = 0  # batches made (step_batch calls), for the emulated slowdown
        self._emulated = _emulated_compute()

    def __len__(self) -> int:
        """The number of samples of an epoch (of a stream: once its first epoch was read)."""
        if self.stream is not None:
            n = self.stream.lengths.get(0, next(iter(self.stream.lengths.values()), None))
            if n is None:
                raise TypeError("ElasticData over a tf.data.Dataset: its length is known once "
                                "its first epoch was read")
            return n
        return len(self.source) if self.source is not None else len(self.x)

    def describe(self) -> dict:
        """What the data is, as a checkpoint records it (data_mismatch): its number of samples
        (None: a stream whose length is not known yet), where they come from, what one sample
        looks like and the order they are served in: a data position means nothing in other
        data."""
        try:
            n = len(self)
        except TypeError:
            n = None
        if self.stream is not None:
            source = "a tf.data stream"
            order = (f"shuffle buffer {self.stream.shuffle_buffer}, seed {self.seed}"
                     if self.stream.shuffle_buffer else "in order")
        else:
            source = "arrays" if self.source is None else type(self.source).__name__
            order = f"shuffled, seed {self.seed}" if self.shuffle else "in order"
        return {"samples": n, "source": source, "order": order,
                "sample": [[p.dtype.name, list(p.shape[1:])] for p in self._sample]}

    def sample(self) -> tuple:
        """One sample's parts as batches of one (what the batches' parts look like)."""
        return self._sample

    def epoch_done(self, offset: Optional[int] = None) -> bool:
        """Whether no sample of the current epoch is left at `offset` (default: the position)."""
        offset = self.offset if offset is None else offset
        if self.stream is not None:
            return self.stream.positions(self.epoch, offset, offset + 1).size == 0
        return offset >= len(self)

    def _fetch(self, idx: np.ndarray) -> tuple:
        """The samples at these indices: (x,) or (x, y), or what the source returns (for a
        stream: positions of the slice read last)."""
        if self.stream is not None:
            return self.stream.samples(idx)
        if self.source is None:
            return (self.x[idx],) if self.y is None else (self.x[idx], self.y[idx])
        got = self.source.read(idx)
        parts = tuple(got) if isinstance(got, (tuple, list)) else (got,)
        parts = tuple(np.asarray(p) for p in parts)
        bad = [len(p) for p in parts if len(p) != len(idx)]
        if bad:
            raise ValueError(f"ElasticData: {type(self.source).__name__}.read of {len(idx)} "
                             f"indices returned {bad[0]} rows")
        return parts

    def set_batch_size(self, b: int) -> None:
        """Every worker's batch size from the next batch made on (the same on every worker:
        kf.Hook applies the agreed one)."""
        self.batch_size = check_batch_size(b)
        self.batch_sizes = None

    def set_batch_sizes(self, sizes: Sequence[int]) -> None:
        """Each worker's own batch size (sizes[rank]) from the next batch made on, while the
        cluster has len(sizes) workers; after a resize every worker uses batch_size again."""
        self.batch_sizes = [check_batch_size(b) for b in sizes]

    def order(self, epoch: int) -> np.ndarray:
        """The global order of the samples in `epoch` (arrays and sources)."""
        n = len(self)
        if not self.shuffle:
            return np.arange(n)
        cached = getattr(self, "_order", None)
        if cached is None or cached[0] != (self.seed, epoch):
            cached = self._order = ((self.seed, epoch),
                                    np.random.default_rng([self.seed, epoch]).permutation(n))
        return cached[1]

    def sizes(self, size: int) -> List[int]:
        """Every worker's batch size in a cluster of `size`: set_batch_sizes' split when it was
        given for this size, else batch_size each."""
        if self.batch_sizes is not None and len(self.batch_sizes) == size:
            return list(self.batch_sizes)
        return [self.batch_size] * size

    def part(self, offset: int, rank: int, size: int):
        """(indices, weight, slice length) of worker `rank`'s part of the step at `offset` of
        the current epoch: indices into the samples (of a stream: positions in its epoch). The
        slice (the sum of the workers' batch sizes, fewer at the epoch's end) is split in
        proportion to their batch sizes."""
        sizes = self.sizes(size)
        want = sum(sizes)
        if self.stream is not None:
            ids = self.stream.positions(self.epoch, offset, offset + want)
        else:
            ids = self.order(self.epoch)[offset:offset + want]
        length = len(ids)
        shares = sizes if length == want else _apportion(length, sizes)
        start = sum(shares[:rank])
        piece = ids[start:start + shares[rank]]
        if piece.size == 0:
            return ids[:1], 0.0, length
        return piece, size * piece.size / length, length

    # -- the Hook's side ------------------------------------------------------------------------

    @property
    def attached(self) -> bool:
        return self._attached

    def attach(self) -> None:
        """Called by the Hook when training begins: from now on batches wait for release()."""
        # A generator waiting for its release would hold up the interpreter's exit (TensorFlow
        # waits for it when it destroys the iterator) if training ended with an exception.
        atexit.register(self.close)
        with self._cv:
            self._attached = True
            self._released = (-1, -1)
            self._base_epoch = self.epoch

    def detach(self) -> None:
        with self._cv:
            self._attached = False
            self._cv.notify_all()

    def close(self) -> None:
        """Ends every generator of this data (they return at their next batch)."""
        with self._cv:
            self._closed = True
            self._attached = False
            self._cv.notify_all()

    def release(self, epoch: int, step_in_epoch: int) -> None:
        """Allows the batch of step `step_in_epoch` of the Hook's epoch `epoch` (0: the first
        epoch since attach) to be made."""
        with self._cv:
            self._released = max(self._released, (epoch, step_in_epoch))
            self._cv.notify_all()

    def _wait_for(self, step: int) -> None:
        def released():
            return not self._attached or self._released >= (self.epoch - self._base_epoch, step)

        with self._cv:
            if not self._cv.wait_for(released, RELEASE_TIMEOUT):
                raise RuntimeError(
                    f"kungfu data: step {step} of epoch {self.epoch} was not released by kf.Hook "
                    f"within {RELEASE_TIMEOUT:.0f} s (is the Hook in model.fit's callbacks, and "
                    "steps_per_execution 1?)")

    # -- iteration ------------------------------------------------------------------------------

    def commit(self) -> int:
        """Moves past the step just trained (called by the Hook in model.fit, by the generator
        itself otherwise): returns the step's samples over all workers."""
        me = _peer.identity()
        idx, weight, length = self.part(self.offset, me.rank, me.size)
        self.offset += length
        self.last_length = length
        if self.record:
            self.served.append(idx if weight > 0 else idx[:0])
        return length

    def next_epoch(self) -> None:
        with self._cv:
            self.epoch += 1
            self.offset = 0

    def epoch_batches(self):
        """Yields this worker's (x, y, sample_weight) batches of one epoch, then moves on to the
        next epoch.

        Under a Hook in model.fit (attached), a batch is only made once its step is released,
        and the position is moved by the Hook (commit, next_epoch) as steps are trained: tf.data
        may run a generator ahead, or start one that Keras then drops, and neither may move the
        position."""
        step = 0
        while True:
            self._wait_for(step)
            if self._closed:
                return
            if self.epoch_done():
                break
            batch = self.step_batch()
            if not self._attached:
                self.commit()
            yield batch
            step += 1
        if not self._attached:
            self.next_epoch()

    def step_batch(self):
        """This worker's (x, y, sample_weight) batch of the step at the current position (kf.Hook
        redoes a step with it after a failure); leaves the position alone."""
        me = _peer.identity()
        idx, weight, _ = self.part(self.offset, me.rank, me.size)
        batch = (*self._fetch(idx), np.full(len(idx), weight, dtype=np.float32))
        if self._emulated is not None:
            seconds, factors, jitter = self._emulated
            factor = next((f for step, f in reversed(factors) if step <= self._made), 1.0)
            if jitter:
                factor *= 1 + jitter * (2 * np.random.random() - 1)
            time.sleep(seconds * factor * len(idx) * (weight > 0))
        self._made += 1
        return batch
