"""Synchronous SGD: each gradient is averaged over the workers as soon as backward has made it,
overlapping the rest of backward (docs/torch.md)."""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import numpy as np
import torch

from kungfu import _collective
from kungfu.torch.ops import Handle, all_reduce_async
from kungfu.torch.optimizers._wrap import wrap


class _SynchronousSGD:
    """The mixin in front of the user's optimizer class (see _wrap.py).

    Per step, on every worker:
    1. backward: each parameter's post-accumulate-grad hook starts an asynchronous allreduce of
       its .grad in place, named by the parameter, while backward goes on;
    2. step(): a parameter whose hook did not fire (not used this step) takes part anyway: its
       .grad as it is, or zeros when it has none; one allreduce counts, per parameter, the
       workers that had a gradient;
    3. step() waits for every allreduce (each has the op deadline), gives a parameter that some
       worker had a gradient for the average (absent gradients count as zeros), leaves .grad
       None where no worker had one, and calls the wrapped optimizer's step.
    A name's k-th use is the same operation on every worker, so names need no step counter."""

    def _kungfu_init(self, params: List[Tuple[str, torch.Tensor]], prefix: str, op: str):
        self._kungfu_params = [(n, p) for n, p in params if p.requires_grad]
        self._kungfu_prefix = prefix
        self._kungfu_op = op
        self._kungfu_pending: Dict[int, Handle] = {}
        self._kungfu_hooks = [p.register_post_accumulate_grad_hook(self._kungfu_hook(n))
                              for n, p in self._kungfu_params]

    def _kungfu_hook(self, name: str):
        def hook(p: torch.Tensor) -> None:
            if id(p) in self._kungfu_pending:
                raise RuntimeError(
                    f"SynchronousSGDOptimizer: the gradient of {name!r} was made twice before "
                    "step(); accumulating gradients over several backward passes per step is "
                    "not supported yet")
            self._kungfu_pending[id(p)] = all_reduce_async(
                p.grad, self._kungfu_op, f"{self._kungfu_prefix}/grad/{name}")
        return hook

    def synchronize(self) -> None:
        """Steps 2 and 3 above without the optimizer's step: every parameter's .grad averaged."""
        pending, self._kungfu_pending = self._kungfu_pending, {}
        absent = {}
        for name, p in self._kungfu_params:
            if id(p) in pending:
                continue
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            if p.grad is None:
                absent[id(p)] = grad
            pending[id(p)] = all_reduce_async(grad, self._kungfu_op,
                                              f"{self._kungfu_prefix}/grad/{name}")
        present = np.array([id(p) not in absent for _, p in self._kungfu_params], np.int32)
        counts = _collective.allreduce_async(present, "sum", f"{self._kungfu_prefix}/present")
        for _, p in self._kungfu_params:
            pending[id(p)].wait()
        counts = counts.wait()
        with torch.no_grad():
            for (_, p), count in zip(self._kungfu_params, counts.tolist()):
                if id(p) in absent and count > 0:
                    p.grad = absent[id(p)]

    def _kungfu_forget(self) -> None:
        """After a recovery (kungfu.torch.ElasticTrainer): the averages still pending belong to
        the cluster that lost a worker; they are dropped, not waited for."""
        self._kungfu_pending = {}

    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.synchronize()
        super().step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        # Gradients still being averaged are waited for (their operations stay paired with the
        # other workers') before they are dropped.
        pending, self._kungfu_pending = self._kungfu_pending, {}
        for h in pending.values():
            h.wait()
        super().zero_grad(set_to_none)


def SynchronousSGDOptimizer(optimizer: torch.optim.Optimizer, named_parameters=None,
                            op: Optional[str] = "avg"):
    """optimizer, its gradients averaged over the workers before each step (op="sum" sums them,
    as the original KungFu did by default). named_parameters (model.named_parameters()) names
    the collectives; without it parameters are named by their place. Every worker must wrap the
    same model in the same order: the workers check that they agree and fail at once if not.
    Use the returned optimizer (it shares the state of the one passed in)."""
    return wrap(_SynchronousSGD, optimizer, named_parameters, "SynchronousSGDOptimizer",
                op=op or "sum")
