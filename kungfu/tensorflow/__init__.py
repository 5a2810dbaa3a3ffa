"""kungfu for TensorFlow 2 / Keras 3: ops, distributed optimizers, initialisation callbacks.

Importing this module loads kungfu's op library (checking it was built for this TensorFlow) and
connects this worker to its peers.

    import kungfu as kf
    opt = kf.Optimizer(keras.optimizers.SGD(0.1))            # or kungfu.tensorflow.Optimizer
    model.compile(optimizer=opt, loss=...)
    model.fit(..., callbacks=[kf.BroadcastGlobalVariablesCallback()])
"""
from kungfu.tensorflow import ops  # noqa: F401
from kungfu.tensorflow._hook import Hook  # noqa: F401
from kungfu.tensorflow.callbacks import (  # noqa: F401
    LearningRateWarmupCallback,
    MetricAverageCallback,
    combine_metrics,
)
from kungfu.tensorflow.gradient_tape import DistributedGradientTape  # noqa: F401
from kungfu.tensorflow._join import JoinCallback  # noqa: F401
from kungfu.tensorflow.data import (  # noqa: F401
    ElasticData,
    RecordFiles,
    shard,
    validation_dataset,
)
from kungfu.tensorflow._monitor import (  # noqa: F401
    grad_noise_scale,
    grad_noise_stats,
    grad_variance,
)
from kungfu.tensorflow.initializer import (  # noqa: F401
    BroadcastGlobalVariablesCallback,
    broadcast_variables,
)
from kungfu.tensorflow.layers import SyncBatchNormalization  # noqa: F401
from kungfu.tensorflow.optimizers import Compression, Optimizer  # noqa: F401
from kungfu.tensorflow._saving import load_model  # noqa: F401
from kungfu.tensorflow._schedule import LearningRateScheduleCallback  # noqa: F401

__all__ = [
    "ops",
    "Optimizer",
    "Compression",
    "DistributedGradientTape",
    "SyncBatchNormalization",
    "load_model",
    "BroadcastGlobalVariablesCallback",
    "broadcast_variables",
    "grad_noise_scale",
    "grad_noise_stats",
    "grad_variance",
    "Hook",
    "ElasticData",
    "MetricAverageCallback",
    "JoinCallback",
    "LearningRateWarmupCallback",
    "LearningRateScheduleCallback",
    "combine_metrics",
    "shard",
    "validation_dataset",
    "RecordFiles",
]
