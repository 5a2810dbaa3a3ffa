"""Collectives over many tensors for the optimizers and initializers (see ops._fusion)."""
from __future__ import annotations

from typing import List, Optional, Sequence

import tensorflow as tf

from kungfu.tensorflow import ops
from kungfu.tensorflow.ops._fusion import fused_apply


def mean_over_workers(tensors: Sequence, prefix: str, bucket_bytes: Optional[int],
                      strategy=None) -> List[tf.Tensor]:
    """Sum over all workers divided by the cluster size read when the op runs."""
    if not tensors:
        return []
    size = ops.cluster_size()
    sums = ops.group_all_reduce(tensors, op="sum", name=prefix, bucket_bytes=bucket_bytes,
                                strategy=strategy)
    return [t / tf.cast(size, t.dtype) for t in sums]


def broadcast(tensors: Sequence, root: int, prefix: str, bucket_bytes: int) -> List[tf.Tensor]:
    return fused_apply(tensors, prefix, bucket_bytes,
                       lambda t, name: ops.broadcast(t, root=root, name=name))
