"""The collectives as torch.autograd Functions, with Horovod's gradients (docs/torch.md,
"Gradients"; the same conventions as kungfu.tensorflow.ops', docs/porting-from-horovod.md).

One Function runs every kind: its first argument is a spec (below) that starts the forward
collectives of a group of tensors and, in backward, the gradient's collectives. Each gradient is
itself a collective named after the forward one ("<name>/grad"), so every worker runs the same
ones in the same order (autograd's order is the same on every worker for the same graph). What
each gradient is, per worker, for the incoming gradient g:
- all_reduce(op): the all_reduce of g with the same op, factors and process set (sum: the sum of
  the g; avg: their average). min, max and prod have none: backward raises.
- broadcast: the average of the g over the workers on the root; zeros elsewhere.
- all_gather: the average of the g over the workers, then this worker's rows of it.
- reduce_scatter: sum: size x every worker's g gathered; avg: the g gathered; either times the
  factors. min, max and prod have none.
- all_to_all: g's rows sent back to where they came from (the splits this worker received).
Horovod's averages (broadcast, all_gather) and its factor of size (reduce_scatter of a sum)
treat a loss that each worker computes as a share of one averaged loss."""
from __future__ import annotations

from typing import List, Optional, Sequence

import torch

from kungfu._process_set import ProcessSet
from kungfu.torch.ops import _raw


def _grad_name(name: Optional[str], kind: str) -> str:
    return f"{name}/grad" if name else f"kungfu.torch.grad.{kind}"


def _no_gradient(what: str, op: str):
    return RuntimeError(f"{what}(op={op!r}) has no gradient: only sum and avg do")


def _wait_all(handles: Sequence[_raw.Handle]) -> list:
    return _raw.GroupHandle(handles).wait()


class _Spec:
    """What one collective call does forward and backward, over a group of tensors."""

    kind = ""

    def __init__(self, name: Optional[str], timeout: Optional[float],
                 process_set: Optional[ProcessSet]):
        self.name, self.timeout, self.process_set = name, timeout, process_set

    def names(self, count: int, name: Optional[str] = None) -> List[Optional[str]]:
        return _raw.item_names(self.name if name is None else name, count, self.kind)

    def grad_names(self, count: int) -> List[Optional[str]]:
        return _raw.item_names(_grad_name(self.name, self.kind), count, self.kind)

    def forward(self, xs: List[torch.Tensor]) -> List[torch.Tensor]:
        raise NotImplementedError

    def backward(self, gs: List[torch.Tensor]) -> List[torch.Tensor]:
        raise NotImplementedError


class _Reduction(_Spec):
    """A collective that reduces with op, between Horovod's two factors."""

    def __init__(self, op, name, timeout, process_set, prescale_factor=1.0,
                 postscale_factor=1.0):
        super().__init__(name, timeout, process_set)
        self.op, self.pre, self.post = op or "sum", prescale_factor, postscale_factor


class AllReduce(_Reduction):
    kind = "allreduce"

    def _run(self, xs, names):
        return _wait_all([_raw.all_reduce_new(x, self.op, n, self.timeout, self.process_set,
                                              self.pre, self.post) for x, n in zip(xs, names)])

    def forward(self, xs):
        return self._run(xs, self.names(len(xs)))

    def backward(self, gs):
        if self.op not in ("sum", "avg"):
            raise _no_gradient("all_reduce", self.op)
        return self._run(gs, self.grad_names(len(gs)))


def _averaged(spec: _Spec, gs) -> list:
    names = spec.grad_names(len(gs))
    return _wait_all([_raw.all_reduce_new(g, "avg", n, spec.timeout, spec.process_set)
                      for g, n in zip(gs, names)])


class Broadcast(_Spec):
    kind = "broadcast"

    def __init__(self, root, name, timeout, process_set):
        super().__init__(name, timeout, process_set)
        self.root = root

    def forward(self, xs):
        return _wait_all([_raw.broadcast_new(x, self.root, n, self.timeout, self.process_set)
                          for x, n in zip(xs, self.names(len(xs)))])

    def backward(self, gs):
        avg = _averaged(self, gs)
        if _raw.set_rank(self.process_set) != self.root:
            return [torch.zeros_like(a) for a in avg]
        return avg


class AllGather(_Spec):
    kind = "allgather"

    def __init__(self, name, timeout, process_set, stack):
        super().__init__(name, timeout, process_set)
        self.stack = stack
        self.rows: List[List[int]] = []

    def forward(self, xs):
        got = _wait_all([_raw.all_gather(x, n, self.timeout, self.process_set, self.stack, True)
                         for x, n in zip(xs, self.names(len(xs)))])
        self.rows = [counts for _, counts in got]
        return [out for out, _ in got]

    def backward(self, gs):
        me = _raw.set_rank(self.process_set)
        out = []
        for avg, counts in zip(_averaged(self, gs), self.rows):
            start = sum(counts[:me])
            mine = avg[start:start + counts[me]]
            out.append(mine[0] if self.stack else mine)
        return out


class ReduceScatter(_Reduction):
    kind = "reducescatter"

    def forward(self, xs):
        return _wait_all([_raw.reduce_scatter(x, self.op, n, self.timeout, self.process_set,
                                              self.pre, self.post)
                          for x, n in zip(xs, self.names(len(xs)))])

    def backward(self, gs):
        if self.op not in ("sum", "avg"):
            raise _no_gradient("reduce_scatter", self.op)
        scale = self.pre * self.post * (_raw.set_size(self.process_set) if self.op == "sum"
                                        else 1)
        return _wait_all([_raw.all_gather(g * scale if scale != 1 else g, n, self.timeout,
                                          self.process_set, stack=False)
                          for g, n in zip(gs, self.grad_names(len(gs)))])


class AllToAll(_Spec):
    kind = "alltoall"

    def __init__(self, splits, name, timeout, process_set):
        super().__init__(name, timeout, process_set)
        self.splits = splits
        self.received: List[int] = []

    def forward(self, xs):
        (out, self.received), = _wait_all([_raw.all_to_all(
            xs[0], self.splits, self.name, self.timeout, self.process_set, with_splits=True)])
        return [out]

    def backward(self, gs):
        return _wait_all([_raw.all_to_all(gs[0], self.received, self.grad_names(1)[0],
                                          self.timeout, self.process_set)])


class _Collective(torch.autograd.Function):
    @staticmethod
    def forward(ctx, spec: _Spec, *tensors):
        ctx.spec = spec
        return tuple(spec.forward(list(tensors)))

    @staticmethod
    def backward(ctx, *grads):
        return (None,) + tuple(ctx.spec.backward(list(grads)))


def run(spec: _Spec, tensors: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    """spec's collectives on tensors, differentiable: the outputs require grad where an input
    does, and backward runs spec's gradient collectives."""
    return list(_Collective.apply(spec, *tensors))
