"""The collective ops and their gradients (kungfu/tensorflow/ops/__init__.py has the module's
names; _adapt.py KungFu's other ops, built on these)."""
from __future__ import annotations

import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence

import tensorflow as tf

import numpy as np

from kungfu import _join, _peer
from kungfu._collective import _strategy_code as _strategy, _timeout_ms
from kungfu._process_set import ProcessSet, members as _members
from kungfu.errors import InvalidArgumentError
from kungfu.tensorflow._oplib import lib as _lib
from kungfu.tensorflow.ops import _fusion

_OPS = ("sum", "min", "max", "prod")
_REDUCE_OPS = _OPS + ("avg",)


def _check_op(op: str) -> None:
    if op not in _REDUCE_OPS:
        raise ValueError(f"unknown reduce op {op!r} (choose {', '.join(_REDUCE_OPS)})")


def _set_attrs(process_set: Optional[ProcessSet], what: str) -> dict:
    """The attrs that run an op in process_set (none for the whole cluster), after the checks of
    kungfu/_process_set.py, made when the op is built; the runtime checks the version again when
    it runs (a traced function that outlives a resize)."""
    ranks = _members(process_set, what)
    return {"process_set": ranks, "process_set_version": process_set.version} if ranks else {}


def _set_of(op) -> Optional[ProcessSet]:
    """The process set an op was built for (its gradient runs in the same set)."""
    ranks = list(op.get_attr("process_set"))
    return ProcessSet._of(ranks, op.get_attr("process_set_version")) if ranks else None


def _size(process_set: Optional[ProcessSet]):
    return cluster_size() if process_set is None else process_set.size()


def _rank(process_set: Optional[ProcessSet]):
    return rank() if process_set is None else process_set.rank()


def _averaged(t, axis: int, process_set: Optional[ProcessSet] = None):
    """(what to sum for avg of t, how to finish the sum): floats divide by the cluster size (read
    when the op runs) or the set's (float16 and bfloat16: the runtime does); integers sum a
    64-bit (x // n, x % n) pair stacked along `axis` and take sum(q) + sum(r) // n, the floor of
    the exact mean whatever the dtype (as kf.allreduce)."""
    t = tf.convert_to_tensor(t)
    if t.dtype == tf.bool:
        raise ValueError("op 'avg' is not defined for bool")
    if t.dtype in (tf.float16, tf.bfloat16):
        # The runtime returns their mean itself (each worker's part divided and summed in
        # float32: their sum may overflow where the mean fits; OpOptions::average, op.h).
        return t, lambda s: s
    if t.dtype.is_floating:
        return t, lambda s: s / tf.cast(_size(process_set), s.dtype)
    wide = tf.uint64 if t.dtype.is_unsigned else tf.int64
    n = tf.cast(_size(process_set), wide)
    w = tf.cast(t, wide)
    q = tf.math.floordiv(w, n)
    pairs = tf.stack([q, w - q * n], axis=axis)

    def finish(s):
        q_sum, r_sum = tf.unstack(s, num=2, axis=axis)
        return tf.cast(q_sum + tf.math.floordiv(r_sum, n), t.dtype)

    return pairs, finish


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


def _joining(kind: str, name: str, ts=(), attrs=None, **fields) -> list:
    """Inside kungfu's Join block (kungfu/_join.py), before the op `name` runs: an allreduce of
    the whole cluster is described to the workers that have joined (which run it with zeros,
    _serve_joined); any other collective is refused, on this worker, at once. Returns what the
    op must run after: nothing eagerly (the description is sent now); in a function traced
    inside the block, the op that describes it each time it runs. That op runs after the
    inputs are computed (a step whose data ran out describes nothing) and does nothing once the
    block has ended or this worker has joined."""
    if not _join.active():
        return []
    if kind != "allreduce" or attrs:
        raise InvalidArgumentError(
            f"{kind} '{name}': inside kungfu's Join, TensorFlow's collectives are supported only "
            "as allreduces of the whole cluster (all_reduce, group_all_reduce, kf.Optimizer, "
            "DistributedGradientTape, model.fit with kf.JoinCallback)")
    dtype = ts[0].dtype.name

    def announce(*shapes):
        _join.announce(kind, name, via="tf", s=[[int(d) for d in s] for s in shapes], d=dtype,
                       **fields)
        return np.int64(0)

    if tf.executing_eagerly():
        announce(*(t.shape.as_list() for t in ts))
        return []
    with tf.control_dependencies(ts):
        described = tf.numpy_function(announce, [tf.shape(t, out_type=tf.int64) for t in ts],
                                      tf.int64, stateful=True, name="kungfu_join_describe")
    return [described]


