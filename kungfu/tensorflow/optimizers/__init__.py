"""Distributed optimizers for Keras 3 (KungFu-compatible names).

    opt = kf.Optimizer(keras.optimizers.SGD(0.1))                      # synchronous SGD
    opt = kf.Optimizer(keras.optimizers.Adam(), algorithm="sma", alpha=0.1)
    opt = kf.Optimizer(keras.optimizers.SGD(0.1), algorithm="pair-averaging")

The KungFu names are thin functions over `Optimizer`: SynchronousSGDOptimizer,
SynchronousAveragingOptimizer, PairAveragingOptimizer, and the monitoring ones,
MonitorGradientNoiseScaleOptimizer and MonitorGradientVarianceOptimizer (synchronous SGD with
monitor="gns" or "variance").
"""
from __future__ import annotations

from typing import Optional

import tensorflow as tf

from kungfu._compression import FP16Compression, NoCompression
from kungfu.tensorflow.optimizers._core import ALGORITHMS, Optimizer


def _to_half(tensor):
    tensor = tf.convert_to_tensor(tensor)
    if tensor.dtype.is_floating:
        return tf.cast(tensor, tf.float16), tensor.dtype
    return tensor, None


class Compression:
    """Horovod's names for kf.Optimizer(..., compression=...): strings ("none", "fp16") that
    also compress and decompress a tensor as Horovod's do."""
    none = NoCompression()
    fp16 = FP16Compression(_to_half, tf.cast)


def _unsupported(**flags):
    on = [k for k, v in flags.items() if v]
    if on:
        raise NotImplementedError(f"option(s) {on} are not available in this build of kungfu")


def SynchronousSGDOptimizer(optimizer, name: Optional[str] = None, nccl: bool = False,
                            nccl_fusion: bool = True, hierarchical_nccl: bool = False,
                            monitor: bool = False, use_locking: bool = False,
                            with_keras: bool = False, **options):
    """Synchronous SGD: gradients averaged over all workers before they are applied.

    `name`, `nccl_fusion`, `use_locking` and `with_keras` are accepted for compatibility and
    change nothing (gradients are always fused into buckets); `nccl`, `hierarchical_nccl` and
    `monitor` are not available yet. Other options go to `Optimizer`.
    """
    del name, nccl_fusion, use_locking, with_keras
    _unsupported(nccl=nccl, hierarchical_nccl=hierarchical_nccl, monitor=monitor)
    return Optimizer(optimizer, algorithm="sync-sgd", **options)


def SynchronousAveragingOptimizer(optimizer, name: Optional[str] = None, alpha: float = 0.1,
                                  use_locking: bool = False, with_keras: bool = False,
                                  **options):
    """Synchronous model averaging: each step pulls the model towards the workers' average
    (v <- v + alpha * (avg(v) - v)), then applies the local gradients."""
    del name, use_locking, with_keras
    return Optimizer(optimizer, algorithm="sma", alpha=alpha, **options)


def PairAveragingOptimizer(optimizer, fuse_requests: bool = True,
                           fused_model_name: Optional[str] = None, name: Optional[str] = None,
                           use_locking: bool = False, with_keras: bool = False, **options):
    """Pair averaging (AD-PSGD): each step averages the model with one random other worker's
    saved model, applies the local gradients, then saves the model for the others.

    `fused_model_name` sets the prefix of the saved model's blob names (op_prefix); the model
    is always fetched fused (one request per dtype), whatever `fuse_requests` says.
    """
    del fuse_requests, name, use_locking, with_keras
    if fused_model_name is not None:
        options.setdefault("op_prefix", fused_model_name)
    return Optimizer(optimizer, algorithm="pair-averaging", **options)


def MonitorGradientNoiseScaleOptimizer(optimizer, device_batch_size, monitor_interval: int = 1,
                                       name: Optional[str] = None, use_locking: bool = False,
                                       with_keras: bool = False, alpha: float = 0.9, **options):
    """Synchronous SGD that estimates the gradient noise scale every `monitor_interval` steps
    (read it with kf.grad_noise_scale()). `device_batch_size` is this worker's batch size,
    `alpha` the EMA decay."""
    del name, use_locking, with_keras
    return Optimizer(optimizer, algorithm="sync-sgd", monitor="gns",
                     batch_size=device_batch_size, monitor_interval=monitor_interval,
                     monitor_decay=alpha, **options)


def MonitorGradientVarianceOptimizer(optimizer, monitor_interval: int = 1,
                                     name: Optional[str] = None, use_locking: bool = False,
                                     with_keras: bool = False, alpha: float = 0.9, **options):
    """Synchronous SGD that estimates the gradient variance every `monitor_interval` steps
    (read it with kf.grad_variance()); `alpha` is the EMA decay."""
    del name, use_locking, with_keras
    return Optimizer(optimizer, algorithm="sync-sgd", monitor="variance",
                     monitor_interval=monitor_interval, monitor_decay=alpha, **options)


__all__ = [
    "Compression",
    "MonitorGradientNoiseScaleOptimizer",
    "MonitorGradientVarianceOptimizer",
    "ALGORITHMS",
    "Optimizer",
    "SynchronousSGDOptimizer",
    "SynchronousAveragingOptimizer",
    "PairAveragingOptimizer",
]
