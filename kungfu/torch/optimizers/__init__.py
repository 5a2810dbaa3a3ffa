"""Distributed optimizers wrapping a torch optimizer (kungfu.torch.optimizers, as in KungFu)."""
import torch

from kungfu.torch.optimizers.pair_averaging import PairAveragingOptimizer
from kungfu.torch.optimizers.sync_sgd import SynchronousSGDOptimizer
from kungfu.torch.optimizers.sync_sma import SynchronousAveragingOptimizer


class _NoCompression(str):
    """compression="none", with Horovod's compressor interface."""

    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor


class _FP16Compression(str):
    """compression="fp16": floating-point tensors as float16, with Horovod's compressor
    interface (compress returns the tensor to send and what decompress needs to undo it)."""

    @staticmethod
    def compress(tensor):
        if tensor.dtype.is_floating_point:
            return tensor.to(torch.float16), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor if ctx is None else tensor.to(ctx)


class Compression:
    """Horovod's names for SynchronousSGDOptimizer(..., compression=...): strings ("none",
    "fp16") that also compress and decompress a tensor as Horovod's do."""
    none = _NoCompression("none")
    fp16 = _FP16Compression("fp16")


__all__ = ["Compression", "SynchronousSGDOptimizer", "SynchronousAveragingOptimizer",
           "PairAveragingOptimizer"]
