"""Collectives over numpy arrays and Python scalars (no TensorFlow)."""
from __future__ import annotations

import functools
import math
import numbers
import threading
from contextlib import contextmanager
from typing import Any, Callable, Optional

import numpy as np

from kungfu import _env, _native, _peer
from kungfu._process_set import ProcessSet, members as _members
from kungfu.errors import InvalidArgumentError, OpTimeoutError, raise_for_status

_NO_TIMEOUT = -1

# Set by kungfu._join inside its Join block: every collective of the cluster describes itself
# there just before it is issued (a worker that has joined takes part in it from that).
_announce: Optional[Callable[..., None]] = None


def _announced(kind: str, name, array: np.ndarray, ranks, **extra) -> None:
    if _announce is not None:
        _announce(kind, name, array, ranks, **extra)


@functools.lru_cache(maxsize=64)  # called per operation: dtype.name is slow to build
def _dtype_code(dtype: np.dtype) -> int:
    codes = _native.table("dtype_codes")
    code = codes.get(np.dtype(dtype).name)
    if code is None:
        raise InvalidArgumentError(
            f"dtype {np.dtype(dtype).name} is not supported (supported: {', '.join(codes)})"
        )
    return code


# An average of these the runtime returns as the mean itself (each worker's part divided and
# summed in float32: their sum may overflow where the mean fits; OpOptions::average in op.h);
# of other floats it returns the sum, which the caller divides.
_MEAN_IN_RUNTIME = ("float16", "bfloat16")


def _divide(recv: np.ndarray, n: int) -> None:
    """recv = the sum it holds divided by n (in float64, a block at a time: no temporary the
    size of the result), unless the runtime made it the mean already."""
    if recv.dtype.name not in _MEAN_IN_RUNTIME:
        np.divide(recv, n, out=recv, dtype=np.float64, casting="unsafe")


def _strategy_code(strategy: Optional[str]) -> int:
    if strategy is None:
        return -1
    try:
        return _native.strategy_code(strategy)
    except ValueError as e:
        raise InvalidArgumentError(str(e)) from None


# The longest deadline an operation may be given: the runtime adds it to the clock in
# nanoseconds, so much larger values would wrap around into the past.
_MAX_TIMEOUT_S = 1e9


def _seconds(timeout) -> bool:
    return (isinstance(timeout, numbers.Real) and not isinstance(timeout, bool)
            and math.isfinite(timeout))


def _timeout_ms(timeout: Optional[float]) -> int:
    if timeout is None:
        return _NO_TIMEOUT
    if not _seconds(timeout) or not 0 < timeout <= _MAX_TIMEOUT_S:
        raise InvalidArgumentError(
            f"timeout must be a number of seconds in (0, {_MAX_TIMEOUT_S:g}] or None, "
            f"got {timeout!r}")
    return max(1, int(timeout * 1000))


def _root(root) -> int:
    if not isinstance(root, numbers.Integral) or isinstance(root, bool):
        raise InvalidArgumentError(f"root must be an int, got {type(root).__name__}")
    return int(root)


class _Input:
    """A contiguous array view of x, and how to give a result back in x's own type."""

    def __init__(self, x: Any):
        if isinstance(x, np.ndarray):
            self.kind = "array"
        elif isinstance(x, np.generic):
            self.kind = "numpy-scalar"
        elif isinstance(x, (bool, int, float)):
            self.kind = "python-scalar"
        else:
            raise InvalidArgumentError(
                f"expected a numpy array or a Python/numpy scalar, got {type(x).__name__}"
            )
        a = np.asarray(x)
        # (np.ascontiguousarray would make a 0-d array 1-d; the result keeps x's shape)
        self.array = a if a.flags.c_contiguous else a.copy(order="C")
        self.code = _dtype_code(self.array.dtype)

    def back(self, result: np.ndarray):
        if self.kind == "array":
            return result
        if self.kind == "numpy-scalar":
            return result.reshape(()).astype(self.array.dtype)[()]
        return result.reshape(()).item()


