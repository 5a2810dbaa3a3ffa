"""Distributed wrappers for Keras 3 optimizers.

`Optimizer(opt, algorithm=...)` returns an instance of a subclass of `type(opt)`, created from
`opt.get_config()`, whose `apply()` (which `apply_gradients()`, `model.fit` and custom loops all
go through) talks to the other workers before, or around, the wrapped optimizer's own update:

- sync-sgd: the gradients are summed over all workers and divided by the live cluster size,
  then the wrapped optimizer applies the average (clipping, weight decay, loss scaling and
  gradient accumulation of the wrapped optimizer see the averaged gradients);
- sma: each variable that has a gradient is pulled towards the workers' average model,
  v <- v + alpha * (avg(v) - v), then the wrapped optimizer applies the local gradients;
- pair-averaging: each variable is averaged with one uniformly chosen other worker's saved
  model, the wrapped optimizer applies the local gradients, and the worker saves its model for
  the others to fetch.

Every op name is "<prefix>/<what>/<dtype>/<position>": the prefix is `op_prefix` or
"kungfu/<algorithm>/<k>" for the k-th distributed optimizer of the process, the position that of
the bucket's first tensor. Workers that create the same optimizers in the same order and train the
same model therefore issue the same names, step after step.
"""
from __future__ import annotations

import contextlib
import itertools
import math
import numbers
from typing import Dict, List, Optional, Tuple

import keras
import tensorflow as tf

from kungfu._collective import _strategy_code
from kungfu.tensorflow import _internals, _monitor, ops
from kungfu.tensorflow.optimizers._fusion import Averaged
from kungfu.tensorflow.optimizers._fusion import average_gradients as _average_gradients
from kungfu.tensorflow.optimizers._fusion import mean_over_workers as _mean_over_workers

DEFAULT_BUCKET_BYTES = None  # one allreduce per dtype over all its tensors (ops.group_all_reduce)

_ALIASES = {
    "sync-sgd": "sync-sgd",
    "ssgd": "sync-sgd",
    "s-sgd": "sync-sgd",
    "synchronous-sgd": "sync-sgd",
    "sma": "sma",
    "synchronous-averaging": "sma",
    "synchronous-model-averaging": "sma",
    "pair-averaging": "pair-averaging",
    "pair": "pair-averaging",
    "ad-psgd": "pair-averaging",
    "adpsgd": "pair-averaging",
    "async-sgd": "pair-averaging",
}
ALGORITHMS = ("sync-sgd", "sma", "pair-averaging")
_SERIAL = itertools.count()


def _value(v) -> tf.Tensor:
    return tf.convert_to_tensor(v)


