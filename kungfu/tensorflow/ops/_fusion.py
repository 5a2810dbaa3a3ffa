"""Fusing many tensors into few collectives, with names fixed by position.

Tensors are grouped by dtype (in order of first appearance) and packed into buckets of about
`bucket_bytes`; a bucket's op is named "<prefix>/<dtype>/<index of its first tensor>", so the
names are the same on every worker that passes the same list, step after step. A tensor whose
shape is not fully known at trace time gets a bucket of its own and is not copied.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Sequence, Tuple

import tensorflow as tf


def buckets(tensors: Sequence[tf.Tensor], bucket_bytes: int) -> List[Tuple[tf.DType, List[int]]]:
    """[(dtype, [positions])] in a fixed order."""
    open_bucket: Dict[tf.DType, int] = {}
    sizes: List[int] = []
    out: List[Tuple[tf.DType, List[int]]] = []
    for i, t in enumerate(tensors):
        dt = t.dtype
        if not t.shape.is_fully_defined():
            out.append((dt, [i]))
            sizes.append(bucket_bytes)
            continue
        j = open_bucket.get(dt)
        if j is None or sizes[j] >= bucket_bytes:
            j = len(out)
            out.append((dt, []))
            sizes.append(0)
            open_bucket[dt] = j
        out[j][1].append(i)
        sizes[j] += t.shape.num_elements() * dt.size
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


