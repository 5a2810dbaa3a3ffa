"""kungfu: adaptive distributed training for TensorFlow 2 and Keras 3.

This top-level package needs only numpy: collectives over numpy arrays and Python scalars, and
the worker's identity. Launch workers with `kungfu-run -np N python train.py`; a process started
without kungfu-run is rank 0 of a cluster of size 1.
"""
from __future__ import annotations

from kungfu import errors, timeline
from kungfu._collective import (
    Handle,
    allgather,
    allgather_async,
    allgather_object,
    allreduce,
    allreduce_async,
    alltoall,
    alltoall_async,
    barrier,
    broadcast,
    broadcast_async,
    broadcast_object,
    consensus,
    consensus_async,
    gather,
    gather_async,
    reduce,
    reduce_async,
    reducescatter,
    reducescatter_async,
)
from kungfu._adasum import adasum
from kungfu._join import Join, join
from kungfu._process_set import ProcessSet
from kungfu._version import __version__  # noqa: F401

from kungfu.elastic import ResizeError, detached, resize
from kungfu.policy import (
    BasePolicy,
    TrainingState,
    linear_scaled_lr,
    set_batch_size,
    set_batch_sizes,
    set_learning_rate,
    set_strategy,
    set_tree,
    sqrt_scaled_lr,
)


def _identity():
    from kungfu import _peer

    return _peer.identity()


def rank() -> int:
    """This worker's rank, 0 <= rank < size()."""
    return _identity().rank


def size() -> int:
    """The number of workers in the cluster."""
    return _identity().size


def local_rank() -> int:
    """This worker's index among the workers on its host."""
    return _identity().local_rank


def local_size() -> int:
    """The number of workers on this worker's host."""
    return _identity().local_size


def init() -> None:
    """Connects to every peer now (otherwise the first collective does). Idempotent."""
    from kungfu import _peer

    _peer.get()


# Names served by kungfu.tensorflow, imported on first access so that `import kungfu` alone
# never imports TensorFlow.
_TENSORFLOW_NAMES = {
    "Optimizer": "kungfu.tensorflow",
    "Compression": "kungfu.tensorflow",
    "DistributedGradientTape": "kungfu.tensorflow",
    "SyncBatchNormalization": "kungfu.tensorflow",
    "load_model": "kungfu.tensorflow",
    "BroadcastGlobalVariablesCallback": "kungfu.tensorflow",
    "broadcast_variables": "kungfu.tensorflow",
    "grad_noise_scale": "kungfu.tensorflow",
    "grad_noise_stats": "kungfu.tensorflow",
    "grad_variance": "kungfu.tensorflow",
    "Hook": "kungfu.tensorflow",
    "ElasticData": "kungfu.tensorflow",
    "MetricAverageCallback": "kungfu.tensorflow",
    "JoinCallback": "kungfu.tensorflow",
    "LearningRateWarmupCallback": "kungfu.tensorflow",
    "LearningRateScheduleCallback": "kungfu.tensorflow",
    "combine_metrics": "kungfu.tensorflow",
    "shard": "kungfu.tensorflow",
    "validation_dataset": "kungfu.tensorflow",
    "RecordFiles": "kungfu.tensorflow",
}


def __getattr__(name: str):
    module = _TENSORFLOW_NAMES.get(name)
    if module is None:
        raise AttributeError(f"module 'kungfu' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_TENSORFLOW_NAMES))


__all__ = [
    "errors",
    "timeline",
    "resize",
    "detached",
    "ResizeError",
    "BasePolicy",
    "TrainingState",
    "set_tree",
    "set_strategy",
    "set_batch_size",
    "set_batch_sizes",
    "set_learning_rate",
    "linear_scaled_lr",
    "sqrt_scaled_lr",
    "Handle",
    "init",
    "rank",
    "size",
    "local_rank",
    "local_size",
    "barrier",
    "ProcessSet",
    "allreduce",
    "allreduce_async",
    "reduce",
    "reduce_async",
    "broadcast",
    "broadcast_async",
    "allgather",
    "allgather_async",
    "gather",
    "gather_async",
    "consensus",
    "consensus_async",
    "alltoall",
    "alltoall_async",
    "reducescatter",
    "reducescatter_async",
    "broadcast_object",
    "allgather_object",
    "join",
    "adasum",
    "Join",
]