class Optimizer:
    """A distributed Keras optimizer.

    `Optimizer(opt, algorithm="sync-sgd", **options)` wraps a Keras 3 optimizer instance and
    returns a new optimizer of a subclass of `type(opt)` (so `isinstance(result, type(opt))`,
    `isinstance(result, keras.optimizers.Optimizer)` and `isinstance(result, Optimizer)` hold).

    algorithm:
      "sync-sgd" (default): average gradients over all workers before applying them.
          options: bucket_bytes (bytes per allreduce, default: one allreduce per dtype over
          all gradients, reduced in place without concatenation), strategy (allreduce
          strategy name, default: the cluster's), and monitoring:
          monitor: "gns" (gradient noise scale) and/or "variance" (gradient variance), a name
              or a list; computed inside the training step from the local and the averaged
              gradients, read with kf.grad_noise_scale() / kf.grad_variance() or in Keras logs
              (with kf.Hook()); default: none.
          monitor_interval: monitor every k-th step (default 1).
          monitor_decay: EMA decay of the estimates, weighting the old value (default 0.9).
          batch_size: this worker's batch size (needed by "gns").
          compression: "fp16" sends float32/float64 gradients as float16 (half the bytes or
              less; each worker's gradient is divided by the cluster size before the cast, so
              the float16 sum is of the mean's parts and overflows no sooner than the mean
              does), the averaged result back in the variable's dtype; None or "none" (default):
              as they are. Horovod's `compression=hvd.Compression.fp16`.
          sparse_as_dense: True (default): IndexedSlices gradients (embeddings) are made dense
              and summed; False: they stay sparse, every worker's rows gathered (exactly the
              dense result once applied; fewer bytes when each worker touches few rows).
          backward_passes_per_step: k (default 1): gradient accumulation, as Horovod's option
              of this name. Each call of apply() adds the gradients of one backward pass; every
              k-th call averages the k passes over the workers (one allreduce per k passes, of
              dense sums) and applies the result once: the step of a k times larger batch. The
              optimizer's iterations count the applied steps.
          average_aggregated_gradients: True (default): the k passes are averaged; False: summed
              (Horovod's default, k times the step; the gradient monitor still sees the mean).
          op: "average" (default) or "adasum": the gradients' Adasum (kf.adasum, per
              variable; Horovod's op=hvd.Adasum), computed by the numpy core in the step (not
              under XLA); without monitor, compression and sparse_as_dense=False.
      "sma": synchronous model averaging. options: alpha (default 0.1), bucket_bytes, strategy.
      "pair-averaging": AD-PSGD, average with one random peer each step. options: none besides
          op_prefix.
    All algorithms accept op_prefix: the prefix of the collective and blob names. It must be the
    same on every worker and differ between optimizers that step in the same process; the
    default, "kungfu/<algorithm>/<k>" for the k-th distributed optimizer this process created,
    is right when every worker creates its distributed optimizers in the same order.

    The wrapped optimizer's configuration is kept: `get_config()` and Keras serialization give
    what the wrapped optimizer gives (a saved model reloads with the plain optimizer). State of an
    already built optimizer (slots, iteration counter) is copied.
    """

    _kf_algorithm: str = ""
    _kf_accepts: Tuple[str, ...] = ("op_prefix",)
    _kf_op_prefix: Optional[str] = None

    def __new__(cls, *args, **kwargs):
        if cls is Optimizer:
            return _wrap(*args, **kwargs)
        return super().__new__(cls)

    def __init__(self, *args, **kwargs):
        # Python calls __init__ again on what Optimizer(opt, ...) returned: it is complete.
        if self.__dict__.get("_kf_complete", False):
            return
        super().__init__(*args, **kwargs)
        object.__setattr__(self, "_kf_serial", next(_SERIAL))

    # -- helpers shared by the algorithms ---------------------------------------------------

    @property
    def kungfu_algorithm(self) -> str:
        """The distributed algorithm: "sync-sgd", "sma" or "pair-averaging"."""
        return self._kf_algorithm

    def kungfu_options(self) -> dict:
        """The algorithm's options (not part of get_config(), which is the wrapped one's)."""
        return {k: getattr(self, "_kf_" + k) for k in self._kf_accepts}

    def _kf_prefix(self) -> str:
        # Not the Keras name: that counts every optimizer the process created, and a worker
        # may create plain optimizers the others do not (e.g. for evaluation on rank 0).
        return self._kf_op_prefix or f"kungfu/{self._kf_algorithm}/{self._kf_serial}"

    def _kf_check_context(self):
        if _internals.in_xla_context():
            raise RuntimeError(
                "kungfu's distributed optimizer cannot run inside an XLA-compiled function "
                "(its collectives have no XLA kernels): compile the model with "
                "jit_compile=False, or use tf.function(jit_compile=False) in a custom loop")

    def _kf_build_if_needed(self, trainable_variables):
        if not self.built:
            if trainable_variables is None:
                raise ValueError(
                    "When passing `grads` without `variables`, the optimizer must already be "
                    "built on a list of variables. Call `optimizer.build(trainable_variables)` "
                    "first.")
            with keras.name_scope(self.name, caller=self):
                self.build(list(trainable_variables))
            self.built = True

    @contextlib.contextmanager
    def _kf_loss_scaled(self, grads, check_finite, loss_scale=None):
        """For a LossScaleOptimizer around this one (_internals.agree_on_overflow): yields the
        gradients it is to
        apply and whether they are finite, the same on every worker. Here: the local gradients,
        finite where every worker's are. loss_scale: the scale the gradients carry."""
        finite = tf.cast(check_finite(grads), tf.int32)
        agreed = ops.all_reduce(finite, op="min", name=f"{self._kf_prefix()}/finite")
        yield grads, agreed > 0

    def _kf_set_options(self, options: dict):
        unknown = sorted(set(options) - set(self._kf_accepts))
        if unknown:
            hint = ""
            if set(unknown) & set(_MONITOR_OPTIONS):
                hint = (" (monitoring needs the averaged gradients, which only the sync-sgd "
                        "algorithm computes)")
            raise TypeError(
                f"unknown option(s) {unknown} for algorithm {self._kf_algorithm!r} "
                f"(accepted: {sorted(self._kf_accepts)}){hint}")
        for k, v in options.items():
            setattr(self, "_kf_" + k, validate_option(k, v))

    def _kf_configured(self):
        """Called once the options are set."""


