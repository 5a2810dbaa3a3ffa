"""Gradient monitoring inside the training step: gradient noise scale and gradient variance.

A `GradientMonitor` belongs to one synchronous-SGD optimizer. Every `interval` steps, inside the
same step as the update (no extra pass over the model), it runs:

1. the statistics of the step, the same on every worker (srcs/cpp/tensorflow/monitor.cc has
   the formulas):
   - with the gradient variance: KungfuGradientStats, one fused pass over the local and the
     averaged gradients and one allreduce of six doubles, after the gradients' allreduce
     (|g_i - g|^2 needs the average g);
   - the noise scale alone: KungfuLocalGradientStats, an allreduce of six doubles from the
     local gradients, started (`start`) before the gradients are sent so that in a
     tf.function it runs while they are averaged (eagerly, before them), and
     KungfuGradientStatsOfSums with |g|^2 of the averages afterwards, without another round
     trip;
2. KungfuNoiseScale and/or KungfuGradientVariance: the EMA-smoothed estimates, from the
   statistics and the state kept in this monitor's variables.

The latest estimates are variables too: `kf.grad_noise_scale()` and `kf.grad_variance()` read
those of the most recently built monitor, `kf.Hook` puts them in Keras's logs.
"""
from __future__ import annotations

import math
import numbers
from typing import Dict, Iterable, NamedTuple, Optional, Sequence, Tuple, Union

import tensorflow as tf

from kungfu.tensorflow._oplib import lib as _lib

GNS = "gns"
VARIANCE = "variance"
MONITORS = (GNS, VARIANCE)
# Keras log keys of the estimates.
LOG_KEYS = {GNS: "gns", VARIANCE: "grad_variance"}
DEFAULT_DECAY = 0.9
_ALIASES = {
    "gns": GNS,
    "noise-scale": GNS,
    "grad-noise-scale": GNS,
    "gradient-noise-scale": GNS,
    "variance": VARIANCE,
    "grad-variance": VARIANCE,
    "gradient-variance": VARIANCE,
}
# The most recently built monitor of each quantity (what kf.grad_noise_scale() reads).
_LATEST: Dict[str, "GradientMonitor"] = {}


def normalize(monitor: Union[None, str, Iterable[str]]) -> Tuple[str, ...]:
    """The monitored quantities, in MONITORS order, from a name or a list of names."""
    if monitor is None:
        return ()
    names = [monitor] if isinstance(monitor, str) else monitor
    try:
        names = list(names)
    except TypeError:
        raise TypeError(f"monitor must be a name or a list of names ({', '.join(MONITORS)}), "
                        f"got {type(monitor).__name__}") from None
    chosen = set()
    for m in names:
        key = m.strip().lower().replace("_", "-") if isinstance(m, str) else None
        if key not in _ALIASES:
            raise ValueError(f"unknown monitor {m!r}: choose from {', '.join(MONITORS)}")
        chosen.add(_ALIASES[key])
    return tuple(m for m in MONITORS if m in chosen)


def check_batch_size(value, what: str = "batch_size") -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not (
            math.isfinite(float(value)) and float(value) > 0):
        raise ValueError(f"{what} must be a positive number (this worker's batch size), "
                         f"got {value!r}")
    return float(value)


def check_interval(value) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"monitor_interval must be a positive integer, got {value!r}")
    return int(value)