def _serve_joined(desc: dict, timeout: Optional[float]) -> None:
    """What a joined worker runs for a described allreduce: the same op over zeros (the identity
    of min, max and prod)."""
    dtype = tf.dtypes.as_dtype(desc["d"])
    fill = _join.identity("sum" if desc["a"] else desc["o"], np.dtype(dtype.as_numpy_dtype))
    ts = [tf.fill(s, tf.constant(fill, dtype)) for s in desc["s"]]
    kw = dict(op=desc["o"], average=desc["a"], op_name=desc["n"], strategy=desc["st"],
              timeout_ms=_timeout_ms(timeout))
    if desc["g"]:
        _lib.kungfu_group_all_reduce(ts, **kw)
    else:
        _lib.kungfu_all_reduce(ts[0], **kw)


_join.register_server("tf", _serve_joined)


def all_reduce(t, op: str = "sum", name: Optional[str] = None, strategy: Optional[str] = None,
               timeout: Optional[float] = None, process_set: Optional[ProcessSet] = None):
    """Reduces t over all workers with op (sum, avg, min, max, prod); every worker gets the
    result. t must have the same shape and dtype everywhere. avg of integers is the floor of the
    exact mean. tf.IndexedSlices (sparse gradients) are allgathered: sum or avg only."""
    _check_op(op)
    if isinstance(t, tf.IndexedSlices):
        return _sparse_all_reduce(t, op, name, timeout, process_set)
    attrs = _set_attrs(process_set, "all_reduce")
    name = _name(name, t, "all_reduce")
    def reduce(x, average):
        def build(n):
            o = "sum" if average else op
            after = _joining("allreduce", n, [x], attrs, o=o, a=average,
                             st=_strategy(strategy), g=False)
            with tf.control_dependencies(after):  # [] adds nothing (None would clear)
                return _lib.kungfu_all_reduce(x, op=o, average=average, op_name=n,
                                              strategy=_strategy(strategy),
                                              timeout_ms=_timeout_ms(timeout), **attrs)
        return _issue(name, build)
    if op != "avg":
        return reduce(t, False)
    summed, finish = _averaged(t, axis=0, process_set=process_set)
    return finish(reduce(summed, True))


def _sparse_all_reduce(t: tf.IndexedSlices, op: str, name, timeout, process_set=None):
    """The sum (or avg) of IndexedSlices: every worker's indices and values, gathered (rows with
    the same index add up when the slices are applied or made dense)."""
    if op not in ("sum", "avg"):
        raise ValueError(f"all_reduce of tf.IndexedSlices supports sum and avg, not {op!r}")
    name = _name(name, t.values, "all_reduce")
    values = all_gather(t.values, name=f"{name}/values", timeout=timeout, process_set=process_set)
    if op == "avg":
        values = values / tf.cast(_size(process_set), values.dtype)
    indices = all_gather(t.indices, name=f"{name}/indices", timeout=timeout,
                         process_set=process_set)
    return tf.IndexedSlices(values, indices, dense_shape=t.dense_shape)


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
                     timeout: Optional[float] = None, process_set: Optional[ProcessSet] = None):
    """all_reduce of many tensors: one collective per dtype over all its tensors, reduced where
    they lie (nothing is concatenated; the runtime packs the small ones).

    Returns the reduced tensors in the order given. Every worker must pass the same tensors in
    the same order. bucket_bytes splits each dtype's tensors into ops of about that many bytes
    (default: one op per dtype, which needs no negotiation among the workers: the fastest). Ops
    are named "<name>/<dtype>/<index of their first tensor>" (name defaults to "group"). avg as
    in all_reduce.
    """
    _check_op(op)
    if bucket_bytes is not None and (isinstance(bucket_bytes, bool) or bucket_bytes <= 0):
        raise ValueError(f"bucket_bytes must be a positive integer or None, got {bucket_bytes!r}")
    _peer.get()
    attrs = _set_attrs(process_set, "group_all_reduce")
    average = op == "avg"
    finishes = None
    if average:
        ts, finishes = zip(*(_averaged(t, axis=0, process_set=process_set) for t in ts))
    o = "sum" if average else op

    def build(group, n):
        after = _joining("allreduce", n, group, attrs, o=o, a=average, st=_strategy(strategy),
                         g=True)
        with tf.control_dependencies(after):  # [] adds nothing (None would clear)
            return _lib.kungfu_group_all_reduce(group, op=o, average=average, op_name=n,
                                                strategy=_strategy(strategy),
                                                timeout_ms=_timeout_ms(timeout), **attrs)
    out = _fusion.grouped_apply(ts, name or "group", bucket_bytes,
                                lambda group, n: _issue(n, lambda n: build(group, n)))
    return [f(s) for f, s in zip(finishes, out)] if average else out