def validate_option(key: str, value):
    """An option of kf.Optimizer (or kf.DistributedGradientTape), checked and normalized."""
    if key == "op_prefix":
        if value is not None and (not isinstance(value, str) or not value):
            raise ValueError(f"op_prefix must be a non-empty string, got {value!r}")
    elif key == "bucket_bytes":
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
                raise ValueError(f"bucket_bytes must be a positive integer or None, got {value!r}")
            value = int(value)
    elif key == "strategy":
        if value is not None:
            _strategy_code(value)  # raises on an unknown strategy name
    elif key == "monitor":
        value = _monitor.normalize(value)
    elif key == "monitor_interval":
        value = _monitor.check_interval(value)
    elif key == "monitor_decay":
        value = _monitor.check_decay(value)
    elif key == "batch_size":
        value = None if value is None else _monitor.check_batch_size(value)
    elif key == "compression":
        name = getattr(value, "name", value)  # also an object named like Horovod's
        if name is None or name == "none":
            value = None
        elif name == "fp16":
            value = "fp16"
        else:
            raise ValueError(f"compression must be None, 'none' or 'fp16', got {value!r}")
    elif key == "op":
        name = getattr(value, "name", value)
        if name not in ("average", "adasum"):
            raise ValueError(f"op must be 'average' or 'adasum', got {value!r}")
        value = name
    elif key == "sparse_as_dense":
        if not isinstance(value, bool):
            raise ValueError(f"sparse_as_dense must be True or False, got {value!r}")
    elif key == "backward_passes_per_step":
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
            raise ValueError(f"backward_passes_per_step must be a positive integer, got {value!r}")
        value = int(value)
    elif key == "average_aggregated_gradients":
        if not isinstance(value, bool):
            raise ValueError(f"average_aggregated_gradients must be True or False, got {value!r}")
    elif key == "alpha":
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not (
                0.0 < float(value) <= 1.0) or math.isnan(float(value)):
            raise ValueError(f"alpha must be a number in (0, 1], got {value!r}")
        value = float(value)
    return value


_MONITOR_OPTIONS = ("monitor", "monitor_interval", "monitor_decay", "batch_size")


