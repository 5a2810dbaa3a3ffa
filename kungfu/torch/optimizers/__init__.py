"""Distributed optimizers wrapping a torch optimizer (kungfu.torch.optimizers, as in KungFu)."""
from kungfu.torch.optimizers.pair_averaging import PairAveragingOptimizer
from kungfu.torch.optimizers.sync_sgd import SynchronousSGDOptimizer
from kungfu.torch.optimizers.sync_sma import SynchronousAveragingOptimizer


class Compression:
    """Horovod's names for SynchronousSGDOptimizer(..., compression=...)."""
    none = "none"
    fp16 = "fp16"


__all__ = ["Compression", "SynchronousSGDOptimizer", "SynchronousAveragingOptimizer",
           "PairAveragingOptimizer"]