# Results smaller than this come from np.empty: malloc serves them from memory it keeps
# (no page faults once a loop runs); larger ones would be mapped and faulted in afresh per call.
_POOLED_FROM = 1 << 20


@functools.lru_cache(maxsize=None)
def _result_pool():
    """The native pool of result memory (its size limit read from the environment once), or
    None where KUNGFU_RESULT_POOL_BYTES=0 turned it off."""
    cap = _env.RESULT_POOL_BYTES.get()
    if cap == 0:
        return None
    native = _native.lib()
    native.set_result_pool_bytes(cap)
    return native


def _new_result(shape: tuple, dtype: np.dtype) -> np.ndarray:
    """An uninitialized array for a result (np.empty's contract), its memory reused from
    earlier results of the same size once those are freed (see _POOLED_FROM, ResultPool in
    srcs/cpp/python/module.cc)."""
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    pool = _result_pool() if nbytes >= _POOLED_FROM else None
    if pool is None:
        return np.empty(shape, dtype)
    return pool.pooled_empty(nbytes).view(dtype).reshape(shape)


def _output(inp: "_Input", out) -> np.ndarray:
    """The buffer a result is written to: `out` (checked) or a new array like the input."""
    if out is None:
        return _new_result(inp.array.shape, inp.array.dtype)
    if not isinstance(out, np.ndarray):
        raise InvalidArgumentError(f"out must be a numpy array, got {type(out).__name__}")
    if out.shape != inp.array.shape or out.dtype != inp.array.dtype:
        raise InvalidArgumentError(
            f"out has shape {out.shape} and dtype {out.dtype}, expected {inp.array.shape} "
            f"and {inp.array.dtype}"
        )
    if not out.flags.c_contiguous or not out.flags.writeable:
        raise InvalidArgumentError("out must be C-contiguous and writeable")
    # In place is fine (the runtime knows send == recv); a partial overlap would have the
    # operation overwrite input it has not sent yet.
    if (np.may_share_memory(out, inp.array)
            and out.__array_interface__["data"][0] != inp.array.__array_interface__["data"][0]):
        raise InvalidArgumentError("out overlaps x without being x itself")
    return out


class Handle:
    """An operation in flight. `wait()` returns its result or raises its error.

    The operation itself keeps its buffers alive until it completes (the native module pins
    them), so dropping a handle, or giving up on it, is safe."""

    def __init__(self, native, result: Callable[[], Any]):
        self._native = native
        self._result = result
        # The result is made once, by the first wait() that sees the operation done (an avg
        # divides; a second division would change the array the first wait returned).
        self._lock = threading.Lock()
        self._made = False
        self._value = None

    def done(self) -> bool:
        return self._native.poll()

    def wait(self, timeout: Optional[float] = None):
        """Blocks until completion (at most `timeout` seconds) and returns the result.

        A wait that times out raises OpTimeoutError but does not cancel the operation, which
        still ends by its own deadline.
        """
        if timeout is not None and (not _seconds(timeout) or timeout < 0):
            raise InvalidArgumentError(f"timeout must be a number of seconds >= 0 or None, "
                                       f"got {timeout!r}")
        if not self._native.wait(-1.0 if timeout is None else float(timeout)):
            raise OpTimeoutError(f"operation still running after {timeout} s")
        raise_for_status(self._native.status())
        with self._lock:
            if not self._made:
                self._value = self._result()
                self._made = True
            return self._value

    def add_done_callback(self, fn: Callable[["Handle"], None]) -> None:
        """Calls fn(handle) once the operation completes (on a runtime thread, with the GIL)."""
        self._native.add_done_callback(lambda _status: fn(self))