class _SynchronousSGD(Optimizer):
    _kf_algorithm = "sync-sgd"
    _kf_accepts = ("op_prefix", "bucket_bytes", "strategy", "compression",
                   "sparse_as_dense", "backward_passes_per_step",
                   "average_aggregated_gradients", "op") + _MONITOR_OPTIONS
    _kf_bucket_bytes = DEFAULT_BUCKET_BYTES
    _kf_strategy = None
    _kf_compression = None
    _kf_sparse_as_dense = True
    _kf_backward_passes_per_step = 1
    _kf_average_aggregated_gradients = True
    _kf_monitor: Tuple[str, ...] = ()
    _kf_monitor_interval = 1
    _kf_monitor_decay = _monitor.DEFAULT_DECAY
    _kf_batch_size = None
    _kf_op = "average"

    def _kf_configured(self):
        monitor = None
        if self._kf_op == "adasum" and (self._kf_monitor or self._kf_compression
                                        or not self._kf_sparse_as_dense):
            raise ValueError("op='adasum' combines dense gradients as they are: it takes no "
                             "monitor=, compression= nor sparse_as_dense=False")
        if self._kf_monitor and not self._kf_sparse_as_dense:
            raise ValueError("monitor= needs every gradient dense: use sparse_as_dense=True")
        if self._kf_monitor:
            monitor = _monitor.GradientMonitor(self._kf_monitor, self._kf_monitor_interval,
                                               self._kf_monitor_decay, self._kf_batch_size)
        object.__setattr__(self, "_kf_gradient_monitor", monitor)
        # Seconds the last step spent in the gradients' allreduce, from the moment every local
        # gradient was ready (kf.Hook subtracts it from the step time: the worker's compute).
        with tf.init_scope():
            wait = tf.Variable(tf.constant(math.nan, tf.float64), trainable=False,
                               name="kungfu_allreduce_wait")
        object.__setattr__(self, "_kf_wait", wait)

    @property
    def kungfu_allreduce_wait(self) -> float:
        """Seconds the last step waited in the gradients' allreduce (NaN before a step)."""
        return float(self.__dict__["_kf_wait"].numpy())

    @property
    def kungfu_monitor(self) -> Optional[_monitor.GradientMonitor]:
        """The gradient monitor (None without monitor=...)."""
        return self.__dict__.get("_kf_gradient_monitor")

    def _kf_average(self, grads, prefix: Optional[str] = None) -> Averaged:
        """The gradients averaged over the workers (under `prefix`, default _kf_prefix());
        records the wait (kungfu_allreduce_wait)."""
        stamps, started = [], []
        monitor = self.kungfu_monitor

        def ready(local):
            with tf.control_dependencies(local):
                stamps.append(tf.timestamp())
            if monitor is not None:  # its statistics' allreduce runs alongside the gradients'
                step = _value(_internals.iterations_variable(self))
                started.append(monitor.start(local, step,
                                             f"{self._kf_prefix()}/monitor",
                                             self._kf_backward_passes_per_step))

        averaged = _average_gradients(grads, prefix or self._kf_prefix(), self._kf_bucket_bytes,
                                      self._kf_strategy, self._kf_compression,
                                      self._kf_sparse_as_dense, before=ready, op=self._kf_op)
        with tf.control_dependencies(averaged.averaged):
            self.__dict__["_kf_wait"].assign(tf.timestamp() - stamps[0])
        return averaged._replace(started=started[0] if started else None)

    def build(self, variables):
        super().build(variables)
        if self._kf_backward_passes_per_step > 1:
            # The sum of the passes' gradients and the passes since the last update: plain
            # tf.Variables kept out of the optimizer's variables (and checkpoints).
            with tf.init_scope():
                sums = [tf.Variable(tf.zeros(v.shape, v.dtype), trainable=False,
                                    name="kungfu_gradient_sum") for v in variables]
                passes = tf.Variable(tf.constant(0, tf.int64), trainable=False,
                                     name="kungfu_backward_passes")
            object.__setattr__(self, "_kf_sums", sums)
            object.__setattr__(self, "_kf_passes", passes)

    def apply(self, grads, trainable_variables=None):
        self._kf_check_context()
        if self._kf_backward_passes_per_step > 1:
            return self._kf_accumulate(list(grads), trainable_variables)
        averaged = self.__dict__.get("_kf_averaged")
        if averaged is not None:  # a LossScaleOptimizer around this one averaged and unscaled
            return self._kf_apply_averaged(averaged._replace(grads=list(grads)),
                                           trainable_variables)
        return self._kf_apply_averaged(self._kf_average(grads), trainable_variables)

    @contextlib.contextmanager
    def _kf_loss_scaled(self, grads, check_finite, loss_scale=None):
        """Overflow decided on the averaged gradients: the same on every worker, and a sum that
        overflows counts. The LossScaleOptimizer then calls apply() with them unscaled, which
        applies them without a second allreduce (the monitor, which sees the scaled local and
        averaged gradients, is told the scale)."""
        if self._kf_backward_passes_per_step > 1:  # the sums are averaged every k-th pass only
            with super()._kf_loss_scaled(grads, check_finite) as decided:
                yield decided
            return
        averaged = self._kf_average(grads)
        if loss_scale is not None:
            averaged = averaged._replace(loss_scale=tf.identity(loss_scale))
        self.__dict__["_kf_averaged"] = averaged
        try:
            yield averaged.grads, check_finite(averaged.grads)
        finally:
            del self.__dict__["_kf_averaged"]

    def _kf_accumulate(self, grads, trainable_variables):
        """backward_passes_per_step = k: adds this pass's gradients to the sums; every k-th pass
        averages sum / k over the workers (one allreduce for the k passes), applies it as one
        step of the wrapped optimizer and clears the sums. Every worker counts the same passes,
        so all take the same branch. k is in the averages' names: workers given different k
        fail at once on a name mismatch naming both, instead of averaging different windows."""
        self._kf_build_if_needed(trainable_variables)
        variables = list(_internals.trainable_variables(self) if trainable_variables is None
                         else trainable_variables)
        k = self._kf_backward_passes_per_step
        sums = [self._kf_sums[_internals.variable_index(self, v)] for v in variables]
        for total, g in zip(sums, grads):
            if g is not None:
                total.assign_add(tf.convert_to_tensor(g))
        passes = self._kf_passes.assign_add(1)

        def update():
            mean = [None if g is None else tf.convert_to_tensor(total) / k
                    for total, g in zip(sums, grads)]
            averaged = self._kf_average(mean, f"{self._kf_prefix()}/every-{k}-passes")
            if not self._kf_average_aggregated_gradients:  # Horovod's default: the passes' sum
                averaged = averaged._replace(grads=[None if g is None else g * k
                                                    for g in averaged.grads])
            self._kf_apply_averaged(averaged, variables)
            for total in sums:
                total.assign(tf.zeros_like(total))
            return tf.constant(True)

        return tf.cond(passes % k == 0, update, lambda: tf.constant(False))

    def _kf_apply_averaged(self, averaged: Averaged, trainable_variables):
        monitor = self.kungfu_monitor
        step = None
        loss_scale = averaged.loss_scale
        if monitor is not None:
            self._kf_build_if_needed(trainable_variables)
            step = _value(_internals.iterations_variable(self))
            if loss_scale is None and isinstance(self, keras.optimizers.LossScaleOptimizer):
                # kf.Optimizer(LossScaleOptimizer(...)): the gradients averaged here are scaled;
                # the scale read before apply() may change it.
                loss_scale = tf.identity(_value(self.dynamic_scale))
        result = super().apply(averaged.grads, trainable_variables)
        if monitor is not None and averaged.local:
            monitor.update(averaged.local, averaged.averaged, step,
                           f"{self._kf_prefix()}/monitor", averaged.started,
                           self._kf_backward_passes_per_step, loss_scale)
        return result


