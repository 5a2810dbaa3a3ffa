"""The torch collectives as operations in flight (Handles), without autograd: what the public
functions (collective.py) and the gradients (_autograd.py) start.

Every call goes through the core's numpy collectives (kungfu._collective): same names, same
deadlines (`timeout`, by default KUNGFU_OP_TIMEOUT), same errors, same process sets. A tensor
this worker rejects (wrong type or dtype, a bad factor) still takes part, as in the core: the
other workers fail at once too.

CUDA tensors of in-place allreduce and broadcast stay on the device where the worker has a GPU
backend (kungfu._gpu: NCCL, or staging through pinned memory): the op waits for the caller's
current stream on the device and that stream waits for the op, never the host. Without one, and
for the other collectives, they are copied through the host (a synchronous .cpu())."""
from __future__ import annotations

import numbers
import threading
from typing import Any, Callable, List, Optional, Sequence

import torch

from kungfu import _collective, _device, _gpu, _peer
from kungfu._process_set import ProcessSet, members
from kungfu.errors import InvalidArgumentError
from kungfu.torch.ops._tensors import check, host_array, is_view, numpy_dtype, to_tensor


class Handle:
    """A torch collective in flight. `wait()` finishes it (copies a staged result back into the
    tensor, or makes the result tensor) once and returns the result; `done()` polls. Do not read
    or write an in-place operation's tensor before wait() returns: a CPU tensor may be written
    while the operation runs."""

    def __init__(self, inner, finish: Callable[[Any], Any]):
        self._inner = inner
        self._finish = finish
        self._lock = threading.Lock()
        self._finished = False
        self._value = None

    def done(self) -> bool:
        return self._inner.done()

    def wait(self, timeout: Optional[float] = None):
        value = self._inner.wait(timeout)
        with self._lock:
            if not self._finished:
                self._value = self._finish(value)
                self._finished = True
            return self._value


class GroupHandle:
    """Several collectives in flight as one: `wait()` returns their results as a list."""

    def __init__(self, handles: Sequence[Handle]):
        self._handles = list(handles)

    def done(self) -> bool:
        return all(h.done() for h in self._handles)

    def wait(self, timeout: Optional[float] = None) -> list:
        # Every handle is waited for even when one fails, so none is left running unseen.
        results, error = [], None
        for h in self._handles:
            try:
                results.append(h.wait(timeout))
            except Exception as e:  # noqa: BLE001 - the first error is raised below
                error = error or e
        if error is not None:
            raise error
        return results


def set_size(process_set: Optional[ProcessSet]) -> int:
    return _peer.get().size if process_set is None else process_set.size()


def set_rank(process_set: Optional[ProcessSet]) -> int:
    """This worker's rank in process_set (in the cluster for None)."""
    return _peer.get().rank if process_set is None else process_set.rank()


def checked(kind: str, t, name, timeout, process_set: Optional[ProcessSet]) -> torch.Tensor:
    """t detached, after the checks; a tensor refused here fails the operation everywhere."""
    ranks = members(process_set, kind)  # a non-member or a stale set: refused here only
    with _collective._takes_part(kind, name, timeout, ranks):
        return check(t)


def _factor(value, name: str, x: torch.Tensor) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidArgumentError(f"{name} must be a number, got {value!r}")
    if value != 1 and x.dtype == torch.bool:
        raise InvalidArgumentError(f"{name} needs a tensor of numbers, got {x.dtype}")
    return float(value)


def scale_(y: torch.Tensor, factor: float) -> torch.Tensor:
    """y *= factor in place, as Horovod scales: integers in float64, the product cast back
    (toward zero); float16 and bfloat16 in float32."""
    if factor == 1:
        return y
    if y.dtype.is_floating_point and y.dtype not in (torch.float16, torch.bfloat16):
        return y.mul_(factor)
    wide = torch.float32 if y.dtype.is_floating_point else torch.float64
    return y.copy_((y.to(wide) * factor).to(y.dtype))


