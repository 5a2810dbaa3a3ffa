"""Collectives over many tensors for the optimizers and initializers (see ops._fusion)."""
from __future__ import annotations

from typing import Callable, List, NamedTuple, Optional, Sequence

import tensorflow as tf

from kungfu._adasum import adasum
from kungfu.tensorflow import ops
from kungfu.tensorflow.ops._fusion import fused_apply


def mean_over_workers(tensors: Sequence, prefix: str, bucket_bytes: Optional[int],
                      strategy=None, compression: Optional[str] = None) -> List[tf.Tensor]:
    """Sum over all workers divided by the cluster size read when the op runs; float16 and
    bfloat16 tensors are averaged by the runtime instead (ops.all_reduce's avg: each worker's
    part divided before the sum, so a mean that fits does even where the sum would not).

    compression "fp16": float32/float64 tensors travel as float16, each divided by the size
    before the cast (the float16 sum is the mean, so it overflows no sooner than the mean)."""
    if not tensors:
        return []
    size = ops.cluster_size()
    wide = [compression == "fp16" and t.dtype in (tf.float32, tf.float64) for t in tensors]
    half = [t.dtype in (tf.float16, tf.bfloat16) for t in tensors]
    sent = [tf.cast(t / tf.cast(size, t.dtype), tf.float16) if w else t
            for t, w in zip(tensors, wide)]
    summed = [t for t, h in zip(sent, half) if not h]
    sums = iter(ops.group_all_reduce(summed, op="sum", name=prefix, bucket_bytes=bucket_bytes,
                                     strategy=strategy) if summed else [])
    halves = [t for t, h in zip(sent, half) if h]
    means = iter(ops.group_all_reduce(halves, op="avg", name=f"{prefix}/mean",
                                      bucket_bytes=bucket_bytes, strategy=strategy)
                 if halves else [])
    return [next(means) if h else tf.cast(next(sums), t.dtype) if w
            else next(sums) / tf.cast(size, t.dtype)
            for t, w, h in zip(tensors, wide, half)]


def adasum_over_workers(tensors: Sequence, prefix: str) -> List[tf.Tensor]:
    """The Adasum of each tensor over the workers (kf.adasum, per tensor), computed by the numpy
    core in a tf.numpy_function: eager, in tf.function and in model.fit, not under XLA."""
    if not tensors:
        return []
    out = tf.numpy_function(lambda *arrays: adasum(list(arrays), name=prefix), list(tensors),
                            [t.dtype for t in tensors], stateful=True)
    for o, t in zip(out, tensors):
        o.set_shape(t.shape)
    return list(out)


def broadcast(tensors: Sequence, root: int, prefix: str, bucket_bytes: int) -> List[tf.Tensor]:
    return fused_apply(tensors, prefix, bucket_bytes,
                       lambda t, name: ops.broadcast(t, root=root, name=name))


class Averaged(NamedTuple):
    """Gradients averaged over the workers, for one step."""
    grads: list  # the gradients as given, each replaced by its average (None stays None)
    local: List[tf.Tensor]  # the dense local gradients that were averaged together
    averaged: List[tf.Tensor]  # their averages (what the gradient monitor compares)
    # What the gradient monitor began before the allreduce (GradientMonitor.start), or None.
    started: object = None
    # The loss scale the local and averaged gradients carry (mixed precision), or None.
    loss_scale: object = None


def average_gradients(grads: Sequence, prefix: str, bucket_bytes: Optional[int] = None,
                      strategy=None, compression: Optional[str] = None,
                      sparse_as_dense: bool = True,
                      before: Optional[Callable[[List[tf.Tensor]], object]] = None,
                      op: str = "average") -> Averaged:
    """The average over all workers of each gradient, as kf.Optimizer's sync-sgd applies it.

    IndexedSlices (embedding gradients) become dense tensors unless sparse_as_dense is False:
    workers touch different rows, and a dense sum is what every worker can agree on in size.
    Sparse ones are allgathered, the rows of every worker (exactly the dense result once
    applied). Dense ones go in one group allreduce (mean_over_workers, with compression).
    `before(local)` runs on the dense local gradients before they are sent (in eager mode the
    order of the calls is the order of the work). op "adasum": the dense gradients' Adasum
    instead of their average (adasum_over_workers)."""
    grads = list(grads)
    present = [i for i, g in enumerate(grads) if g is not None]
    sparse = [] if sparse_as_dense else [
        i for i in present if isinstance(grads[i], tf.IndexedSlices)]
    present = [i for i in present if i not in sparse]
    local = [tf.convert_to_tensor(grads[i]) for i in present]
    if before is not None:
        before(local)
    averaged = adasum_over_workers(local, f"{prefix}/adasum") if op == "adasum" else \
        mean_over_workers(local, f"{prefix}/grads", bucket_bytes, strategy, compression)
    for i in sparse:
        grads[i] = ops.all_reduce(grads[i], op="avg", name=f"{prefix}/sparse/{i}")
    for i, g in zip(present, averaged):
        grads[i] = g
    return Averaged(grads, local, averaged)