def check_decay(value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not (
            0.0 <= float(value) < 1.0):
        raise ValueError(f"monitor_decay must be a number in [0, 1), got {value!r}")
    return float(value)


def _variable(value, name: str) -> tf.Variable:
    with tf.init_scope():
        return tf.Variable(tf.constant(value, tf.float64), trainable=False, name=name)


def gradient_stats(local: Sequence, averaged: Sequence, batch_size, name: str,
                   timeout_ms: int = -1, scale=1.0) -> tf.Tensor:
    """[mean_i |g_i|^2, |g|^2, mean_i |g_i - g|^2, mean_i 1/B_i, n, 1/B_big], the same on every
    worker (srcs/cpp/tensorflow/monitor.cc).

    local: this worker's gradients, which times `scale` are the mean gradient g_i of its
    batch_size samples B_i; averaged: the average g over the workers, in which this worker's
    gradient weighs 1 / (n scale). A collective: every worker must run it with the same name."""
    local, averaged = list(local), list(averaged)
    if len(local) != len(averaged) or not local:
        raise ValueError(f"gradient statistics need as many averaged as local gradients "
                         f"(at least one), got {len(local)} and {len(averaged)}")
    local = [tf.convert_to_tensor(t) for t in local]
    averaged = [tf.cast(tf.convert_to_tensor(a), t.dtype) for a, t in zip(averaged, local)]
    return _lib.kungfu_gradient_stats(local, averaged, tf.cast(batch_size, tf.float64),
                                      tf.cast(scale, tf.float64), op_name=name,
                                      timeout_ms=timeout_ms)


class Started(NamedTuple):
    """What GradientMonitor.start began before the gradients' allreduce."""
    due: tf.Tensor  # whether the monitors run this step
    reduced: tf.Tensor  # the six sums of KungfuLocalGradientStats (NaN when not due)


class GradientMonitor:
    """The state and ops of the monitors of one optimizer (see the module docstring)."""

    def __init__(self, monitors: Sequence[str], interval: int = 1,
                 decay: float = DEFAULT_DECAY, batch_size: Optional[float] = None):
        self.monitors = tuple(monitors)
        self.interval = check_interval(interval)
        self.decay = check_decay(decay)
        # The gradient noise scale needs this worker's batch size. Without batch_size=, kf.Hook
        # sets it (from kungfu's data, or from model.fit's first batch); until then the
        # monitors do not run (0). The variance does not depend on it; 1 keeps the statistics
        # op's check.
        self.batch_known = batch_size is not None or GNS not in self.monitors
        initial = 1.0 if GNS not in self.monitors else 0.0
        self.batch_size = _variable(initial if batch_size is None else
                                    check_batch_size(batch_size), "kungfu_monitor_batch_size")
        # This worker's gradient times local_scale is the mean over its own samples: kungfu's
        # data weighs samples so that the average over workers is the mean over the step's
        # slice (weight n p / L for a part of p samples), which differs from 1 when the parts
        # differ in size (kf.set_batch_sizes, an epoch's last step). kf.Hook sets it per step.
        self.local_scale = _variable(1.0, "kungfu_monitor_local_scale")
        self.gns_state = _variable([0.0, 0.0, 0.0, math.nan], "kungfu_gns_state")
        self.variance_state = _variable([0.0, 0.0], "kungfu_grad_variance_state")
        self.values = {m: _variable(math.nan, f"kungfu_{LOG_KEYS[m]}") for m in self.monitors}
        # The statistics of the last monitored step (see gradient_stats; stats[2] is NaN
        # without the variance monitor); stats[4] is the cluster size that step ran with.
        self.stats = _variable([math.nan] * 6, "kungfu_gradient_stats")
        for m in self.monitors:
            _LATEST[m] = self

    def set_batch_size(self, batch_size) -> None:
        """This worker's batch size from the next monitored step on."""
        self.batch_size.assign(check_batch_size(batch_size))
        self.batch_known = True

    def set_part(self, batch_size: int, weight: float) -> None:
        """This worker's part of the next step: its samples and their weight (kf.ElasticData's
        part); a part of weight 0 (no sample of its own) counts as one sample of zero
        gradient."""
        if (batch_size, weight) != getattr(self, "_part", None):
            self._part = (batch_size, weight)
            self.set_batch_size(batch_size)
            self.local_scale.assign(1.0 / weight if weight > 0 else 0.0)

    def value(self, monitor: str) -> float:
        return float(self.values[monitor].numpy())

    def _due(self, step) -> tf.Tensor:
        due = self.batch_size > 0  # the batch size is known
        if self.interval != 1:
            due = tf.logical_and(
                due, tf.equal(tf.math.floormod(tf.cast(step, tf.int64), self.interval), 0))
        return due

    def _name(self, name: str) -> str:
        """The statistics' collective name: `name` and the monitor setting. Workers whose
        kf.Optimizer(monitor=...) differ ("gns" on one, "variance" on another: different
        statistics, which summed under one name gave half the right variance) then run
        differently named collectives, and the runtime's name check fails every one of them
        within KUNGFU_MISMATCH_GRACE, naming both settings."""
        every = f"/every-{self.interval}" if self.interval != 1 else ""
        return f"{name}/{'+'.join(self.monitors)}{every}"

    def _batch(self, passes: int) -> tf.Tensor:
        """The samples behind this worker's gradient: its batch size times the backward passes
        averaged into it (kf.Optimizer's backward_passes_per_step)."""
        return self.batch_size * float(passes)

    def start(self, local: Sequence, step, name: str, passes: int = 1) -> Optional[Started]:
        """Before the gradients' allreduce: starts the statistics that need only the local
        gradients, so that their allreduce runs alongside the gradients' (in a tf.function;
        eagerly it runs first). None where update() computes everything after the average
        (the gradient variance needs it)."""
        if VARIANCE in self.monitors or not local:
            return None
        due = self._due(step)

        def run():
            return _lib.kungfu_local_gradient_stats(
                [tf.convert_to_tensor(t) for t in local], self._batch(passes),
                tf.identity(self.local_scale), op_name=self._name(name))

        return Started(due, tf.cond(due, run, lambda: tf.constant([math.nan] * 6, tf.float64)))

    def update(self, local: Sequence, averaged: Sequence, step, name: str,
               started: Optional[Started] = None, passes: int = 1, loss_scale=None):
        """Runs the monitors if step % interval == 0, from start()'s statistics where it began
        them; returns a bool tensor: whether they ran. passes: the backward passes averaged
        into each local gradient; loss_scale: the scale L the gradients carry (mixed
        precision), taken out of the squared norms (L^2)."""

        def statistics():
            if started is not None:
                # mean_i |g_i - g|^2 is not known there (NaN): the noise scale does not need it.
                return _lib.kungfu_gradient_stats_of_sums(
                    started.reduced, [tf.convert_to_tensor(a) for a in averaged])
            return gradient_stats(local, averaged, self._batch(passes), self._name(name),
                                  scale=tf.identity(self.local_scale))

        def run():
            stats = statistics()
            if loss_scale is not None:
                u = 1.0 / tf.square(tf.cast(loss_scale, tf.float64))
                one = tf.constant(1.0, tf.float64)
                stats = stats * tf.stack([u, u, u, one, one, one])
            self.stats.assign(stats)
            estimators = {
                GNS: (_lib.kungfu_noise_scale, self.gns_state),
                VARIANCE: (_lib.kungfu_gradient_variance, self.variance_state),
            }
            for m in self.monitors:
                op, state = estimators[m]
                estimate, new_state = op(stats, state, tf.constant(self.decay, tf.float64))
                state.assign(new_state)
                self.values[m].assign(estimate)
            return tf.constant(True)

        due = self._due(step) if started is None else started.due
        return tf.cond(due, run, lambda: tf.constant(False))


def latest(monitor: str) -> GradientMonitor:
    m = _LATEST.get(monitor)
    if m is None:
        what = "gradient noise scale" if monitor == GNS else "gradient variance"
        raise RuntimeError(
            f"no optimizer monitors the {what}: create it with "
            f"kf.Optimizer(opt, monitor=[{monitor!r}]{', batch_size=...' if monitor == GNS else ''})"
            " and run at least one training step")
    return m


def grad_noise_scale() -> float:
    """The latest gradient noise scale, the same on every worker (NaN before the first
    estimate). Reads the most recently built optimizer that monitors it."""
    return latest(GNS).value(GNS)


def grad_noise_stats() -> Tuple[float, float]:
    """(tr(S), |G|^2): the smoothed estimates behind the gradient noise scale (its ratio): the
    trace of the per-sample gradient covariance and the squared norm of the true gradient, the
    same on every worker (NaN before the first estimate). AdaScale's gain is built from them."""
    return _noise_stats(latest(GNS))


def _noise_stats(monitor: GradientMonitor) -> Tuple[float, float]:
    state = monitor.gns_state.numpy()
    if state[2] < 1:
        return math.nan, math.nan
    return float(state[0]), float(state[1])


def grad_variance() -> float:
    """The latest gradient variance (EMA of mean_i |g_i - g|^2), the same on every worker (NaN
    before the first estimate). Reads the most recently built optimizer that monitors it."""
    return latest(VARIANCE).value(VARIANCE)


def global_noise_scale(batch_small, batch_big, tensor, avg_tensor, alpha: float = 0.6,
                       name: Optional[str] = None):
    """KungFu's op: the gradient noise scale from a local gradient and its average over workers.

    `tensor` is this worker's (fused) gradient from `batch_small` samples, `avg_tensor` its
    average over the workers. The big batch is derived from every worker's `batch_small` (it is
    n * batch_small when all are equal), so `batch_big` is accepted for compatibility only. Unlike
    KungFu's, the local squared norm is averaged over the workers, so every worker gets the same
    value. The EMA state (decay `alpha`) lives in variables created on first use of `name`.
    """
    del batch_big
    key = name or "kungfu/global_noise_scale"
    state = _GLOBAL_STATE.get(key)
    if state is None:
        state = _GLOBAL_STATE[key] = _variable([0.0, 0.0, 0.0, math.nan], "kungfu_gns_state")
    stats = gradient_stats([tensor], [avg_tensor], batch_small, key)
    estimate, new_state = _lib.kungfu_noise_scale(
        stats, state, tf.constant(check_decay(alpha), tf.float64))
    with tf.control_dependencies([state.assign(new_state)]):
        return tf.identity(estimate)


_GLOBAL_STATE: Dict[str, tf.Variable] = {}


def monitor_logs(optimizer) -> dict:
    """{log key: latest estimate} of the optimizer's gradient monitor ({} without one)."""
    monitor: Optional[GradientMonitor] = getattr(optimizer, "kungfu_monitor", None)
    if monitor is None:
        return {}
    return {LOG_KEYS[m]: monitor.value(m) for m in monitor.monitors}


def monitor_metrics(optimizer) -> dict:
    """What a policy's TrainingState.metrics gets of the monitor: the log keys' estimates, and
    "grad_noise_stats" = (tr(S), |G|^2) where the noise scale is monitored."""
    out = monitor_logs(optimizer)
    monitor: Optional[GradientMonitor] = getattr(optimizer, "kungfu_monitor", None)
    if monitor is not None and GNS in monitor.monitors:
        out["grad_noise_stats"] = _noise_stats(monitor)
    return out