def checked_scaled(kind: str, t, name, timeout, process_set: Optional[ProcessSet],
                   prescale_factor, postscale_factor):
    """(t detached, the prescale factor, the postscale factor), after the checks (as checked)."""
    ranks = members(process_set, kind)
    with _collective._takes_part(kind, name, timeout, ranks):
        x = check(t)
        return (x, _factor(prescale_factor, "prescale_factor", x),
                _factor(postscale_factor, "postscale_factor", x))


def _in_place(t: torch.Tensor, x: torch.Tensor, launch: Callable,
              post: Optional[Callable[[torch.Tensor], None]] = None) -> Handle:
    """Runs launch(array, out=array) on the memory of x (t detached) where it can (a contiguous
    CPU tensor), else on a host copy that wait() copies back into x; then post(x); wait()
    returns t."""
    a = host_array(x)
    staged = not is_view(x)

    def finish(result):
        with torch.no_grad():
            if staged:
                x.copy_(to_tensor(result, x))
            if post is not None:
                post(x)
        return t

    return Handle(launch(a, out=a), finish)


def _on_device(t: torch.Tensor, x: torch.Tensor, launch: Callable, mean_of: int = 0,
               post: Optional[Callable[[torch.Tensor], None]] = None) -> Handle:
    """Runs launch(address, count, dtype, stream, keep) on x's device memory (a contiguous copy
    where x is not contiguous, copied back by wait()); `mean_of` n > 0: the sum is divided by n
    on the device, after the op, on the caller's stream; then post(x). wait() returns t."""
    y = x if x.is_contiguous() else x.contiguous()
    stream = torch.cuda.current_stream(y.device).cuda_stream
    inner = launch(y.data_ptr(), y.numel(), numpy_dtype(y), stream, y)

    def finish(_):
        with torch.no_grad():
            if mean_of:
                if y.dtype.is_floating_point:
                    y.div_(mean_of)
                else:
                    y.copy_(torch.div(y, mean_of, rounding_mode="floor"))
            if y is not x:
                x.copy_(y)
            if post is not None:
                post(x)
        return t

    return Handle(inner, finish)


def _device_path(x: torch.Tensor) -> bool:
    # Inside kungfu's Join (kungfu/_join.py) the host path, where collectives announce themselves
    # to the workers that have joined.
    return x.device.type == "cuda" and _gpu.nccl_available() and _collective._announce is None