class _SynchronousAveraging(Optimizer):
    _kf_algorithm = "sma"
    _kf_accepts = ("op_prefix", "alpha", "bucket_bytes", "strategy")
    _kf_alpha = 0.1
    _kf_bucket_bytes = DEFAULT_BUCKET_BYTES
    _kf_strategy = None

    def apply(self, grads, trainable_variables=None):
        self._kf_check_context()
        grads = list(grads)
        self._kf_build_if_needed(trainable_variables)
        variables = list(_internals.trainable_variables(self) if trainable_variables is None
                         else trainable_variables)
        if len(variables) != len(grads):
            raise ValueError(f"got {len(grads)} gradients for {len(variables)} variables")
        pulled = [v for g, v in zip(grads, variables) if g is not None]
        values = [_value(v) for v in pulled]
        averages = _mean_over_workers(values, f"{self._kf_prefix()}/model",
                                      self._kf_bucket_bytes, self._kf_strategy)
        assigns = []
        for v, x, avg in zip(pulled, values, averages):
            alpha = tf.cast(self._kf_alpha, x.dtype)
            assigns.append(v.assign(x + alpha * (avg - x)))
        deps = [a for a in assigns if isinstance(a, (tf.Tensor, tf.Operation))]
        with tf.control_dependencies(deps if not tf.executing_eagerly() else None):
            return super().apply(grads, trainable_variables)


class _PairAveraging(Optimizer):
    _kf_algorithm = "pair-averaging"
    _kf_accepts = ("op_prefix",)

    def build(self, variables):
        super().build(variables)
        # Whether this worker has published its model once and passed the start-up barrier.
        # A plain tf.Variable kept out of the optimizer's variables (and checkpoints).
        with tf.init_scope():
            ready = tf.Variable(False, trainable=False, name="kungfu_pair_averaging_ready")
        object.__setattr__(self, "_kf_ready", ready)

    def _kf_groups(self) -> List[Tuple[tf.DType, list]]:
        groups: Dict[tf.DType, list] = {}
        for v in _internals.trainable_variables(self):
            groups.setdefault(tf.as_dtype(v.dtype), []).append(v)
        return list(groups.items())

    def _kf_blob(self, dtype: tf.DType) -> str:
        return f"{self._kf_prefix()}/model/{dtype.name}"

    def _kf_save(self):
        return [ops.save_variable(ops.fuse([_value(v) for v in vs]), name=self._kf_blob(dt))
                for dt, vs in self._kf_groups()]

    def apply(self, grads, trainable_variables=None):
        self._kf_check_context()
        self._kf_build_if_needed(trainable_variables)
        eager = tf.executing_eagerly()
        ready = self.__dict__["_kf_ready"]
        prefix = self._kf_prefix()

        def first_time():
            saved = self._kf_save()
            with tf.control_dependencies(None if eager else saved):
                passed = ops.barrier(name=f"{prefix}/start")
            with tf.control_dependencies(None if eager else [passed]):
                ready.assign(True)
                return tf.constant(True)

        started = tf.cond(ready.read_value(), lambda: tf.constant(False), first_time)
        rank, size = ops.peer_info()

        def average_with_peer():
            target = choose_peer(_internals.iterations_variable(self), rank, size)
            for dt, vs in self._kf_groups():
                total = sum(tf.TensorShape(v.shape).num_elements() for v in vs)
                fetched = ops.request_variable(target, shape=[total], dtype=dt,
                                               name=self._kf_blob(dt))
                parts = ops.defuse(fetched, [tf.TensorShape(v.shape) for v in vs])
                for v, p in zip(vs, parts):
                    v.assign((_value(v) + p) * tf.cast(0.5, dt))
            return tf.constant(True)

        with tf.control_dependencies(None if eager else [started]):
            averaged = tf.cond(size > 1, average_with_peer, lambda: tf.constant(False))
        with tf.control_dependencies(None if eager else [averaged]):
            result = super().apply(grads, trainable_variables)
        counter = _value(_internals.iterations_variable(self))
        with tf.control_dependencies(None if eager else [counter]):
            self._kf_save()
        return result


