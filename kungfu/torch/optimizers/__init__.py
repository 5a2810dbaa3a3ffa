"""Distributed optimizers wrapping a torch optimizer (kungfu.torch.optimizers, as in KungFu)."""
import torch

from kungfu._compression import FP16Compression, NoCompression
from kungfu.torch.optimizers.pair_averaging import PairAveragingOptimizer
from kungfu.torch.optimizers.sync_sgd import SynchronousSGDOptimizer
from kungfu.torch.optimizers.sync_sma import SynchronousAveragingOptimizer


def _to_half(tensor):
    if tensor.dtype.is_floating_point:
        return tensor.to(torch.float16), tensor.dtype
    return tensor, None


class Compression:
    """Horovod's names for SynchronousSGDOptimizer(..., compression=...): strings ("none",
    "fp16") that also compress and decompress a tensor as Horovod's do."""
    none = NoCompression()
    fp16 = FP16Compression(_to_half, lambda t, dtype: t.to(dtype))


__all__ = ["Compression", "SynchronousSGDOptimizer", "SynchronousAveragingOptimizer",
           "PairAveragingOptimizer"]
