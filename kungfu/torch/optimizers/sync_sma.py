"""Synchronous model averaging (SMA): each worker steps on its own gradients, then the
parameters are averaged over the workers (docs/torch.md)."""
from __future__ import annotations

from typing import List, Tuple

import torch

from kungfu.torch.ops import all_reduce_async
from kungfu.torch.optimizers._wrap import wrap


class _SynchronousAveraging:
    def _kungfu_init(self, params: List[Tuple[str, torch.Tensor]], prefix: str):
        self._kungfu_params = params
        self._kungfu_prefix = prefix

    def step(self, closure=None):
        loss = super().step(closure)
        with torch.no_grad():
            handles = [all_reduce_async(p, "avg", f"{self._kungfu_prefix}/param/{name}")
                       for name, p in self._kungfu_params]
            for h in handles:
                h.wait()
        return loss


def SynchronousAveragingOptimizer(optimizer: torch.optim.Optimizer, named_parameters=None):
    """optimizer, followed after each of its steps by the average of every parameter over the
    workers (the optimizer's own state, e.g. momentum, stays local). Start from the same
    parameters everywhere (broadcast_parameters)."""
    return wrap(_SynchronousAveraging, optimizer, named_parameters,
                "SynchronousAveragingOptimizer")