@contextmanager
def _takes_part(kind: str, name, timeout, ranks=()):
    """Input this worker rejects still takes part: the operation's sequence number is taken and
    failed on every worker (the others fail at once with the reason; later operations stay
    paired). Wraps everything up to the native call.

    A name that is not a str cannot say which operation to fail (failing the default name's
    would shift that numbering instead): it is only raised here. `ranks`: the process set's
    members (empty: every worker), the only workers whose operation fails."""
    if name is not None and not isinstance(name, str):
        raise InvalidArgumentError(f"name must be a str or None, got {type(name).__name__}")
    try:
        yield
    except InvalidArgumentError as e:
        try:
            ms = _timeout_ms(timeout)
        except InvalidArgumentError:
            ms = _NO_TIMEOUT  # the bad timeout is what was rejected: the default deadline
        try:
            peer = _peer.get()
            if peer.size > 1:
                peer.fail(kind, name or "", f"rejected on rank {peer.rank}: {e}", ms, list(ranks))
        except Exception:  # no peer to tell (it failed to start): the error below says enough
            pass
        raise


@functools.lru_cache(maxsize=4096)  # called per operation: a training loop has few shapes
def _shape_digest(shape: tuple) -> int:
    """A nonzero 64-bit digest (FNV-1a) of a shape: peers compare it (the whole shape for
    allreduce and broadcast, the dimensions after the first for allgather and gather)."""
    h = 0xcbf29ce484222325
    for d in (len(shape),) + tuple(shape):
        for byte in int(d).to_bytes(8, "little", signed=True):
            h = ((h ^ byte) * 0x100000001b3) & 0xFFFFFFFFFFFFFFFF
    return h or 1


class _IntegerMean:
    """The exact floor of the mean of integers, by one sum that cannot overflow.

    Each worker sends x = q*n + r (q = x // n, 0 <= r < n) as the pair (q, r) in 64 bits. The
    mean's floor is sum(q) + sum(r) // n. sum(r) < n*n. sum(q) wraps only when the mean itself is
    within n of the 64-bit limits, and then wraps back once sum(r) // n is added (sums wrap, as
    numpy's), so the result is exact for every integer dtype."""

    def __init__(self, x: np.ndarray, n: int, axis: int = 0):
        """The pairs of x stacked along `axis` (0: all q, then all r)."""
        wide = np.int64 if np.issubdtype(x.dtype, np.signedinteger) else np.uint64
        w = x.astype(wide)
        with np.errstate(over="ignore"):
            q = w // wide(n)
            r = w - q * wide(n)
        self.n = n
        self.axis = axis
        self.dtype = np.dtype(wide)
        self.send = np.stack([q, r], axis=axis)

    def into(self, sums: np.ndarray, out: np.ndarray) -> None:
        """out = the mean, from the sums of the pairs (stacked as send was)."""
        q, r = np.moveaxis(sums, self.axis, 0)
        with np.errstate(over="ignore"):
            mean = q + r // self.dtype.type(self.n)
        out[...] = mean.reshape(out.shape).astype(out.dtype)


def allreduce_async(x, op: str = "sum", name: Optional[str] = None, strategy: Optional[str] = None,
                    timeout: Optional[float] = None, out: Optional[np.ndarray] = None,
                    process_set: Optional[ProcessSet] = None) -> Handle:
    ranks = _members(process_set, "allreduce")
    with _takes_part("allreduce", name, timeout, ranks):
        ops = _native.table("reduce_ops")
        if op not in ops and op != "avg":
            raise InvalidArgumentError(f"unknown reduce op {op!r} (choose sum, avg, min, max, prod)")
        inp = _Input(x)
        average = op == "avg"
        if average and inp.array.dtype == np.bool_:
            raise InvalidArgumentError("op 'avg' is not defined for bool")
        _announced("allreduce", name, inp.array, ranks, o=op, st=strategy)
        peer = _peer.get()
        n = len(ranks) or peer.size
        recv = _output(inp, out)
        send, into, code = inp.array, recv, inp.code
        exact = None
        if average and np.issubdtype(inp.array.dtype, np.integer):
            exact = _IntegerMean(inp.array, n)
            send, code = exact.send, _dtype_code(exact.dtype)
            into = np.empty_like(send)
        # avg is a sum on the wire; the signature says avg, so sum here and avg there fail.
        native = peer.allreduce(send.reshape(-1).view(np.uint8), into.reshape(-1).view(np.uint8),
                                send.size, code, ops["sum" if average else op], name or "",
                                _strategy_code(strategy), _timeout_ms(timeout),
                                _shape_digest(inp.array.shape), average, ranks)

    def result():
        if exact is not None:
            exact.into(into, recv)
        elif average:
            _divide(recv, n)
        return inp.back(recv)

    return Handle(native, result)


