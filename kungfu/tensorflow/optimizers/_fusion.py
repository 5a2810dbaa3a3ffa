"""Collectives over many tensors for the optimizers and initializers (see ops._fusion)."""
from __future__ import annotations

from typing import List, Optional, Sequence

import tensorflow as tf

from kungfu.tensorflow import ops
from kungfu.tensorflow.ops._fusion import fused_apply


def mean_over_workers(tensors: Sequence, prefix: str, bucket_bytes: Optional[int],
                      strategy=None, compression: Optional[str] = None) -> List[tf.Tensor]:
    """Sum over all workers divided by the cluster size read when the op runs.

    compression "fp16": float32/float64 tensors travel as float16, each divided by the size
    before the cast (the float16 sum is the mean, so it overflows no sooner than the mean)."""
    if not tensors:
        return []
    size = ops.cluster_size()
    if compression == "fp16":
        wide = [t.dtype in (tf.float32, tf.float64) for t in tensors]
        sent = [tf.cast(t / tf.cast(size, t.dtype), tf.float16) if w else t
                for t, w in zip(tensors, wide)]
        sums = ops.group_all_reduce(sent, op="sum", name=prefix, bucket_bytes=bucket_bytes,
                                    strategy=strategy)
        return [tf.cast(s, t.dtype) if w else s / tf.cast(size, s.dtype)
                for s, t, w in zip(sums, tensors, wide)]
    sums = ops.group_all_reduce(tensors, op="sum", name=prefix, bucket_bytes=bucket_bytes,
                                strategy=strategy)
    return [t / tf.cast(size, t.dtype) for t in sums]


def broadcast(tensors: Sequence, root: int, prefix: str, bucket_bytes: int) -> List[tf.Tensor]:
    return fused_apply(tensors, prefix, bucket_bytes,
                       lambda t, name: ops.broadcast(t, root=root, name=name))
