"""Names of the original KungFu's `kungfu.python` module, for programs written against it."""
from __future__ import annotations

import numpy as np

import kungfu as _kf


def current_rank() -> int:
    return _kf.rank()


def current_cluster_size() -> int:
    return _kf.size()


def current_local_rank() -> int:
    return _kf.local_rank()


def current_local_size() -> int:
    return _kf.local_size()


def run_barrier() -> None:
    _kf.barrier()


def all_reduce_int_max(x: int) -> int:
    """The maximum of an integer over all workers."""
    return int(_kf.allreduce(np.int64(x), op="max"))


def detached() -> bool:
    """Whether a resize removed this worker from the cluster."""
    from kungfu import elastic as _elastic

    return _elastic.detached()


def resize(n: int) -> bool:
    """KungFu's resize: asks for n workers (from a policy hook run by kf.Hook; see kf.resize)."""
    from kungfu import elastic as _elastic

    return _elastic.resize(n)


def propose_new_size(n: int) -> bool:
    """KungFu's name for asking for n workers; the same as resize(n) here."""
    return resize(n)


__all__ = [
    "current_rank",
    "current_cluster_size",
    "current_local_rank",
    "current_local_size",
    "run_barrier",
    "all_reduce_int_max",
    "detached",
    "resize",
    "propose_new_size",
]
