"""Collectives on device (CUDA) memory, by address: what kungfu.torch calls for CUDA tensors.

They run on the GPU backend this worker's peer was made with (kungfu._gpu: NCCL, or the staging
path through pinned host memory); without one they fail naming why there is none. Each takes
`stream`, the caller's CUDA stream (an int, e.g. torch's `current_stream().cuda_stream`; 0 the
default stream): the operation reads its inputs after the work queued there before it, and the
stream waits for its result before what is queued after the call. `keep`: what owns the memory
(a tensor), held until the operation completes.

Device operations run in the order this worker issues them, one at a time (NCCL's rule: every
worker issues them in the same order). Ops: sum, min, max, prod (an average is a sum the caller
divides)."""
from __future__ import annotations

from typing import Any, Optional

import numpy as np

from kungfu import _gpu, _native, _peer
from kungfu._collective import Handle, _dtype_code, _takes_part, _timeout_ms
from kungfu._process_set import ProcessSet, members as _members
from kungfu.errors import InvalidArgumentError

_OPS = ("sum", "min", "max", "prod")


def _op_code(op: str) -> int:
    if op not in _OPS:
        raise InvalidArgumentError(f"unknown reduce op {op!r} on device memory (choose "
                                   f"{', '.join(_OPS)}; an average is a sum divided by the size)")
    return _native.table("reduce_ops")[op]


def _count(count) -> int:
    if not isinstance(count, (int, np.integer)) or count < 0:
        raise InvalidArgumentError(f"count must be an int >= 0, got {count!r}")
    return int(count)


def _peer_with_gpu():
    peer = _peer.get()
    if not _gpu.nccl_available():
        raise InvalidArgumentError(f"no GPU backend serves device memory: {_gpu.show_nccl_version()}")
    return peer


def allreduce_async(send: int, recv: int, count: int, dtype, op: str = "sum",
                    name: Optional[str] = None, timeout: Optional[float] = None, stream: int = 0,
                    keep: Any = None, process_set: Optional[ProcessSet] = None) -> Handle:
    ranks = _members(process_set, "allreduce")
    with _takes_part("allreduce", name, timeout, ranks):
        code, n, o = _dtype_code(np.dtype(dtype)), _count(count), _op_code(op)
        peer = _peer_with_gpu()
    native = peer.allreduce_device(send, recv, n, code, o, name or "", _timeout_ms(timeout), False,
                                   ranks, stream, keep)
    return Handle(native, lambda: None)


def broadcast_async(send: int, recv: int, count: int, dtype, root: int = 0,
                    name: Optional[str] = None, timeout: Optional[float] = None, stream: int = 0,
                    keep: Any = None, process_set: Optional[ProcessSet] = None) -> Handle:
    ranks = _members(process_set, "broadcast")
    with _takes_part("broadcast", name, timeout, ranks):
        code, n = _dtype_code(np.dtype(dtype)), _count(count)
        peer = _peer_with_gpu()
    native = peer.broadcast_device(send, recv, n, code, int(root), name or "", _timeout_ms(timeout),
                                   ranks, stream, keep)
    return Handle(native, lambda: None)


def allgather_async(send: int, recv: int, count: int, dtype, name: Optional[str] = None,
                    timeout: Optional[float] = None, stream: int = 0, keep: Any = None,
                    process_set: Optional[ProcessSet] = None) -> Handle:
    """recv holds size x count elements: rank r's count elements at r x count."""
    ranks = _members(process_set, "allgather")
    with _takes_part("allgather", name, timeout, ranks):
        code, n = _dtype_code(np.dtype(dtype)), _count(count)
        peer = _peer_with_gpu()
    native = peer.allgather_device(send, recv, n, code, name or "", _timeout_ms(timeout), ranks,
                                   stream, keep)
    return Handle(native, lambda: None)


def reducescatter_async(send: int, recv: int, recv_count: int, dtype, op: str = "sum",
                        name: Optional[str] = None, timeout: Optional[float] = None,
                        stream: int = 0, keep: Any = None,
                        process_set: Optional[ProcessSet] = None) -> Handle:
    """send holds size x recv_count elements; recv gets this rank's block of their reduction."""
    ranks = _members(process_set, "reducescatter")
    with _takes_part("reducescatter", name, timeout, ranks):
        code, n, o = _dtype_code(np.dtype(dtype)), _count(recv_count), _op_code(op)
        peer = _peer_with_gpu()
    native = peer.reducescatter_device(send, recv, n, code, o, name or "", _timeout_ms(timeout),
                                       ranks, stream, keep)
    return Handle(native, lambda: None)


def alltoall_async(send: int, recv: int, count: int, dtype, name: Optional[str] = None,
                   timeout: Optional[float] = None, stream: int = 0, keep: Any = None,
                   process_set: Optional[ProcessSet] = None) -> Handle:
    """Block j (count elements) of send goes to rank j; block i of recv comes from rank i."""
    ranks = _members(process_set, "alltoall")
    with _takes_part("alltoall", name, timeout, ranks):
        code, n = _dtype_code(np.dtype(dtype)), _count(count)
        peer = _peer_with_gpu()
    native = peer.alltoall_device(send, recv, n, code, name or "", _timeout_ms(timeout), ranks,
                                  stream, keep)
    return Handle(native, lambda: None)
