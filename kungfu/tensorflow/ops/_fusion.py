"""Collectives over many tensors, with names fixed by position.

Tensors are grouped by dtype (in order of first appearance) and, when `bucket_bytes` is given,
split into buckets of about `bucket_bytes`; a bucket's op is named "<prefix>/<dtype>/<index of
its first tensor>", so the names are the same on every worker that passes the same list, step
after step.

`grouped_apply` runs one list collective per bucket (KungfuGroupAllReduce: the tensors are
reduced where they lie, nothing is concatenated). `fused_apply` concatenates each bucket into one
tensor for a collective of one tensor (broadcast) and splits the result; there a tensor whose
shape is not fully known at trace time gets a bucket of its own and is not copied.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence, Tuple

import tensorflow as tf


def buckets(tensors: Sequence[tf.Tensor], bucket_bytes: Optional[int],
            copies: bool = True) -> List[Tuple[tf.DType, List[int]]]:
    """[(dtype, [positions])] in a fixed order. bucket_bytes None: one bucket per dtype.
    copies: the bucket will be concatenated, so a tensor of unknown shape goes alone."""
    open_bucket: Dict[tf.DType, int] = {}
    sizes: List[int] = []
    out: List[Tuple[tf.DType, List[int]]] = []
    for i, t in enumerate(tensors):
        dt = t.dtype
        if copies and not t.shape.is_fully_defined():
            out.append((dt, [i]))
            sizes.append(bucket_bytes)
            continue
        j = open_bucket.get(dt)
        if j is None or (bucket_bytes is not None and sizes[j] >= bucket_bytes):
            j = len(out)
            out.append((dt, []))
            sizes.append(0)
            open_bucket[dt] = j
        out[j][1].append(i)
        if t.shape.is_fully_defined():
            sizes[j] += t.shape.num_elements() * dt.size
    return out


def grouped_apply(tensors: Sequence, prefix: str, bucket_bytes: Optional[int],
                  collective: Callable[[List[tf.Tensor], str], List[tf.Tensor]]) -> List[tf.Tensor]:
    """collective(bucket's tensors, name) on every bucket; the results in the order given."""
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    out: List[tf.Tensor] = [None] * len(tensors)  # type: ignore[list-item]
    for dt, members in buckets(tensors, bucket_bytes, copies=False):
        results = collective([tensors[i] for i in members], f"{prefix}/{dt.name}/{members[0]}")
        for i, r in zip(members, results):
            out[i] = r
    return out


def fused_apply(tensors: Sequence, prefix: str, bucket_bytes: int,
                collective: Callable[[tf.Tensor, str], tf.Tensor]) -> List[tf.Tensor]:
    """collective(fused, name) on every bucket; the results split back, in the order given."""
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    out: List[tf.Tensor] = [None] * len(tensors)  # type: ignore[list-item]
    for dt, members in buckets(tensors, bucket_bytes):
        name = f"{prefix}/{dt.name}/{members[0]}"
        if len(members) == 1:
            out[members[0]] = collective(tensors[members[0]], name)
            continue
        shapes = [tensors[i].shape for i in members]
        fused = collective(tf.concat([tf.reshape(tensors[i], [-1]) for i in members], 0), name)
        parts = tf.split(fused, [s.num_elements() for s in shapes])
        for i, p, s in zip(members, parts, shapes):
            out[i] = tf.reshape(p, s)
    return out


