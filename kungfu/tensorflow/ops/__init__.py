"""TensorFlow ops over the kungfu runtime (KungFu-compatible names).

Every collective takes a `name` that must be the same on every worker for the same tensor: the
k-th run of a named op on one worker meets the k-th run of that name on the others. Ops read rank
and size when they run, so a traced `tf.function` stays correct after the cluster changes.
"""
from __future__ import annotations

import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence

import tensorflow as tf

from kungfu import _peer
from kungfu.tensorflow._oplib import lib as _lib
from kungfu.tensorflow.ops import _fusion

_OPS = ("sum", "min", "max", "prod")


def _strategy(strategy: Optional[str]) -> int:
    if strategy is None:
        return -1
    from kungfu import _kungfu

    return _kungfu.parse_strategy(str(strategy))


def _timeout_ms(timeout: Optional[float]) -> int:
    if timeout is None:
        return -1
    if timeout <= 0:
        raise ValueError(f"timeout must be positive, got {timeout}")
    return int(timeout * 1000)


def _name(name: Optional[str], t, kind: str, caller: Optional[str] = None) -> str:
    """`name`, or in graph mode one derived from the tensor's name (prefixed with `kind`).
    Every collective op passes here: a joiner of an elastic job connects now (its first
    collective; see kungfu._peer.get), as the kernels need the process's peer."""
    _peer.get()
    if name:
        return name
    tname = getattr(t, "name", None)
    if tname and not tf.executing_eagerly():
        return f"{kind}:{tname}"
    raise ValueError(
        f"{caller or kind}: pass name= in eager mode (the same name on every worker for the "
        "same tensor)"
    )


# Inside a tf.function the collectives of _oplib.UNORDERED_OPS run in no fixed order (each is
# matched across workers by name), except among ops of one name: the k-th run of a name must be
# the k-th on every worker, so each such op waits for the previous one of its name in its graph.
# Graph -> {kungfu op name: TensorFlow name of its latest op}. Names, not operations: an
# operation refers to its graph, which would keep every traced graph alive as a weak key.
_last_of_name: "weakref.WeakKeyDictionary[tf.Graph, Dict[str, str]]" = weakref.WeakKeyDictionary()


def _issue(op_name: str, build: Callable[[str], Any]):
    """build(op_name), after the graph's previous op of that name."""
    if tf.executing_eagerly():
        return build(op_name)
    graph = tf.compat.v1.get_default_graph()
    last = _last_of_name.setdefault(graph, {})
    prev = last.get(op_name)
    with tf.control_dependencies([graph.get_operation_by_name(prev)] if prev else None):
        out = build(op_name)
    last[op_name] = (out[0] if isinstance(out, (list, tuple)) else out).op.name
    return out


def all_reduce(t, op: str = "sum", name: Optional[str] = None, strategy: Optional[str] = None,
               timeout: Optional[float] = None):
    """Reduces t over all workers with op (sum, min, max, prod); every worker gets the result."""
    if op not in _OPS:
        raise ValueError(f"unknown reduce op {op!r} (choose {', '.join(_OPS)})")
    return _issue(_name(name, t, "all_reduce"), lambda n: _lib.kungfu_all_reduce(
        t, op=op, op_name=n, strategy=_strategy(strategy), timeout_ms=_timeout_ms(timeout)))


def fuse(ts: Sequence[tf.Tensor]) -> tf.Tensor:
    """Concatenates the flattened tensors into one 1-D tensor."""
    return tf.concat([tf.reshape(t, [-1]) for t in ts], axis=0)


def defuse(t: tf.Tensor, shapes: Sequence) -> List[tf.Tensor]:
    """Splits a fused tensor back into tensors of the given shapes (static, or shape tensors)."""
    sizes = [tf.reduce_prod(s) if isinstance(s, tf.Tensor) else tf.TensorShape(s).num_elements()
             for s in shapes]
    if any(isinstance(n, tf.Tensor) for n in sizes):
        sizes = tf.stack([tf.cast(n, tf.int64) for n in sizes])
    return [tf.reshape(p, s) for p, s in zip(tf.split(t, sizes), shapes)]


