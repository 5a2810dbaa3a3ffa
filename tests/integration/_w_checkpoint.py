"""Worker bodies for test_checkpoint.py: a training loop over numpy arrays (kungfu._loop.Loop
with a binding of numpy variables), so that the checkpoint's checks run in real workers
without a framework."""
from __future__ import annotations

import os
import sys

import numpy as np

from kungfu import _collective, _peer
from kungfu._loop import Loop
from kungfu.elastic import CheckpointError, ElasticData

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/
from numpy_variables import NumpyVariables  # noqa: E402 - tests/numpy_variables.py


class ArrayLoop(Loop):
    face = "the numpy loop"

    def __init__(self, arrays, **kwargs):
        self._arrays = arrays
        super().__init__(**kwargs)

    def _binding(self):
        return NumpyVariables(self._arrays)


def _job(ckpt, samples, steps, **kwargs):
    """A job over `samples` samples of 4 features (per-worker batch 4, in order) that trains
    `steps` steps (or resumes from `ckpt` and trains them from there); returns its loop and
    weights. Each step subtracts the mean over the workers' batches."""
    x = np.arange(samples * 4, dtype=np.float32).reshape(samples, 4)
    data = ElasticData(x, batch_size=4, shuffle=False)
    w = np.zeros(4, np.float32)
    loop = ArrayLoop([w], data=data, name="ckpt/loop", checkpoint=ckpt, checkpoint_every=1,
                     **kwargs)
    loop.before_train()
    loop.before_epoch(0)
    batches = data.epoch_batches()
    for _ in range(steps):
        xb, weight = next(batches)
        loop.before_step()
        w -= _collective.allreduce((xb * weight[:, None]).mean(0), "avg", name="ckpt/grad")
        loop.after_step({})
    return loop, w


def _refused(fn):
    """fn's CheckpointError message ("" if it raised none: the test then fails, saying so)."""
    try:
        fn()
    except CheckpointError as e:
        return str(e)
    return ""


def checks(folder: str, key: str):
    """Every worker: (1) a job writes a keyed checkpoint after step 5 into a folder that does
    not exist yet; (2) a job on the same data resumes there; (3) a job on 32 samples (where
    the position, 40 samples into epoch 0, is past the end) is refused, naming both; (4) rank
    0 forges the file (a changed weight, its SHA-256 recomputed, unsigned): a job with the key
    (from KUNGFU_CHECKPOINT_KEY) refuses it; (5) the signed file, with no key: refused."""
    from kungfu.elastic import _checkpoint
    from kungfu.elastic._checkpoint_content import pack_commit, unpack_commit

    ckpt = os.path.join(folder, "made", "by", "kungfu", "job.ckpt")
    rank = _peer.identity().rank
    out = {}
    _, w = _job(ckpt, 160, 5, checkpoint_key=key)
    out["written"] = w.tolist()
    _collective.barrier("ckpt/1")
    loop, w = _job(ckpt, 160, 0, checkpoint_key=key)
    out["resumed"] = [loop.state.step, loop.data.offset, w.tolist()]
    _collective.barrier("ckpt/2")
    out["other data"] = _refused(lambda: _job(ckpt, 32, 1, checkpoint_key=key))
    _collective.barrier("ckpt/3")
    if rank == 0:
        got = unpack_commit(_checkpoint.read(ckpt, key))
        forged = pack_commit([np.full(4, 1e6, np.float32)], got["variables"], got["state"],
                             got["policies"], got["data"], got["data_spec"],
                             got["epochs_total"])
        with open(ckpt, "wb") as f:
            f.write(_checkpoint.encode(forged))
    _collective.barrier("ckpt/4")
    os.environ["KUNGFU_CHECKPOINT_KEY"] = key
    out["forged"] = _refused(lambda: _job(ckpt, 160, 1))
    del os.environ["KUNGFU_CHECKPOINT_KEY"]
    _collective.barrier("ckpt/5")
    if rank == 0:  # the job's own file again, signed
        _checkpoint.write(ckpt, pack_commit(got["arrays"], got["variables"], got["state"],
                                            got["policies"], got["data"], got["data_spec"],
                                            got["epochs_total"]), key)
    _collective.barrier("ckpt/6")
    out["no key"] = _refused(lambda: _job(ckpt, 160, 1))
    return out