def allreduce(x, op: str = "sum", name: Optional[str] = None, strategy: Optional[str] = None,
              timeout: Optional[float] = None, out: Optional[np.ndarray] = None,
              process_set: Optional[ProcessSet] = None):
    """Reduces x across all workers with op (sum, avg, min, max, prod); every worker gets the result.

    x must have the same shape and dtype on every worker, and op must be the same (else every
    worker fails, naming both). avg on integers is the floor of the exact mean (no overflow,
    whatever the dtype: the workers sum a 64-bit quotient and remainder); avg on floats divides
    the sum, except float16/bfloat16, whose avg is each worker's value divided by the size and
    summed in float32 (their sum may overflow where the mean fits). float16/bfloat16 are
    computed in float32 per step.
    min and max propagate NaN (NaN wins, as numpy's minimum/maximum). `out` (an array of x's
    shape and dtype, x itself for in place) receives the result without a new allocation.
    """
    return allreduce_async(x, op, name, strategy, timeout, out, process_set).wait()


def reduce_async(x, op: str = "sum", root: int = 0, name: Optional[str] = None,
                 strategy: Optional[str] = None, timeout: Optional[float] = None,
                 process_set: Optional[ProcessSet] = None) -> Handle:
    ranks = _members(process_set, "reduce")
    with _takes_part("reduce", name, timeout, ranks):
        ops = _native.table("reduce_ops")
        if op not in ops:
            raise InvalidArgumentError(f"unknown reduce op {op!r} (choose sum, min, max, prod)")
        inp = _Input(x)
        _announced("reduce", name, inp.array, ranks, o=op, r=_root(root), st=strategy)
        peer = _peer.get()
        send = inp.array
        recv = _new_result(send.shape, send.dtype)
        native = peer.reduce(send.reshape(-1).view(np.uint8), recv.reshape(-1).view(np.uint8),
                             send.size, inp.code, ops[op], _root(root), name or "",
                             _strategy_code(strategy), _timeout_ms(timeout), ranks)
    me = _set_rank(peer, ranks)
    return Handle(native, lambda: inp.back(recv) if me == root else None)


def reduce(x, op: str = "sum", root: int = 0, name: Optional[str] = None,
           strategy: Optional[str] = None, timeout: Optional[float] = None,
           process_set: Optional[ProcessSet] = None):
    """Reduces x to worker `root`; returns the result there and None elsewhere."""
    return reduce_async(x, op, root, name, strategy, timeout, process_set).wait()


def broadcast_async(x, root: int = 0, name: Optional[str] = None, strategy: Optional[str] = None,
                    timeout: Optional[float] = None, out: Optional[np.ndarray] = None,
                    process_set: Optional[ProcessSet] = None) -> Handle:
    ranks = _members(process_set, "broadcast")
    with _takes_part("broadcast", name, timeout, ranks):
        inp = _Input(x)
        _announced("broadcast", name, inp.array, ranks, r=_root(root), st=strategy)
        peer = _peer.get()
        send = inp.array
        recv = _output(inp, out)
        native = peer.broadcast(send.reshape(-1).view(np.uint8), recv.reshape(-1).view(np.uint8),
                                send.size, inp.code, _root(root), name or "",
                                _strategy_code(strategy), _timeout_ms(timeout),
                                _shape_digest(send.shape), ranks)
    return Handle(native, lambda: inp.back(recv))


