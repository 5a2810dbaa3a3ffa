"""Keras layers that compute across the workers.

SyncBatchNormalization: batch normalization whose training-time mean and variance are those of
the whole cluster's batch (every worker's examples), as Horovod's layer of that name; inference
uses the moving statistics as usual. Each step adds one small allreduce per layer (2 x channels
+ 1 values), named after the layer, so every worker must build the same layers in the same
order (layer names are then equal).

Keras's private hook for the statistics is reached through kungfu/tensorflow/_internals.py
(BatchNormalizationMoments).
"""
from __future__ import annotations

import keras
import tensorflow as tf

from kungfu.tensorflow import _internals, ops


@keras.saving.register_keras_serializable(package="kungfu")
class SyncBatchNormalization(_internals.BatchNormalizationMoments):
    """keras.layers.BatchNormalization with the cluster's batch statistics in training."""

    def moments(self, inputs, mask, axes):
        x = tf.cast(inputs, tf.float64)  # sums of squares over the cluster: keep the digits
        if mask is None:
            weights = tf.ones_like(x)
        else:
            weights = tf.broadcast_to(tf.cast(tf.expand_dims(mask, -1), tf.float64), tf.shape(x))
        local = tf.concat([tf.reshape(tf.reduce_sum(x * weights, axes), [-1]),
                           tf.reshape(tf.reduce_sum(x * x * weights, axes), [-1]),
                           tf.reshape(tf.reduce_sum(weights, axes), [-1])[:1]], axis=0)
        total = ops.all_reduce(local, op="sum", name=f"kungfu/sync_batch_norm/{self.name}")
        channels = tf.shape(local)[0] // 2
        count = tf.maximum(total[-1], 1.0)
        mean = total[:channels] / count
        variance = tf.maximum(total[channels:2 * channels] / count - mean * mean, 0.0)
        return tf.cast(mean, inputs.dtype), tf.cast(variance, inputs.dtype)


__all__ = ["SyncBatchNormalization"]
