"""`DistributedGradientTape`: a tf.GradientTape whose gradients are averaged over the workers.

For custom training loops, as Horovod's name of it:

    with tf.GradientTape() as tape:
        loss = loss_fn(y, model(x, training=True))
    tape = kf.DistributedGradientTape(tape)
    grads = tape.gradient(loss, model.trainable_variables)   # the average over all workers
    optimizer.apply_gradients(zip(grads, model.trainable_variables))   # a plain optimizer

The averaging is kf.Optimizer's sync-sgd (the same op names, buckets, compression and sparse
handling), so a loop must not use both on the same gradients: that would average twice.
"""
from __future__ import annotations

from typing import Optional

import tensorflow as tf

from kungfu.tensorflow.optimizers._core import validate_option
from kungfu.tensorflow.optimizers._fusion import average_gradients

DEFAULT_PREFIX = "kungfu/tape"


class DistributedGradientTape:
    """Wraps `tape` (a tf.GradientTape, before or after it recorded): `gradient()` returns the
    gradients averaged over all workers, in the structure of `sources`; everything else is the
    tape's own (watch, stop_recording, jacobian, ...).

    compression: "fp16" (or kf.Compression.fp16) sends float32/float64 gradients as float16;
        None (default): as they are.
    sparse_as_dense: True (default): IndexedSlices gradients are made dense and summed; False:
        every worker's rows are gathered (exactly the dense result once applied).
    op_prefix: the prefix of the collectives' names. Every worker must use the same; two tapes
        whose gradients are averaged at the same time (in one tf.function) need different ones.
    bucket_bytes, strategy: as kf.Optimizer's.
    Every worker must call gradient() with the same sources, in the same order.
    """

    def __init__(self, tape: tf.GradientTape, compression=None, sparse_as_dense: bool = True,
                 op_prefix: Optional[str] = None, bucket_bytes: Optional[int] = None,
                 strategy: Optional[str] = None):
        if not isinstance(tape, tf.GradientTape):
            raise TypeError(f"DistributedGradientTape wraps a tf.GradientTape, "
                            f"got {type(tape).__name__}")
        self._tape = tape
        self._compression = validate_option("compression", compression)
        self._sparse_as_dense = validate_option("sparse_as_dense", sparse_as_dense)
        self._prefix = validate_option("op_prefix", op_prefix) or DEFAULT_PREFIX
        self._bucket_bytes = validate_option("bucket_bytes", bucket_bytes)
        self._strategy = validate_option("strategy", strategy)

    def gradient(self, target, sources, output_gradients=None,
                 unconnected_gradients=tf.UnconnectedGradients.NONE):
        """tf.GradientTape.gradient, averaged over the workers (None stays None)."""
        grads = self._tape.gradient(target, sources, output_gradients=output_gradients,
                                    unconnected_gradients=unconnected_gradients)
        averaged = average_gradients(tf.nest.flatten(grads), self._prefix, self._bucket_bytes,
                                     self._strategy, self._compression, self._sparse_as_dense)
        return tf.nest.pack_sequence_as(grads, averaged.grads)

    def __enter__(self):
        self._tape.__enter__()
        return self

    def __exit__(self, *exc):
        return self._tape.__exit__(*exc)

    def __getattr__(self, name):
        # Only for what this class does not define: the rest of the tape's API. Before
        # __init__ set _tape (copy, pickle), there is no tape to ask.
        if name == "_tape":
            raise AttributeError(name)
        return getattr(self._tape, name)
