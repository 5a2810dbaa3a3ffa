"""Collectives over torch tensors, under the original KungFu's PyTorch names (docs/torch.md),
with Horovod's where KungFu had none (reduce_scatter, all_to_all, the group_ calls).

The calls that return a new tensor (all_reduce_fn, broadcast, all_gather, reduce_scatter,
all_to_all, group_all_reduce, group_all_gather, group_reduce_scatter) are differentiable, with
Horovod's gradients (_autograd.py). The in-place calls (all_reduce, the *_async ones) are not.
Every call takes `name`, `timeout` and `process_set` (a kungfu.ProcessSet: only its members
call, roots and results are the set's) as the core's collectives do (_raw.py says how tensors
travel)."""
from __future__ import annotations

import hashlib
from typing import Iterable, List, Optional, Sequence, Tuple

import torch

from kungfu import _collective
from kungfu._process_set import ProcessSet
from kungfu.errors import InvalidArgumentError
from kungfu.torch.ops import _autograd, _raw
from kungfu.torch.ops._raw import GroupHandle, Handle

PS = Optional[ProcessSet]


def all_reduce_async(t: torch.Tensor, op: str = "sum", name: Optional[str] = None,
                     timeout: Optional[float] = None, process_set: PS = None,
                     prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> Handle:
    """Reduces t in place across workers (op: sum, avg, min, max, prod); wait() returns t.
    prescale_factor multiplies t before the reduction, postscale_factor the result (floating
    point only; Horovod's factors)."""
    return _raw.all_reduce_into(t, op, name, timeout, process_set, prescale_factor,
                                postscale_factor)


def all_reduce(t: torch.Tensor, op: str = "sum", name: Optional[str] = None,
               timeout: Optional[float] = None, process_set: PS = None,
               prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> torch.Tensor:
    """Reduces t in place across workers and returns it (not differentiable: all_reduce_fn is)."""
    return all_reduce_async(t, op, name, timeout, process_set, prescale_factor,
                            postscale_factor).wait()


def all_reduce_fn(t: torch.Tensor, op: str = "sum", name: Optional[str] = None,
                  timeout: Optional[float] = None, process_set: PS = None,
                  prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> torch.Tensor:
    """A new tensor (t's dtype, device and shape): t reduced across workers with op. t is left
    as it is. Differentiable for sum and avg: the gradient is the same all_reduce of the
    incoming gradients."""
    return _autograd.run(_autograd.AllReduce(op, name, timeout, process_set, prescale_factor,
                                             postscale_factor), [t])[0]


def group_all_reduce(ts: Sequence[torch.Tensor], op: str = "sum", name: Optional[str] = None,
                     timeout: Optional[float] = None, process_set: PS = None,
                     prescale_factor: float = 1.0,
                     postscale_factor: float = 1.0) -> List[torch.Tensor]:
    """all_reduce_fn of each tensor, all in flight at once (Horovod's grouped_allreduce); the
    operations are named "<name>/<i>". Differentiable as all_reduce_fn."""
    return _autograd.run(_autograd.AllReduce(op, name, timeout, process_set, prescale_factor,
                                             postscale_factor), list(ts))


def group_all_reduce_async(ts: Sequence[torch.Tensor], op: str = "sum",
                           name: Optional[str] = None, timeout: Optional[float] = None,
                           process_set: PS = None, prescale_factor: float = 1.0,
                           postscale_factor: float = 1.0) -> GroupHandle:
    """all_reduce_async of each tensor, in place; wait() returns the list of tensors."""
    names = _raw.item_names(name, len(ts), "allreduce")
    return GroupHandle([all_reduce_async(t, op, n, timeout, process_set, prescale_factor,
                                         postscale_factor) for t, n in zip(ts, names)])


def all_gather(t: torch.Tensor, name: Optional[str] = None, timeout: Optional[float] = None,
               process_set: PS = None, stack: bool = True) -> torch.Tensor:
    """Every worker's t in rank order. stack=True (KungFu's): stacked on a new leading
    dimension, shape (size, *t.shape), the same shape everywhere. stack=False (Horovod's
    allgather, kungfu.tensorflow.ops.all_gather): concatenated along dimension 0, whose size may
    differ between workers. Differentiable: the gradient is the average of the incoming
    gradients over the workers, this worker's rows of it."""
    return _autograd.run(_autograd.AllGather(name, timeout, process_set, stack), [t])[0]


def all_gather_async(t: torch.Tensor, name: Optional[str] = None,
                     timeout: Optional[float] = None, process_set: PS = None,
                     stack: bool = True) -> Handle:
    """all_gather started; wait() returns the new tensor (not differentiable)."""
    return _raw.all_gather(t, name, timeout, process_set, stack)


def group_all_gather(ts: Sequence[torch.Tensor], name: Optional[str] = None,
                     timeout: Optional[float] = None, process_set: PS = None,
                     stack: bool = True) -> List[torch.Tensor]:
    """all_gather of each tensor, all in flight at once (Horovod's grouped_allgather)."""
    return _autograd.run(_autograd.AllGather(name, timeout, process_set, stack), list(ts))


def group_all_gather_async(ts: Sequence[torch.Tensor], name: Optional[str] = None,
                           timeout: Optional[float] = None, process_set: PS = None,
                           stack: bool = True) -> GroupHandle:
    names = _raw.item_names(name, len(ts), "allgather")
    return GroupHandle([_raw.all_gather(t, n, timeout, process_set, stack)
                        for t, n in zip(ts, names)])


def broadcast_async(t: torch.Tensor, root: int = 0, name: Optional[str] = None,
                    timeout: Optional[float] = None, process_set: PS = None) -> Handle:
    """Overwrites t in place with root's t; wait() returns t."""
    return _raw.broadcast_into(t, root, name, timeout, process_set)


def broadcast(t: torch.Tensor, root: int = 0, name: Optional[str] = None,
              timeout: Optional[float] = None, process_set: PS = None) -> torch.Tensor:
    """A new tensor with root's t (t itself is left as it is). Differentiable: the gradient is
    the average of the incoming gradients over the workers on the root, zeros elsewhere."""
    return _autograd.run(_autograd.Broadcast(root, name, timeout, process_set), [t])[0]


def reduce_scatter(t: torch.Tensor, op: str = "sum", name: Optional[str] = None,
                   timeout: Optional[float] = None, process_set: PS = None,
                   prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> torch.Tensor:
    """t reduced over the workers with op (sum, avg, min, max, prod) and split along dimension
    0: worker r gets part r, the first (rows % size) workers one row more. t must have the same
    shape and dtype everywhere. Differentiable for sum and avg: the gradient is every worker's
    incoming gradient gathered, times the size for sum (Horovod's), times the factors."""
    return _autograd.run(_autograd.ReduceScatter(op, name, timeout, process_set,
                                                 prescale_factor, postscale_factor), [t])[0]


def reduce_scatter_async(t: torch.Tensor, op: str = "sum", name: Optional[str] = None,
                         timeout: Optional[float] = None, process_set: PS = None,
                         prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> Handle:
    """reduce_scatter started; wait() returns this worker's part (not differentiable)."""
    return _raw.reduce_scatter(t, op, name, timeout, process_set, prescale_factor,
                               postscale_factor)


def group_reduce_scatter(ts: Sequence[torch.Tensor], op: str = "sum", name: Optional[str] = None,
                         timeout: Optional[float] = None, process_set: PS = None,
                         prescale_factor: float = 1.0,
                         postscale_factor: float = 1.0) -> List[torch.Tensor]:
    """reduce_scatter of each tensor, all in flight at once (Horovod's grouped_reducescatter)."""
    return _autograd.run(_autograd.ReduceScatter(op, name, timeout, process_set,
                                                 prescale_factor, postscale_factor), list(ts))


def group_reduce_scatter_async(ts: Sequence[torch.Tensor], op: str = "sum",
                               name: Optional[str] = None, timeout: Optional[float] = None,
                               process_set: PS = None, prescale_factor: float = 1.0,
                               postscale_factor: float = 1.0) -> GroupHandle:
    names = _raw.item_names(name, len(ts), "reducescatter")
    return GroupHandle([_raw.reduce_scatter(t, op, n, timeout, process_set, prescale_factor,
                                            postscale_factor) for t, n in zip(ts, names)])


def all_to_all(t: torch.Tensor, splits=None, name: Optional[str] = None,
               timeout: Optional[float] = None, process_set: PS = None,
               with_splits: bool = False):
    """Worker r sends splits[j] rows of t to worker j (a list or an int tensor; equal parts for
    None, then the rows must divide evenly) and gets the rows every worker sent it, in rank
    order. Dimensions after the first must agree everywhere; splits may differ per worker.
    with_splits=True returns (the rows, an int64 tensor of how many came from each worker), as
    Horovod's alltoall given splits. Differentiable: the gradient's rows go back to where they
    came from."""
    spec = _autograd.AllToAll(splits, name, timeout, process_set)
    out = _autograd.run(spec, [t])[0]
    return (out, torch.tensor(spec.received, dtype=torch.int64)) if with_splits else out


def all_to_all_async(t: torch.Tensor, splits=None, name: Optional[str] = None,
                     timeout: Optional[float] = None, process_set: PS = None,
                     with_splits: bool = False) -> Handle:
    """all_to_all started; wait() returns what all_to_all returns (not differentiable)."""
    inner = _raw.all_to_all(t, splits, name, timeout, process_set, with_splits)
    if not with_splits:
        return inner
    return Handle(inner, lambda r: (r[0], torch.tensor(r[1], dtype=torch.int64)))


def _named_tensors(state) -> List[Tuple[str, torch.Tensor]]:
    items = state.items() if hasattr(state, "items") else state
    return [(str(k), v) for k, v in items if isinstance(v, torch.Tensor)]


def agree_on(entries: Iterable[Tuple[str, torch.Tensor]], what: str, name: str,
             timeout: Optional[float] = None, process_set: PS = None) -> None:
    """Fails on every worker (of process_set), naming the ranks, unless every worker has the
    same names, shapes and dtypes in `entries`: a worker with another model would otherwise wait
    on names that no other worker ever uses (until the deadline)."""
    entries = list(entries)
    text = "\n".join(f"{k} {tuple(v.shape)} {v.dtype}" for k, v in entries)
    mine = (len(entries), hashlib.sha256(text.encode()).hexdigest()[:16])
    everyone = _collective.allgather_object(mine, name=f"{name}/signature", timeout=timeout,
                                            process_set=process_set)
    if len(set(everyone)) > 1:
        counts = ", ".join(f"rank {r}: {n} tensors ({d})" for r, (n, d) in enumerate(everyone))
        raise InvalidArgumentError(
            f"{what}: the workers' tensors differ in number, names, shapes or dtypes ({counts}); "
            "every worker must build the same model")


def broadcast_parameters(state_dict, root: int = 0, name: Optional[str] = None,
                         timeout: Optional[float] = None, process_set: PS = None) -> None:
    """Overwrites every tensor of state_dict (a module's state_dict(), or (name, tensor) pairs
    such as named_parameters()) in place with root's. Entries that are not tensors are left
    alone. Fails on every worker if their tensors differ in names, shapes or dtypes."""
    base = name or "kungfu.torch.broadcast_parameters"
    tensors = _named_tensors(state_dict)
    agree_on(tensors, "broadcast_parameters", base, timeout, process_set)
    GroupHandle([broadcast_async(v, root, f"{base}/{k}", timeout, process_set)
                 for k, v in tensors]).wait()


def _on_host(value):
    """value with every tensor in it copied to the host (a state_dict's nesting: dicts, lists,
    tuples), so that a worker whose GPU has another index can unpickle it."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _on_host(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_on_host(v) for v in value)
    return value


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root: int = 0,
                              name: Optional[str] = None, timeout: Optional[float] = None,
                              process_set: PS = None) -> None:
    """Every worker's optimizer takes root's state: its state_dict() (per-parameter state such
    as momentum buffers and step counts, and each group's settings such as the learning rate),
    loaded with load_state_dict() (which moves the tensors to each parameter's device). A root
    without state yet (before its first step) leaves the others without state too. Fails on
    every worker, naming the ranks, if the optimizers' parameters differ in number, shapes or
    dtypes. Horovod's hvd.broadcast_optimizer_state(optimizer, root_rank)."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"broadcast_optimizer_state takes a torch.optim.Optimizer, got "
                        f"{type(optimizer).__name__}")
    base = name or "kungfu.torch.broadcast_optimizer_state"
    params = [(f"group{g}.{i}", p) for g, group in enumerate(optimizer.param_groups)
              for i, p in enumerate(group["params"])]
    agree_on(params, "broadcast_optimizer_state", base, timeout, process_set)
    mine = _raw.set_rank(process_set) == root
    state = _collective.broadcast_object(_on_host(optimizer.state_dict()) if mine else None,
                                         root, f"{base}/state", timeout, process_set)
    if not mine:
        optimizer.load_state_dict(state)


# The original KungFu's names.
def inplace_all_reduce_op(t: torch.Tensor, op: Optional[str] = None) -> torch.Tensor:
    return all_reduce(t, op or "sum")


def inplace_all_reduce_async_op(t: torch.Tensor, name: str, op: Optional[str] = None) -> Handle:
    return all_reduce_async(t, op or "sum", name)


def wait_handle(handle: Handle):
    return handle.wait()


def wait_all_handles(handles: Iterable[Handle]) -> list:
    return [h.wait() for h in handles]