def broadcast(t, root: int = 0, name: Optional[str] = None, strategy: Optional[str] = None,
              timeout: Optional[float] = None, process_set: Optional[ProcessSet] = None):
    """root's t on every worker (same shape and dtype everywhere)."""
    attrs = _set_attrs(process_set, "broadcast")
    _joining("broadcast", name or "")
    return _issue(_name(name, t, "broadcast"), lambda n: _lib.kungfu_broadcast(
        t, root=int(root), op_name=n, strategy=_strategy(strategy), timeout_ms=_timeout_ms(timeout),
        **attrs))


def all_gather(t, name: Optional[str] = None, timeout: Optional[float] = None,
               process_set: Optional[ProcessSet] = None):
    """Every worker's t concatenated along axis 0, in rank order (axis-0 sizes may differ)."""
    attrs = _set_attrs(process_set, "all_gather")
    _joining("allgather", name or "")
    return _issue(_name(name, t, "all_gather"), lambda n: _lib.kungfu_all_gather(
        t, op_name=n, timeout_ms=_timeout_ms(timeout), **attrs))


def all_to_all(t, splits=None, name: Optional[str] = None, timeout: Optional[float] = None,
               process_set: Optional[ProcessSet] = None):
    """Worker r sends splits[j] rows of t to worker j (equal parts when None; then the rows must
    divide evenly) and gets the rows every worker sent it, in rank order. Dimensions after the
    first must agree everywhere; splits may differ per worker."""
    attrs = _set_attrs(process_set, "all_to_all")
    _joining("alltoall", name or "")
    t = tf.convert_to_tensor(t)
    if splits is None:
        rows = tf.shape(t, out_type=tf.int64)[0]
        n = tf.cast(_size(process_set), tf.int64)
        check = tf.debugging.assert_equal(
            rows % n, tf.constant(0, tf.int64),
            message="all_to_all: the rows of t do not split evenly among the workers; pass splits=")
        with tf.control_dependencies([check]):
            splits = tf.fill(tf.reshape(n, [1]), rows // n)
    splits = tf.cast(splits, tf.int64)
    return _issue(_name(name, t, "all_to_all"), lambda n: _lib.kungfu_all_to_all(
        t, splits, op_name=n, timeout_ms=_timeout_ms(timeout), **attrs))


def reduce_scatter(t, op: str = "sum", name: Optional[str] = None,
                   timeout: Optional[float] = None, process_set: Optional[ProcessSet] = None):
    """t reduced over all workers with op (sum, avg, min, max, prod) and split along axis 0:
    worker r gets part r, the first (rows % size) workers one row more. t must have the same
    shape and dtype everywhere."""
    _check_op(op)
    attrs = _set_attrs(process_set, "reduce_scatter")
    _joining("reducescatter", name or "")
    name = _name(name, t, "reduce_scatter")
    reduce = lambda x, average: _issue(name, lambda n: _lib.kungfu_reduce_scatter(  # noqa: E731
        x, op="sum" if average else op, average=average, op_name=n,
        timeout_ms=_timeout_ms(timeout), **attrs))
    if op != "avg":
        return reduce(t, False)
    summed, finish = _averaged(t, axis=1, process_set=process_set)  # pairs row by row: rows split as t's do
    return finish(reduce(summed, True))


def barrier(name: str = "kungfu::tf-barrier", timeout: Optional[float] = None,
            process_set: Optional[ProcessSet] = None):
    """An op that completes once every worker (of process_set, if given) has run it."""
    _peer.get()
    attrs = _set_attrs(process_set, "barrier")
    _joining("barrier", name)
    return _lib.kungfu_barrier(op_name=name, timeout_ms=_timeout_ms(timeout), **attrs)


def consensus(t, name: Optional[str] = None, timeout: Optional[float] = None,
              process_set: Optional[ProcessSet] = None):
    """A bool scalar: True on every worker iff every worker passed the same bytes."""
    attrs = _set_attrs(process_set, "consensus")
    _joining("consensus", name or "")
    return _lib.kungfu_consensus(t, op_name=_name(name, t, "consensus"),
                                 timeout_ms=_timeout_ms(timeout), **attrs)


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


# Versions of a blob kept per name (KungFu's window): see srcs/cpp/tensorflow/p2p_versions.cc.
VERSION_WINDOW = 3


def save_variable(t, version=None, name: Optional[str] = None):
    """Publishes t in this worker's store under `name` (atomically replacing the old value). The
    store holds the tensor itself, not a copy (TensorFlow leaves a shared buffer unchanged).

    With `version` (an integer >= 0, or an int tensor, e.g. the step), t is version `version`
    of `name`: this worker keeps the last VERSION_WINDOW (3) versions it saved of each name and
    drops older ones, so a peer that lags by a step or two still finds the one it asks for.
    Versioned and unversioned blobs of one name are separate."""
    name = _name(name, t, "blob", "save_variable")
    if version is None:
        return _lib.kungfu_save_variable(t, blob_name=name)
    return _lib.kungfu_save_variable_version(_version(version, "save_variable"), t,
                                             blob_name=name)


def _version(version, caller: str):
    if isinstance(version, bool) or (isinstance(version, int) and version < 0):
        raise ValueError(f"{caller}: version must be an integer >= 0, got {version!r}")
    version = tf.convert_to_tensor(version)
    if not version.dtype.is_integer:
        raise ValueError(f"{caller}: version must be an integer, got a {version.dtype.name} "
                         "tensor")
    return tf.cast(version, tf.int64)


def request_variable(target, version=None, name: Optional[str] = None, shape=None, dtype=None,
                     *, timeout: Optional[float] = None, like=None):
    """Worker `target`'s stored blob `name` as a tensor of `shape` and `dtype` (or like `like`).
    The arguments come in KungFu's order, so calls ported from it mean the same. With
    `version`, that version of the blob (saved with save_variable(t, version=...)); a version
    the target never saved, or dropped (older than its last VERSION_WINDOW), fails with
    NotFoundError naming the target and the blob ("<name>@v<version>")."""
    if like is not None:
        shape = like.shape if shape is None else shape
        dtype = like.dtype if dtype is None else dtype
        name = name or _name(None, like, "blob", "request_variable")
    if name is None:
        raise ValueError("request_variable needs name=")
    _peer.get()
    target = tf.cast(target, tf.int32)
    if version is None:
        return _lib.kungfu_request_variable(target, T=tf.as_dtype(dtype), blob_name=name,
                                            shape=tf.TensorShape(shape),
                                            timeout_ms=_timeout_ms(timeout))
    return _lib.kungfu_request_variable_version(
        target, _version(version, "request_variable"), T=tf.as_dtype(dtype), blob_name=name,
        shape=tf.TensorShape(shape), timeout_ms=_timeout_ms(timeout))


def global_noise_scale(batch_small, batch_big, tensor, avg_tensor, alpha: float = 0.6,
                       name: Optional[str] = None):
    """KungFu's gradient noise scale op; see kungfu.tensorflow._monitor.global_noise_scale."""
    from kungfu.tensorflow import _monitor

    return _monitor.global_noise_scale(batch_small, batch_big, tensor, avg_tensor, alpha, name)


# -- gradients ----------------------------------------------------------------------------
# Gradients of the collectives, so that a model that calls one in its forward pass trains.
#
# Each gradient is itself a collective, named after the forward op ("<op_name>/grad"), so every
# worker runs the same ones in the same order. What each is: Horovod's conventions, the same as
# kungfu.torch's (docs/porting-from-horovod.md, "Gradients of the collectives"):
# - all_reduce (sum): the sum of the incoming gradients over the workers. avg divides after the
#   sum, outside the op, so TensorFlow differentiates the division itself: the average of the
#   incoming gradients, as Horovod's. min, max and prod have none (their gradient depends on
#   every worker's input): an error says so.
# - group_all_reduce: the same for each tensor.
# - broadcast: the AVERAGE of the incoming gradients over the workers, on the root; zeros
#   elsewhere (the others' inputs do not reach the output).
# - all_gather: the AVERAGE of the incoming gradients over the workers, then this worker's rows.
# - all_to_all: the incoming gradient's rows sent back to where they came from (an all_to_all with
#   the splits this worker received).
# - reduce_scatter (sum): every worker's part of the incoming gradient, gathered, times the
#   number of workers. avg divides after the op, outside it: the parts gathered, unscaled.
# The averages and the factor of size treat each worker's loss as a share of one loss averaged
# over the workers (what a data-parallel optimizer that averages gradients then applies).


def _attr(op, name: str):
    value = op.get_attr(name)
    return value.decode() if isinstance(value, bytes) else value


def _grad_name(op) -> str:
    return _attr(op, "op_name") + "/grad"


def _summable(op, what: str) -> None:
    kind = _attr(op, "op")
    if kind != "sum":
        raise LookupError(f"{what}(op={kind!r}) has no gradient: only sum and avg do")


@tf.RegisterGradient("KungfuAllReduce")
def _all_reduce_grad(op, grad):
    _summable(op, "all_reduce")
    return all_reduce(grad, op="sum", name=_grad_name(op), process_set=_set_of(op))


@tf.RegisterGradient("KungfuGroupAllReduce")
def _group_all_reduce_grad(op, *grads):
    _summable(op, "group_all_reduce")
    grads = [tf.zeros_like(x) if g is None else g for x, g in zip(op.inputs, grads)]
    return group_all_reduce(grads, op="sum", name=_grad_name(op), process_set=_set_of(op))


@tf.RegisterGradient("KungfuBroadcast")
def _broadcast_grad(op, grad):
    ps = _set_of(op)
    mean = all_reduce(grad, op="avg", name=_grad_name(op), process_set=ps)
    return tf.where(tf.equal(_rank(ps), op.get_attr("root")), mean, tf.zeros_like(mean))


def _rows_before(rows, name: str, ps: Optional[ProcessSet] = None):
    """(this worker's first row, its row count) in a concatenation of every worker's rows."""
    counts = all_gather(tf.reshape(tf.cast(rows, tf.int64), [1]), name=name, process_set=ps)
    me = _rank(ps)
    return tf.reduce_sum(counts[:me]), counts[me]


@tf.RegisterGradient("KungfuAllGather")
def _all_gather_grad(op, grad):
    name, ps = _grad_name(op), _set_of(op)
    mean = all_reduce(grad, op="avg", name=name, process_set=ps)
    start, rows = _rows_before(tf.shape(op.inputs[0])[0], f"{name}/rows", ps)
    return mean[start:start + rows]


@tf.RegisterGradient("KungfuAllToAll")
def _all_to_all_grad(op, grad):
    name, ps = _grad_name(op), _set_of(op)
    # received[j]: the rows worker j sent this one = worker j's splits[me].
    every = all_gather(tf.reshape(op.inputs[1], [1, -1]), name=f"{name}/splits", process_set=ps)
    received = every[:, _rank(ps)]
    return all_to_all(grad, splits=received, name=name, process_set=ps), None


@tf.RegisterGradient("KungfuReduceScatter")
def _reduce_scatter_grad(op, grad):
    _summable(op, "reduce_scatter")
    ps = _set_of(op)
    return all_gather(grad * tf.cast(_size(ps), grad.dtype), name=_grad_name(op), process_set=ps)
