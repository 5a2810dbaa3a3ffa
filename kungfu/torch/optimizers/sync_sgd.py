"""Synchronous SGD: the gradients are averaged over the workers in buckets, each bucket as soon
as backward has made all of its gradients, overlapping the rest of backward (docs/torch.md)."""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import numpy as np
import torch

from kungfu import _collective
from kungfu.torch.ops import Handle, all_reduce_async
from kungfu.torch.optimizers._wrap import wrap

BUCKET_BYTES = 25 << 20  # as DDP's; measured in benchmarks/README.md, "torch_ddp.py"


class _Bucket:
    """Parameters whose gradients are averaged together, in one allreduce of a flat buffer:
    consecutive in backward order (the reverse of the parameters' order), of one dtype and
    device, up to the bucket size (a larger parameter is a bucket of its own)."""

    def __init__(self, index: int, params: List[Tuple[str, torch.Tensor]]):
        self.name = f"bucket{index}"
        self.params = params
        self.slices: Dict[int, slice] = {}
        at = 0
        for _, p in params:
            self.slices[id(p)] = slice(at, at + p.numel())
            at += p.numel()
        first = params[0][1]
        self.flat = torch.empty(at, dtype=first.dtype, device=first.device)
        self.ready: set = set()  # ids of the parameters whose gradient is in flat
        self.handle: Optional[Handle] = None

    def put(self, p: torch.Tensor, grad: Optional[torch.Tensor]) -> None:
        part = self.flat[self.slices[id(p)]]
        if grad is None:
            part.zero_()
        else:
            part.copy_(grad.detach().reshape(-1))
        self.ready.add(id(p))

    def complete(self) -> bool:
        return len(self.ready) == len(self.params)

    def reset(self) -> None:
        self.ready, self.handle = set(), None


def _buckets(params: List[Tuple[str, torch.Tensor]], limit: int) -> List[_Bucket]:
    out: List[_Bucket] = []
    group: List[Tuple[str, torch.Tensor]] = []
    size = 0
    for name, p in reversed(params):  # backward makes the last layers' gradients first
        nbytes = p.numel() * p.element_size()
        if group and (size + nbytes > limit or (p.dtype, p.device) != (group[0][1].dtype,
                                                                        group[0][1].device)):
            out.append(_Bucket(len(out), group))
            group, size = [], 0
        group.append((name, p))
        size += nbytes
    if group:
        out.append(_Bucket(len(out), group))
    return out


class _SynchronousSGD:
    """The mixin in front of the user's optimizer class (see _wrap.py).

    Per step, on every worker:
    1. backward: each parameter's post-accumulate-grad hook copies its .grad into its bucket;
       the hook that completes a bucket starts the bucket's asynchronous allreduce, while
       backward goes on;
    2. step(): a parameter whose hook did not fire (not used this step) takes part anyway: its
       .grad as it is, or zeros when it has none, and the buckets not yet started start; one
       allreduce counts, per parameter, the workers that had a gradient;
    3. step() waits for every bucket (each has the op deadline), gives a parameter that some
       worker had a gradient for the average (absent gradients count as zeros), leaves .grad
       None where no worker had one, and calls the wrapped optimizer's step.
    A name's k-th use is the same operation on every worker, so names need no step counter."""

    def _kungfu_init(self, params: List[Tuple[str, torch.Tensor]], prefix: str, op: str,
                     bucket_bytes: int):
        self._kungfu_params = [(n, p) for n, p in params if p.requires_grad]
        self._kungfu_prefix = prefix
        self._kungfu_op = op
        self._kungfu_buckets = _buckets(self._kungfu_params, bucket_bytes)
        self._kungfu_bucket_of = {id(p): b for b in self._kungfu_buckets for _, p in b.params}
        self._kungfu_hooks = [p.register_post_accumulate_grad_hook(self._kungfu_hook(n))
                              for n, p in self._kungfu_params]

    def _kungfu_start(self, b: _Bucket) -> None:
        b.handle = all_reduce_async(b.flat, self._kungfu_op, f"{self._kungfu_prefix}/{b.name}")

    def _kungfu_hook(self, name: str):
        def hook(p: torch.Tensor) -> None:
            b = self._kungfu_bucket_of[id(p)]
            if id(p) in b.ready:
                raise RuntimeError(
                    f"SynchronousSGDOptimizer: the gradient of {name!r} was made twice before "
                    "step(); accumulating gradients over several backward passes per step is "
                    "not supported yet")
            b.put(p, p.grad)
            if b.complete():
                self._kungfu_start(b)
        return hook

    def synchronize(self) -> None:
        """Steps 2 and 3 above without the optimizer's step: every parameter's .grad averaged."""
        absent = set()
        for b in self._kungfu_buckets:
            for _, p in b.params:
                if id(p) not in b.ready:
                    if p.grad is None:
                        absent.add(id(p))
                    b.put(p, p.grad)
            if b.handle is None:
                self._kungfu_start(b)
        present = np.array([id(p) not in absent for _, p in self._kungfu_params], np.int32)
        counts = _collective.allreduce_async(present, "sum", f"{self._kungfu_prefix}/present")
        buckets = self._kungfu_buckets
        try:
            for b in buckets:
                b.handle.wait()
            counts = counts.wait()
        finally:
            for b in buckets:
                b.reset()
        with torch.no_grad():
            for (_, p), count in zip(self._kungfu_params, counts.tolist()):
                if count == 0:
                    continue  # no worker had a gradient: it stays None
                avg = self._kungfu_bucket_of[id(p)].flat[
                    self._kungfu_bucket_of[id(p)].slices[id(p)]].view_as(p)
                if p.grad is None:
                    p.grad = avg.clone()
                else:
                    p.grad.copy_(avg)

    def _kungfu_forget(self) -> None:
        """After a recovery (kungfu.torch.ElasticTrainer): the averages still pending belong to
        the cluster that lost a worker; they are dropped, not waited for."""
        for b in self._kungfu_buckets:
            b.reset()

    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.synchronize()
        super().step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        # Buckets still being averaged are waited for (their operations stay paired with the
        # other workers') before the gradients are dropped.
        try:
            for b in self._kungfu_buckets:
                if b.handle is not None:
                    b.handle.wait()
        finally:
            for b in self._kungfu_buckets:
                b.reset()
        super().zero_grad(set_to_none)


def SynchronousSGDOptimizer(optimizer: torch.optim.Optimizer, named_parameters=None,
                            op: Optional[str] = "avg", bucket_bytes: int = BUCKET_BYTES):
    """optimizer, its gradients averaged over the workers before each step (op="sum" sums them,
    as the original KungFu did by default), in buckets of up to `bucket_bytes` of gradients
    (default 25 MiB, as DDP's; 0: one parameter per allreduce). named_parameters
    (model.named_parameters()) names the parameters in errors; without it they are named by
    their place. Every worker must wrap the same model in the same order: the workers check
    that they agree and fail at once if not. Use the returned optimizer (it shares the state of
    the one passed in)."""
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 0:
        raise ValueError(f"bucket_bytes must be an int >= 0, got {bucket_bytes!r}")
    return wrap(_SynchronousSGD, optimizer, named_parameters, "SynchronousSGDOptimizer",
                op=op or "sum", bucket_bytes=bucket_bytes)