def broadcast(x, root: int = 0, name: Optional[str] = None, strategy: Optional[str] = None,
              timeout: Optional[float] = None, out: Optional[np.ndarray] = None,
              process_set: Optional[ProcessSet] = None):
    """Returns root's x on every worker. x must have the same shape and dtype everywhere."""
    return broadcast_async(x, root, name, strategy, timeout, out, process_set).wait()


def _set_rank(peer, ranks) -> int:
    """This worker's rank in the process set `ranks` (its own rank for the whole cluster)."""
    return ranks.index(peer.rank) if ranks else peer.rank


def _gathered(native, inp: _Input, root: Optional[int], me: int, with_rows: bool = False):
    """The concatenation of what the workers sent (None on a gather's other workers); with
    `with_rows`, (the concatenation, how many rows came from each worker)."""
    def result():
        if root is not None and me != root:
            return None
        counts, data = native.gathered()
        row = inp.array.shape[1:] if inp.array.ndim > 0 else ()
        row_size = int(np.prod(row)) if row else 1
        flat = data.view(inp.array.dtype)
        for c in counts:
            if row_size and c % row_size:
                raise InvalidArgumentError(
                    f"workers passed arrays whose shapes differ beyond axis 0 (this one: "
                    f"{inp.array.shape}, another has {c} elements)"
                )
        rows = flat.reshape((-1,) + tuple(row))
        if not with_rows:
            return rows
        return rows, [int(c) // row_size if row_size else 0 for c in counts]

    return result


def allgather_async(x, name: Optional[str] = None, timeout: Optional[float] = None,
                    process_set: Optional[ProcessSet] = None, with_rows: bool = False) -> Handle:
    """allgather, started; with `with_rows` its result is (the concatenation, the number of
    rows each worker sent, in rank order)."""
    ranks = _members(process_set, "allgather")
    with _takes_part("allgather", name, timeout, ranks):
        inp = _Input(x)
        _announced("allgather", name, inp.array, ranks)
        peer = _peer.get()
        send = inp.array
        native = peer.allgather(send.reshape(-1).view(np.uint8), send.size, inp.code, name or "",
                                _timeout_ms(timeout), _shape_digest(send.shape[1:]), ranks)
    return Handle(native, _gathered(native, inp, None, _set_rank(peer, ranks), with_rows))


def allgather(x, name: Optional[str] = None, timeout: Optional[float] = None,
              process_set: Optional[ProcessSet] = None) -> np.ndarray:
    """Concatenates every worker's x along axis 0 in rank order (sizes along axis 0 may differ;
    a scalar counts as one row). Workers whose arrays differ beyond axis 0 all fail."""
    return allgather_async(x, name, timeout, process_set).wait()


def gather_async(x, root: int = 0, name: Optional[str] = None,
                 timeout: Optional[float] = None,
                 process_set: Optional[ProcessSet] = None) -> Handle:
    ranks = _members(process_set, "gather")
    with _takes_part("gather", name, timeout, ranks):
        inp = _Input(x)
        _announced("gather", name, inp.array, ranks, r=_root(root))
        peer = _peer.get()
        send = inp.array
        native = peer.gather(send.reshape(-1).view(np.uint8), send.size, inp.code, _root(root),
                             name or "", _timeout_ms(timeout), _shape_digest(send.shape[1:]), ranks)
    return Handle(native, _gathered(native, inp, int(root), _set_rank(peer, ranks)))


def gather(x, root: int = 0, name: Optional[str] = None, timeout: Optional[float] = None,
           process_set: Optional[ProcessSet] = None):
    """Like allgather, but only `root` gets the concatenation; the others get None."""
    return gather_async(x, root, name, timeout, process_set).wait()


def _rows(inp: "_Input", what: str) -> int:
    if inp.array.ndim == 0:
        raise InvalidArgumentError(f"{what} needs an array of rank >= 1 (its rows are split), "
                                   "got a scalar")
    return inp.array.shape[0]


def _even_parts(rows: int, n: int) -> list:
    """rows split among n workers, the first rows % n taking one row more."""
    return [rows // n + (1 if j < rows % n else 0) for j in range(n)]


def alltoall_async(x, splits=None, name: Optional[str] = None,
                   timeout: Optional[float] = None,
                   process_set: Optional[ProcessSet] = None, with_rows: bool = False) -> Handle:
    """alltoall, started; with `with_rows` its result is (the rows, how many came from each
    worker: the splits to send them back with)."""
    ranks = _members(process_set, "alltoall")
    with _takes_part("alltoall", name, timeout, ranks):
        inp = _Input(x)
        rows = _rows(inp, "alltoall")
        peer = _peer.get()
        n = len(ranks) or peer.size
        if splits is None:
            if rows % n:
                raise InvalidArgumentError(
                    f"alltoall: {rows} rows do not split evenly among {n} workers; pass splits=")
            splits = [rows // n] * n
        splits = splits.tolist() if isinstance(splits, np.ndarray) else list(splits)
        if (len(splits) != n or any(isinstance(c, bool) or not isinstance(c, numbers.Integral)
                                    or c < 0 for c in splits) or sum(splits) != rows):
            raise InvalidArgumentError(
                f"alltoall: splits must be {n} non-negative ints that add up to the {rows} rows "
                f"of x, got {splits!r}")
        _announced("alltoall", name, inp.array, ranks)
        row = int(np.prod(inp.array.shape[1:], dtype=np.int64))
        send = inp.array
        native = peer.alltoall(send.reshape(-1).view(np.uint8), [int(c) * row for c in splits],
                               inp.code, name or "", _timeout_ms(timeout),
                               _shape_digest(send.shape[1:]), ranks)
    return Handle(native, _gathered(native, inp, None, _set_rank(peer, ranks), with_rows))


def alltoall(x, splits=None, name: Optional[str] = None, timeout: Optional[float] = None,
             process_set: Optional[ProcessSet] = None):
    """Worker r sends rows of x to every worker: splits[j] rows (in order) to worker j, equal
    parts when splits is None. Returns the rows every worker sent this one, in rank order.
    Dimensions after the first must agree everywhere; splits may differ per worker."""
    return alltoall_async(x, splits, name, timeout, process_set).wait()


def reducescatter_async(x, op: str = "sum", name: Optional[str] = None,
                        timeout: Optional[float] = None,
                        process_set: Optional[ProcessSet] = None) -> Handle:
    ranks = _members(process_set, "reducescatter")
    with _takes_part("reducescatter", name, timeout, ranks):
        ops = _native.table("reduce_ops")
        if op not in ops and op != "avg":
            raise InvalidArgumentError(f"unknown reduce op {op!r} (choose sum, avg, min, max, prod)")
        inp = _Input(x)
        rows = _rows(inp, "reducescatter")
        average = op == "avg"
        if average and inp.array.dtype == np.bool_:
            raise InvalidArgumentError("op 'avg' is not defined for bool")
        peer = _peer.get()
        _announced("reducescatter", name, inp.array, ranks, o=op)
        n, me = len(ranks) or peer.size, _set_rank(peer, ranks)
        parts = _even_parts(rows, n)
        shape = (parts[me],) + inp.array.shape[1:]
        recv = _new_result(shape, inp.array.dtype)
        send, into, code, exact = inp.array, recv, inp.code, None
        if average and np.issubdtype(inp.array.dtype, np.integer):
            # The exact mean's (q, r) pairs, kept row by row so that rows split as x's do.
            exact = _IntegerMean(inp.array, n, axis=1)
            send, code = exact.send, _dtype_code(exact.dtype)
            into = np.empty((parts[me],) + send.shape[1:], exact.dtype)
        row = int(np.prod(send.shape[1:], dtype=np.int64))
        native = peer.reducescatter(send.reshape(-1).view(np.uint8), into.reshape(-1).view(np.uint8),
                                    [c * row for c in parts], code,
                                    ops["sum" if average else op], name or "",
                                    _timeout_ms(timeout), _shape_digest(inp.array.shape), average,
                                    ranks)

    def result():
        if exact is not None:
            exact.into(into, recv)
        elif average:
            _divide(recv, n)
        return recv

    return Handle(native, result)


def reducescatter(x, op: str = "sum", name: Optional[str] = None,
                  timeout: Optional[float] = None,
                  process_set: Optional[ProcessSet] = None) -> np.ndarray:
    """x reduced over all workers with op (sum, avg, min, max, prod) and split along axis 0:
    worker r gets part r, the first rows % size workers one row more. x must have the same
    shape and dtype everywhere. avg as in allreduce (exact for integers)."""
    return reducescatter_async(x, op, name, timeout, process_set).wait()


def broadcast_object(obj: Any = None, root: int = 0, name: Optional[str] = None,
                     timeout: Optional[float] = None,
                     process_set: Optional[ProcessSet] = None) -> Any:
    """root's obj on every worker (of process_set, if given; root is a rank in it) (pickled;
    any size). The others' obj is ignored. Unpickling runs code chosen by root, as with any
    pickle: use it within one job. An object root cannot pickle fails on every worker with
    root's reason (root still takes part: it broadcasts the reason instead of the object)."""
    import pickle

    base = name or "kungfu::broadcast_object"
    failed = None
    data = b""
    ps = {"process_set": process_set}
    if _set_rank(_peer.get(), _members(process_set, "broadcast_object")) == root:
        try:
            data = pickle.dumps(obj)
        except Exception as e:  # noqa: BLE001 - whatever pickling raises, every worker hears it
            failed = e
            data = f"{type(e).__name__}: {e}".encode()
    # The length and whether it is root's pickling error, so every worker can allocate what
    # the broadcast writes and knows what it is.
    head = broadcast(np.array([len(data), failed is not None], np.int64), root, f"{base}/size",
                     timeout=timeout, **ps)
    buf = np.frombuffer(data, np.uint8) if data else np.zeros(int(head[0]), np.uint8)
    got = broadcast(buf, root, f"{base}/bytes", timeout=timeout, **ps).tobytes()
    if failed is not None:
        raise failed
    if head[1]:
        raise pickle.PicklingError(f"broadcast_object: the root (rank {root}) cannot pickle its "
                                   f"object: {got.decode(errors='replace')}")
    return pickle.loads(got)


def allgather_object(obj: Any, name: Optional[str] = None,
                     timeout: Optional[float] = None,
                     process_set: Optional[ProcessSet] = None) -> list:
    """Every worker's obj (of process_set's workers, if given), in rank order (pickled; any
    size)."""
    import pickle

    base = name or "kungfu::allgather_object"
    data = np.frombuffer(pickle.dumps(obj), np.uint8)
    sizes = allgather(np.array([data.size], np.int64), f"{base}/size", timeout=timeout,
                      process_set=process_set)
    everything = allgather(data, f"{base}/bytes", timeout=timeout,
                           process_set=process_set).tobytes()
    ends = np.cumsum(sizes)
    return [pickle.loads(everything[e - s:e]) for s, e in zip(sizes.tolist(), ends.tolist())]


def barrier(name: Optional[str] = None, timeout: Optional[float] = None,
            process_set: Optional[ProcessSet] = None) -> None:
    """Returns once every worker (of process_set, if given) has entered the barrier."""
    ranks = _members(process_set, "barrier")
    with _takes_part("barrier", name, timeout, ranks):
        _announced("barrier", name, np.zeros(0, np.uint8), ranks)
        native = _peer.get().barrier(name or "", _timeout_ms(timeout), ranks)
    Handle(native, lambda: None).wait()


def consensus_async(x, name: Optional[str] = None, timeout: Optional[float] = None,
                    process_set: Optional[ProcessSet] = None) -> Handle:
    ranks = _members(process_set, "consensus")
    with _takes_part("consensus", name, timeout, ranks):
        if isinstance(x, str):
            data = np.frombuffer(x.encode(), dtype=np.uint8)
        elif isinstance(x, (bytes, bytearray, memoryview)):
            data = np.frombuffer(bytes(x), dtype=np.uint8)
        else:
            data = np.ascontiguousarray(_Input(x).array).reshape(-1).view(np.uint8)
        _announced("consensus", name, data, ranks)
        native = _peer.get().consensus(data, name or "", _timeout_ms(timeout), ranks)
    return Handle(native, native.agreed)


def consensus(x, name: Optional[str] = None, timeout: Optional[float] = None,
              process_set: Optional[ProcessSet] = None) -> bool:
    """True on every worker iff every worker passed the same bytes (array, scalar, str or bytes)."""
    return consensus_async(x, name, timeout, process_set).wait()


def save(name: str, x) -> None:
    """Serves a copy of array `x` to peers as this worker's blob `name` (replacing the last one
    saved under that name, atomically: a request sees the old or the new bytes, never a mix),
    until it is replaced or dropped. A peer takes it with request(); nothing waits here."""
    if not isinstance(name, str) or not name:
        raise InvalidArgumentError(f"save: name must be a non-empty str, got {name!r}")
    inp = _Input(x)
    raise_for_status(_peer.get().save(name, inp.array.reshape(-1).view(np.uint8), inp.code))


def request_async(target: int, name: str, like=None, out: Optional[np.ndarray] = None,
                  timeout: Optional[float] = None) -> Handle:
    """Worker `target`'s blob `name` (saved with save()), into `out` or a new array shaped and
    typed like `like`. The blob must be exactly that large and of that dtype (else
    InvalidArgumentError naming both); a target without it fails with NotFoundError naming the
    target and the blob."""
    if not isinstance(name, str) or not name:
        raise InvalidArgumentError(f"request: name must be a non-empty str, got {name!r}")
    if out is None:
        if like is None:
            raise InvalidArgumentError("request: give like= (the blob's shape and dtype) or out=")
        like = np.asarray(like)
        out = np.empty(like.shape, like.dtype)
    elif not (isinstance(out, np.ndarray) and out.flags.c_contiguous and out.flags.writeable):
        raise InvalidArgumentError("request: out must be a writable C-contiguous numpy array")
    peer = _peer.get()
    if isinstance(target, bool) or not isinstance(target, (int, np.integer)) \
            or not 0 <= int(target) < peer.size:
        raise InvalidArgumentError(f"request: target must be a rank in [0, {peer.size}), got "
                                   f"{target!r}")
    native = peer.request(int(target), name, out.reshape(-1).view(np.uint8),
                          _dtype_code(out.dtype), _timeout_ms(timeout))
    return Handle(native, lambda: out)


def request(target: int, name: str, like=None, out: Optional[np.ndarray] = None,
            timeout: Optional[float] = None) -> np.ndarray:
    """request_async(...).wait(): worker `target`'s blob `name` as an array."""
    return request_async(target, name, like, out, timeout).wait()


def drop(name: str) -> None:
    """Forgets this worker's stored blob `name` (save(), or kungfu.tensorflow.ops.save_variable);
    a later request for it fails with NotFound."""
    _peer.get().drop(name)