def all_reduce_into(t: torch.Tensor, op: str = "sum", name: Optional[str] = None,
                    timeout: Optional[float] = None, process_set: Optional[ProcessSet] = None,
                    prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> Handle:
    """Reduces t in place (t * prescale_factor reduced with op, then times postscale_factor);
    wait() returns t."""
    x, pre, post_factor = checked_scaled("allreduce", t, name, timeout, process_set,
                                         prescale_factor, postscale_factor)
    op = op or "sum"
    if pre != 1:
        with torch.no_grad():
            scale_(x, pre)
    post = (lambda y: scale_(y, post_factor)) if post_factor != 1 else None
    if _device_path(x):
        return _on_device(t, x, lambda ptr, count, dtype, stream, keep: _device.allreduce_async(
            ptr, ptr, count, dtype, "sum" if op == "avg" else op, name, timeout, stream, keep,
            process_set), mean_of=set_size(process_set) if op == "avg" else 0, post=post)
    return _in_place(t, x, lambda a, out: _collective.allreduce_async(
        a, op, name, timeout=timeout, out=out, process_set=process_set), post)


def all_reduce_new(t: torch.Tensor, op: str = "sum", name: Optional[str] = None,
                   timeout: Optional[float] = None, process_set: Optional[ProcessSet] = None,
                   prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> Handle:
    """all_reduce_into on a copy of t; wait() returns the copy."""
    x, _, _ = checked_scaled("allreduce", t, name, timeout, process_set, prescale_factor,
                             postscale_factor)
    return all_reduce_into(x.clone(memory_format=torch.contiguous_format), op, name, timeout,
                           process_set, prescale_factor, postscale_factor)


def broadcast_into(t: torch.Tensor, root: int = 0, name: Optional[str] = None,
                   timeout: Optional[float] = None,
                   process_set: Optional[ProcessSet] = None) -> Handle:
    """Overwrites t in place with root's t; wait() returns t."""
    x = checked("broadcast", t, name, timeout, process_set)
    if _device_path(x):
        return _on_device(t, x, lambda ptr, count, dtype, stream, keep: _device.broadcast_async(
            ptr, ptr, count, dtype, root, name, timeout, stream, keep, process_set))
    return _in_place(t, x, lambda a, out: _collective.broadcast_async(
        a, root, name, timeout=timeout, out=out, process_set=process_set))


def broadcast_new(t: torch.Tensor, root: int = 0, name: Optional[str] = None,
                  timeout: Optional[float] = None,
                  process_set: Optional[ProcessSet] = None) -> Handle:
    """broadcast_into on a copy of t; wait() returns the copy."""
    x = checked("broadcast", t, name, timeout, process_set)
    return broadcast_into(x.clone(memory_format=torch.contiguous_format), root, name, timeout,
                          process_set)


def all_gather(t: torch.Tensor, name: Optional[str] = None, timeout: Optional[float] = None,
               process_set: Optional[ProcessSet] = None, stack: bool = True,
               with_rows: bool = False) -> Handle:
    """Every worker's t: stacked on a new leading dimension (`stack`, same shapes everywhere)
    or concatenated along dimension 0 (first dimensions may differ). wait() returns the tensor,
    or with `with_rows` (the tensor, the rows each worker gave: 1 each when stacked)."""
    x = checked("allgather", t, name, timeout, process_set)
    a = host_array(x)
    inner = _collective.allgather_async(a.reshape((1,) + a.shape) if stack else a, name,
                                        timeout=timeout, process_set=process_set, with_rows=True)

    def finish(result):
        rows, counts = result
        out = to_tensor(rows, x)
        return (out, counts) if with_rows else out

    return Handle(inner, finish)


def reduce_scatter(t: torch.Tensor, op: str = "sum", name: Optional[str] = None,
                   timeout: Optional[float] = None, process_set: Optional[ProcessSet] = None,
                   prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> Handle:
    """t (times prescale_factor) reduced with op and split along dimension 0, this worker's part
    (times postscale_factor); wait() returns it as a new tensor."""
    x, pre, post = checked_scaled("reducescatter", t, name, timeout, process_set,
                                  prescale_factor, postscale_factor)
    a = host_array(scale_(x.clone(), pre) if pre != 1 else x)
    inner = _collective.reducescatter_async(a, op or "sum", name, timeout=timeout,
                                            process_set=process_set)

    def finish(part):
        out = to_tensor(part, x)
        return scale_(out, post)

    return Handle(inner, finish)


def even_parts(rows: int, n: int) -> List[int]:
    """How reduce_scatter splits `rows` among n workers (kungfu._collective's rule)."""
    return [rows // n + (1 if j < rows % n else 0) for j in range(n)]


def all_to_all(t: torch.Tensor, splits=None, name: Optional[str] = None,
               timeout: Optional[float] = None, process_set: Optional[ProcessSet] = None,
               with_splits: bool = False) -> Handle:
    """splits[j] rows of t to worker j (equal parts for None); wait() returns the rows every
    worker sent this one, in rank order, or with `with_splits` (them, the rows from each)."""
    x = checked("alltoall", t, name, timeout, process_set)
    if isinstance(splits, torch.Tensor):
        splits = splits.tolist()
    inner = _collective.alltoall_async(host_array(x), splits, name, timeout=timeout,
                                       process_set=process_set, with_rows=True)

    def finish(result):
        rows, counts = result
        out = to_tensor(rows, x)
        return (out, counts) if with_splits else out

    return Handle(inner, finish)


def item_names(name: Optional[str], count: int, kind: str) -> List[Optional[str]]:
    """The names of a group's operations: `name` for a group of one, else "<name>/<i>"."""
    if count == 1:
        return [name]
    return [f"{name or 'kungfu.torch.group.' + kind}/{i}" for i in range(count)]

