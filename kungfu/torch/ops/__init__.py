"""Collectives over torch tensors (kungfu.torch.ops, as in the original KungFu)."""
from kungfu.torch.ops.collective import (
    Handle,
    agree_on,
    all_gather,
    all_reduce,
    all_reduce_async,
    all_reduce_fn,
    broadcast,
    broadcast_async,
    broadcast_parameters,
    inplace_all_reduce_async_op,
    inplace_all_reduce_op,
    wait_all_handles,
    wait_handle,
)

__all__ = [
    "Handle",
    "agree_on",
    "all_gather",
    "all_reduce",
    "all_reduce_async",
    "all_reduce_fn",
    "broadcast",
    "broadcast_async",
    "broadcast_parameters",
    "inplace_all_reduce_async_op",
    "inplace_all_reduce_op",
    "wait_all_handles",
    "wait_handle",
]
