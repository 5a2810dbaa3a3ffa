"""Pair averaging (AD-PSGD): before each local step a worker averages its model with one randomly
chosen other worker's, fetched from that worker's peer-to-peer store without waiting for it to
take part (docs/torch.md)."""
from __future__ import annotations

from typing import Dict, List, Tuple

import numpy as np
import torch

from kungfu import _collective, _peer
from kungfu.torch.ops._tensors import check, host_array, to_tensor
from kungfu.torch.optimizers._wrap import wrap


def choose_peer(step: int, rank: int, size: int) -> int:
    """A worker other than `rank`, uniform over the size - 1 others: drawn from a generator
    seeded by (step, rank), so independent between workers and steps, and reproducible."""
    k = int(np.random.default_rng([step, rank]).integers(size - 1))
    return k + (k >= rank)


class _PairAveraging:
    """Per step, on each worker: the first step saves the model and passes a barrier (every
    worker's model is in its store before anyone fetches); then, with other workers, fetch one
    other worker's saved model (per dtype, one flat blob) and set each parameter to the mean of
    its own and the fetched value; the wrapped optimizer's step (local gradients); save the model
    for the others. A fetched model may be a step older or newer than the peer's current one:
    the store serves its last save, whole (never a mix of two)."""

    def _kungfu_init(self, params: List[Tuple[str, torch.Tensor]], prefix: str):
        self._kungfu_prefix = prefix
        groups: Dict[tuple, list] = {}
        for _, p in params:
            groups.setdefault((p.dtype, p.device), []).append(p)
        self._kungfu_groups = list(groups.values())
        # Each group's blob, as the request receives it (host memory, one flat array).
        self._kungfu_into = [host_array(check(torch.empty(sum(p.numel() for p in ps),
                                                          dtype=ps[0].dtype)))
                             for ps in self._kungfu_groups]
        self._kungfu_started = False
        self._kungfu_steps = 0

    def _kungfu_blob(self, i: int) -> str:
        return f"{self._kungfu_prefix}/model/{i}"

    def _kungfu_save(self) -> None:
        for i, ps in enumerate(self._kungfu_groups):
            flat = torch.cat([p.detach().reshape(-1) for p in ps])
            _collective.save(self._kungfu_blob(i), host_array(check(flat)))

    def step(self, closure=None):
        me = _peer.identity()
        if not self._kungfu_started:
            self._kungfu_save()
            _collective.barrier(f"{self._kungfu_prefix}/start")
            self._kungfu_started = True
        if me.size > 1:
            target = choose_peer(self._kungfu_steps, me.rank, me.size)
            with torch.no_grad():
                for i, ps in enumerate(self._kungfu_groups):
                    into = self._kungfu_into[i]
                    _collective.request(target, self._kungfu_blob(i), out=into)
                    fetched = to_tensor(into, ps[0])
                    at = 0
                    for p in ps:
                        p.add_(fetched[at:at + p.numel()].view_as(p)).mul_(0.5)
                        at += p.numel()
        loss = super().step(closure)
        self._kungfu_save()
        self._kungfu_steps += 1
        return loss


def PairAveragingOptimizer(optimizer: torch.optim.Optimizer, named_parameters=None):
    """optimizer, its model averaged with one random other worker's before each local step
    (AD-PSGD; KungFu's PairAveragingOptimizer): no worker waits for another after the first
    step's barrier, so a slow worker does not hold the others up; the models stay close but are
    not equal. Start from the same parameters everywhere (broadcast_parameters)."""
    return wrap(_PairAveraging, optimizer, named_parameters, "PairAveragingOptimizer")
