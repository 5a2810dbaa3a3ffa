"""Names of the original KungFu's `kungfu.python` module, for programs written against it."""
from __future__ import annotations

import numpy as np

from kungfu import _collective, _peer, elastic as _elastic
from kungfu.elastic._protocol import broadcast_blob
from kungfu.store import ClusterConfig, StoreError


def current_rank() -> int:
    return _peer.identity().rank


def current_cluster_size() -> int:
    return _peer.identity().size


def current_local_rank() -> int:
    return _peer.identity().local_rank


def current_local_size() -> int:
    return _peer.identity().local_size


def run_barrier() -> None:
    _collective.barrier()


def all_reduce_int_max(x: int) -> int:
    """The maximum of an integer over all workers."""
    return int(_collective.allreduce(np.int64(x), op="max"))


def detached() -> bool:
    """Whether a resize removed this worker from the cluster."""
    return _elastic.detached()


_proposed = None  # propose_new_size outside kf.Hook: the size the next resize() asks for


def resize(n=None):
    """KungFu's resize: asks for n workers and returns (changed, detached).

    From a policy hook run by kf.Hook it is kf.resize(n) (applied by the Hook at the step
    boundary: (True, False) when it was asked for). In a custom loop without a Hook it is a
    collective that every worker calls at the same point (see kf.resize); without n it resizes
    to the size given to propose_new_size (the lowest proposing rank's), else to the cluster
    PUT into the config store from outside the job (KungFu's resize_cluster_from_url;
    docs/elastic.md); nothing changes when there is neither."""
    global _proposed
    if n is not None:
        return _elastic.resize(n), _elastic.detached()
    if _elastic.in_round():
        raise TypeError("resize() needs the new size inside a policy hook: resize(n)")
    mine, _proposed = _proposed, None
    sizes = _collective.allgather(np.array([-1 if mine is None else mine], np.int64),
                          name="kungfu/python/proposed-size")
    wanted = [int(s) for s in sizes if s >= 0]
    if wanted:
        changed = _elastic.resize_now(wanted[0], agreed=True)
        return changed, _elastic.detached()
    request = _outside_request()
    if request is None:
        return False, False
    changed = _elastic.resize_now(len(request.peers), agreed=True, request=request.to_json())
    return changed, _elastic.detached()


def _outside_request():
    """The cluster asked for from outside the job (a PUT to the config store), as every worker
    learns it from rank 0; None when there is none (or the job is not elastic)."""
    ctx = _elastic.context()
    if not ctx.enabled:
        return None
    blob = b""
    if _peer.identity().rank == 0:
        try:
            new = ctx.take_request()
        except StoreError as e:  # the others wait in the broadcast: go on without
            import warnings

            warnings.warn(f"kungfu: cannot read the config store: {e}")
            new = None
        blob = b"" if new is None else new.to_json().encode()
    blob = broadcast_blob(blob, f"kungfu/python/{ctx.current.version}/request")
    return ClusterConfig.from_json(blob.decode()) if blob else None


def propose_new_size(n: int) -> None:
    """KungFu's proposal of a cluster size. In a policy hook run by kf.Hook it is kf.resize(n);
    in a custom loop it is applied by the next resize() without an argument, which every
    worker calls at the same point."""
    global _proposed
    if _elastic.in_round():
        _elastic.resize(n)
        return
    _proposed = _elastic.context().check_size(n)


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
