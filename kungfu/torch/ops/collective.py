"""Collectives over torch tensors, under the original KungFu's PyTorch names (docs/torch.md).

Every call goes through the core's numpy collectives (kungfu._collective): same names, same
deadlines (`timeout`, by default KUNGFU_OP_TIMEOUT), same errors. A tensor this worker rejects
(wrong type or dtype) still takes part, as in the core: the other workers fail at once too.

CUDA tensors of in-place allreduce and broadcast (and so SynchronousSGDOptimizer and
broadcast_parameters) stay on the device where the worker has a GPU backend (kungfu._gpu:
NCCL, or staging through pinned memory): the op waits for the caller's current stream on the
device and that stream waits for the op, never the host. Without one they are copied through
the host (a synchronous .cpu())."""
from __future__ import annotations

import hashlib
import threading
from typing import Any, Callable, Iterable, List, Optional, Tuple

import torch

from kungfu import _collective, _device, _gpu, _peer
from kungfu.errors import InvalidArgumentError
from kungfu.torch.ops._tensors import check, host_array, is_view, numpy_dtype, to_tensor


class Handle:
    """A torch collective in flight. `wait()` finishes it (copies a staged result back into the
    tensor) once and returns the tensor; `done()` polls. Do not read or write the tensor before
    wait() returns: a CPU tensor may be written in place while the operation runs."""

    def __init__(self, inner: _collective.Handle, finish: Callable[[Any], Any]):
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


def _checked(kind: str, t, name, timeout) -> torch.Tensor:
    with _collective._takes_part(kind, name, timeout):
        return check(t)


def _in_place(t: torch.Tensor, x: torch.Tensor, launch: Callable) -> Handle:
    """Runs launch(array, out=array) on the memory of x (t detached) where it can (a contiguous
    CPU tensor), else on a host copy that wait() copies back into x; wait() returns t."""
    a = host_array(x)
    staged = not is_view(x)

    def finish(result):
        if staged:
            with torch.no_grad():
                x.copy_(to_tensor(result, x))
        return t

    return Handle(launch(a, out=a), finish)


def _on_device(t: torch.Tensor, x: torch.Tensor, launch: Callable, mean: bool = False) -> Handle:
    """Runs launch(address, count, dtype, stream, keep) on x's device memory (a contiguous copy
    where x is not contiguous, copied back by wait()); `mean`: the sum is divided by the size
    on the device, after the op, on the caller's stream. wait() returns t."""
    y = x if x.is_contiguous() else x.contiguous()
    stream = torch.cuda.current_stream(y.device).cuda_stream
    n = _peer.get().size
    inner = launch(y.data_ptr(), y.numel(), numpy_dtype(y), stream, y)

    def finish(_):
        with torch.no_grad():
            if mean:
                if y.dtype.is_floating_point:
                    y.div_(n)
                else:
                    y.copy_(torch.div(y, n, rounding_mode="floor"))
            if y is not x:
                x.copy_(y)
        return t

    return Handle(inner, finish)


def _device_path(x: torch.Tensor) -> bool:
    return x.device.type == "cuda" and _gpu.nccl_available()


def all_reduce_async(t: torch.Tensor, op: str = "sum", name: Optional[str] = None,
                     timeout: Optional[float] = None) -> Handle:
    """Reduces t in place across workers (op: sum, avg, min, max, prod); wait() returns t."""
    x = _checked("allreduce", t, name, timeout)
    op = op or "sum"
    if _device_path(x):
        return _on_device(t, x, lambda ptr, count, dtype, stream, keep: _device.allreduce_async(
            ptr, ptr, count, dtype, "sum" if op == "avg" else op, name, timeout, stream, keep),
            mean=op == "avg")
    return _in_place(t, x, lambda a, out: _collective.allreduce_async(
        a, op, name, timeout=timeout, out=out))


def all_reduce(t: torch.Tensor, op: str = "sum", name: Optional[str] = None,
               timeout: Optional[float] = None) -> torch.Tensor:
    """Reduces t in place across workers and returns it."""
    return all_reduce_async(t, op, name, timeout).wait()