def choose_peer(step, rank, size):
    """A worker other than `rank`, uniform over the size - 1 others, as an int32 scalar.

    Drawn from a stateless generator seeded by (step, rank): independent between workers and
    steps, and reproducible. Draws k from [0, size - 1) and skips over `rank`."""
    seed = tf.stack([tf.cast(step, tf.int64), tf.cast(rank, tf.int64)])
    k = tf.random.stateless_uniform([], seed=seed, minval=0, maxval=size - 1, dtype=tf.int32)
    return k + tf.cast(k >= rank, tf.int32)


_CLASSES = {
    "sync-sgd": _SynchronousSGD,
    "sma": _SynchronousAveraging,
    "pair-averaging": _PairAveraging,
}
_DYNAMIC: Dict[tuple, type] = {}


def _distributed_class(algorithm_cls: type, base: type) -> type:
    key = (algorithm_cls, base)
    cls = _DYNAMIC.get(key)
    if cls is None:
        cls = type(base.__name__, (algorithm_cls, base), {
            "__module__": base.__module__,
            "__qualname__": base.__qualname__,
            "__doc__": base.__doc__,
        })
        _internals.serialize_like(cls, base)
        _DYNAMIC[key] = cls
    return cls


def _normalize_algorithm(algorithm) -> str:
    if not isinstance(algorithm, str):
        raise TypeError(f"algorithm must be a string (one of {', '.join(ALGORITHMS)}), "
                        f"got {type(algorithm).__name__}")
    key = algorithm.strip().lower().replace("_", "-")
    if key not in _ALIASES:
        raise ValueError(f"unknown algorithm {algorithm!r}: choose one of "
                         f"{', '.join(repr(a) for a in ALGORITHMS)}")
    return _ALIASES[key]


def _wrap(optimizer=None, algorithm: str = "sync-sgd", **options):
    if isinstance(optimizer, Optimizer):
        raise ValueError(f"this optimizer is already distributed "
                         f"(algorithm {optimizer.kungfu_algorithm!r}); wrap the plain one")
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        what = repr(optimizer) if isinstance(optimizer, str) else type(optimizer).__name__
        raise TypeError(
            "kungfu.Optimizer wraps a Keras 3 optimizer instance (keras.optimizers.Optimizer, "
            f"e.g. keras.optimizers.SGD(0.1)), got {what}")
    name = _normalize_algorithm(algorithm)
    _internals.agree_on_overflow()  # compile may wrap the result in a LossScaleOptimizer
    cls = _distributed_class(_CLASSES[name], type(optimizer))
    config = optimizer.get_config()
    try:
        wrapped = cls.from_config(dict(config))
    except Exception as e:  # noqa: BLE001 - explain which step failed
        raise TypeError(
            f"cannot recreate {type(optimizer).__name__} from its get_config() to distribute "
            f"it: {type(e).__name__}: {e}") from e
    wrapped._kf_set_options(options)
    wrapped._kf_configured()
    if optimizer.built:
        _copy_state(optimizer, wrapped)
    object.__setattr__(wrapped, "_kf_complete", True)
    return wrapped


def _copy_state(src, dst) -> None:
    with tf.init_scope():
        with keras.name_scope(dst.name, caller=dst):
            dst.build(list(_internals.trainable_variables(src)))
        dst.built = True
        if len(src.variables) != len(dst.variables):
            raise ValueError(
                f"cannot copy the state of the built {type(src).__name__}: it has "
                f"{len(src.variables)} variables, the distributed copy {len(dst.variables)}")
        for d, s in zip(dst.variables, src.variables):
            d.assign(s)