def group_all_reduce(ts: Sequence[tf.Tensor], op: str = "sum", name: Optional[str] = None,
                     bucket_bytes: Optional[int] = None, strategy: Optional[str] = None,
                     timeout: Optional[float] = None):
    """all_reduce of many tensors: one collective per dtype over all its tensors, reduced where
    they lie (nothing is concatenated; the runtime packs the small ones).

    Returns the reduced tensors in the order given. Every worker must pass the same tensors in
    the same order. bucket_bytes splits each dtype's tensors into ops of about that many bytes
    (default: one op per dtype, which needs no negotiation among the workers: the fastest). Ops
    are named "<name>/<dtype>/<index of their first tensor>" (name defaults to "group").
    """
    if op not in _OPS:
        raise ValueError(f"unknown reduce op {op!r} (choose {', '.join(_OPS)})")
    if bucket_bytes is not None and (isinstance(bucket_bytes, bool) or bucket_bytes <= 0):
        raise ValueError(f"bucket_bytes must be a positive integer or None, got {bucket_bytes!r}")
    _peer.get()
    return _fusion.grouped_apply(
        ts, name or "group", bucket_bytes,
        lambda group, n: _issue(n, lambda n: _lib.kungfu_group_all_reduce(
            group, op=op, op_name=n, strategy=_strategy(strategy), timeout_ms=_timeout_ms(timeout))))


def broadcast(t, root: int = 0, name: Optional[str] = None, strategy: Optional[str] = None,
              timeout: Optional[float] = None):
    """root's t on every worker (same shape and dtype everywhere)."""
    return _issue(_name(name, t, "broadcast"), lambda n: _lib.kungfu_broadcast(
        t, root=int(root), op_name=n, strategy=_strategy(strategy), timeout_ms=_timeout_ms(timeout)))


def all_gather(t, name: Optional[str] = None, timeout: Optional[float] = None):
    """Every worker's t concatenated along axis 0, in rank order (axis-0 sizes may differ)."""
    return _issue(_name(name, t, "all_gather"), lambda n: _lib.kungfu_all_gather(
        t, op_name=n, timeout_ms=_timeout_ms(timeout)))


def barrier(name: str = "kungfu::tf-barrier", timeout: Optional[float] = None):
    """An op that completes once every worker has run it."""
    _peer.get()
    return _lib.kungfu_barrier(op_name=name, timeout_ms=_timeout_ms(timeout))


def consensus(t, name: Optional[str] = None, timeout: Optional[float] = None):
    """A bool scalar: True on every worker iff every worker passed the same bytes."""
    return _lib.kungfu_consensus(t, op_name=_name(name, t, "consensus"),
                                 timeout_ms=_timeout_ms(timeout))


def peer_info():
    """(rank, size) as int32 scalars, read when the op runs."""
    return _lib.kungfu_peer_info()


def rank():
    return peer_info()[0]


def cluster_size():
    return peer_info()[1]


def counter(init: int = 0, incr: int = 1):
    """init, init + incr, ... on successive runs (per op instance)."""
    return _lib.kungfu_counter(init=init, incr=incr)


def save_variable(t, name: Optional[str] = None):
    """Publishes t in this worker's store under `name` (atomically replacing the old value). The
    store holds the tensor itself, not a copy (TensorFlow leaves a shared buffer unchanged)."""
    return _lib.kungfu_save_variable(t, blob_name=_name(name, t, "blob", "save_variable"))


def request_variable(target, version=None, name: Optional[str] = None, shape=None, dtype=None,
                     *, timeout: Optional[float] = None, like=None):
    """Worker `target`'s stored blob `name` as a tensor of `shape` and `dtype` (or like `like`).
    The arguments come in KungFu's order, so calls ported from it mean the same; `version`
    must be None (the store keeps the latest value of a name, not versions of it)."""
    if version is not None:
        raise ValueError(f"request_variable: version={version!r}: kungfu's store keeps the "
                         "latest value of each name only; pass version=None")
    if like is not None:
        shape = like.shape if shape is None else shape
        dtype = like.dtype if dtype is None else dtype
        name = name or _name(None, like, "blob", "request_variable")
    if name is None:
        raise ValueError("request_variable needs name=")
    return _lib.kungfu_request_variable(tf.cast(target, tf.int32), T=tf.as_dtype(dtype),
                                        blob_name=name, shape=tf.TensorShape(shape),
                                        timeout_ms=_timeout_ms(timeout))


def global_noise_scale(batch_small, batch_big, tensor, avg_tensor, alpha: float = 0.6,
                       name: Optional[str] = None):
    """KungFu's gradient noise scale op; see kungfu.tensorflow._monitor.global_noise_scale."""
    from kungfu.tensorflow import _monitor

    return _monitor.global_noise_scale(batch_small, batch_big, tensor, avg_tensor, alpha, name)


__all__ = [
    "global_noise_scale",
    "all_reduce", "group_all_reduce", "broadcast", "all_gather", "barrier", "consensus",
    "peer_info", "rank", "cluster_size", "counter", "fuse", "defuse", "save_variable",
    "request_variable",
]