def all_reduce_fn(t: torch.Tensor, op: str = "sum", name: Optional[str] = None,
                  timeout: Optional[float] = None) -> torch.Tensor:
    """A new tensor (t's dtype, device and shape): t reduced across workers with op. t is left
    as it is; the result does not require grad."""
    x = _checked("allreduce", t, name, timeout)
    result = _collective.allreduce(host_array(x), op or "sum", name, timeout=timeout)
    return to_tensor(result, x)


def all_gather(t: torch.Tensor, name: Optional[str] = None,
               timeout: Optional[float] = None) -> torch.Tensor:
    """Every worker's t stacked on a new leading dimension in rank order: shape
    (size, *t.shape). t must have the same shape and dtype on every worker."""
    x = _checked("allgather", t, name, timeout)
    a = host_array(x)
    rows = _collective.allgather(a.reshape((1,) + a.shape), name, timeout=timeout)
    return to_tensor(rows, x)


def broadcast_async(t: torch.Tensor, root: int = 0, name: Optional[str] = None,
                    timeout: Optional[float] = None) -> Handle:
    """Overwrites t in place with root's t; wait() returns t."""
    x = _checked("broadcast", t, name, timeout)
    if _device_path(x):
        return _on_device(t, x, lambda ptr, count, dtype, stream, keep: _device.broadcast_async(
            ptr, ptr, count, dtype, root, name, timeout, stream, keep))
    return _in_place(t, x, lambda a, out: _collective.broadcast_async(
        a, root, name, timeout=timeout, out=out))


def broadcast(t: torch.Tensor, root: int = 0, name: Optional[str] = None,
              timeout: Optional[float] = None) -> torch.Tensor:
    """A new tensor with root's t (t itself is left as it is)."""
    x = _checked("broadcast", t, name, timeout)
    return to_tensor(_collective.broadcast(host_array(x), root, name, timeout=timeout), x)


def _named_tensors(state) -> List[Tuple[str, torch.Tensor]]:
    items = state.items() if hasattr(state, "items") else state
    return [(str(k), v) for k, v in items if isinstance(v, torch.Tensor)]


def agree_on(entries: Iterable[Tuple[str, torch.Tensor]], what: str, name: str,
             timeout: Optional[float] = None) -> None:
    """Fails on every worker, naming the ranks, unless every worker has the same names, shapes
    and dtypes in `entries`: a worker with another model would otherwise wait on names that no
    other worker ever uses (until the deadline)."""
    entries = list(entries)
    text = "\n".join(f"{k} {tuple(v.shape)} {v.dtype}" for k, v in entries)
    mine = (len(entries), hashlib.sha256(text.encode()).hexdigest()[:16])
    everyone = _collective.allgather_object(mine, name=f"{name}/signature", timeout=timeout)
    if len(set(everyone)) > 1:
        counts = ", ".join(f"rank {r}: {n} tensors ({d})" for r, (n, d) in enumerate(everyone))
        raise InvalidArgumentError(
            f"{what}: the workers' tensors differ in number, names, shapes or dtypes ({counts}); "
            "every worker must build the same model")


def broadcast_parameters(state_dict, root: int = 0, name: Optional[str] = None,
                         timeout: Optional[float] = None) -> None:
    """Overwrites every tensor of state_dict (a module's state_dict(), or (name, tensor) pairs
    such as named_parameters()) in place with root's. Entries that are not tensors are left
    alone. Fails on every worker if their tensors differ in names, shapes or dtypes."""
    base = name or "kungfu.torch.broadcast_parameters"
    tensors = _named_tensors(state_dict)
    agree_on(tensors, "broadcast_parameters", base, timeout)
    handles = [broadcast_async(v, root, f"{base}/{k}", timeout) for k, v in tensors]
    for h in handles:
        h.wait()


# The original KungFu's names.
def inplace_all_reduce_op(t: torch.Tensor, op: Optional[str] = None) -> torch.Tensor:
    return all_reduce(t, op or "sum")


def inplace_all_reduce_async_op(t: torch.Tensor, name: str, op: Optional[str] = None) -> Handle:
    return all_reduce_async(t, op or "sum", name)


def wait_handle(handle: Handle):
    return handle.wait()


def wait_all_handles(handles: Iterable[Handle]) -> list:
    return [h.wait() for h in handles]
