"""Policies driven by the gradient noise scale: batch growth (KungFu's headline policy,
McCandlish et al.'s critical batch) and AdaScale's learning-rate gain (Johnson et al.).

Both read the estimates of the optimizer's monitor (kf.Optimizer(..., monitor="gns")), which are
the same on every worker: kf.grad_noise_scale() = B_noise = tr(S) / |G|^2, and
kf.grad_noise_stats() = (tr(S), |G|^2).
"""
from __future__ import annotations

import math
import statistics
import time
from typing import List, Optional

from kungfu._collective import allreduce
from kungfu.elastic import TrainingState, set_batch_size, set_learning_rate
from kungfu.policy._base import BasePolicy
from kungfu.policy._rules import linear_scaled_lr, sqrt_scaled_lr

LR_RULES = ("sqrt", "linear", None)


class GNSBatchGrowth(BasePolicy):
    """Doubles every worker's batch when the gradient noise scale exceeds the global batch
    (the batch is below the critical batch, so a larger one wastes few samples), checked at
    each epoch's end (or every `every_steps` steps), up to `max_batch` per worker. The learning
    rate follows the `lr_rule`: "sqrt" (default), "linear", or None (leave it, e.g. to AdaScale
    or MomentumCompensation in the same Hook).

    `goodput=True` (needs every_steps) chooses the batch by its goodput instead, as Pollux does:
    the goodput of a global batch B is its throughput (samples/s: the median of the steps' since
    the last change, by the clock, averaged over the workers) times its statistical efficiency,
    which is proportional to 1 / (gns + B). At each check the throughput of the current batch is
    measured (the latest measurement of each batch is kept, at the current cluster size); the
    step time of a batch not measured is the line through the two measured batches nearest to it
    (per worker). The policy moves to the smaller (a measured one), the same or the larger batch
    (by `factor`), whichever has the highest goodput at the current noise scale, by more than
    `margin`; while only one batch is measured, the larger one is tried at the first check (its
    step time cannot be told otherwise), and a trial that lost goodput is undone at the next
    check. Going back to a measured batch restores its learning rate."""

    def __init__(self, max_batch: int, lr_rule: Optional[str] = "sqrt",
                 every_steps: Optional[int] = None, factor: int = 2, goodput: bool = False,
                 margin: float = 0.02):
        if lr_rule not in LR_RULES:
            raise ValueError(f"lr_rule must be one of {LR_RULES}, got {lr_rule!r}")
        if max_batch < 1 or factor < 2 or (every_steps is not None and every_steps < 1) or not (
                margin >= 0):
            raise ValueError("max_batch >= 1, factor >= 2, every_steps >= 1 and margin >= 0 "
                             "are needed")
        if goodput and not every_steps:
            raise ValueError("goodput=True measures throughput between checks: give every_steps")
        self.max_batch, self.lr_rule, self.every_steps, self.factor = (
            max_batch, lr_rule, every_steps, factor)
        self.goodput, self.margin = goodput, margin
        self.mark: Optional[dict] = None  # the window at this batch: its steps' samples/s
        self.measured: List[list] = []  # [local batch, samples/s, learning rate] (goodput)
        self.measured_at: Optional[int] = None  # the cluster size of `measured`
        self.decisions: List[dict] = []  # step, gns, the new local batch and learning rate

    def _rate(self, state: TrainingState) -> Optional[float]:
        """The job's samples/s at this batch: the median of the steps' rates since the window
        began (a step stalled by something else, a busy core or a collective's retry, does not
        count against the batch), the mean of the workers' (every worker the same); None when
        the window is too short."""
        m = self.mark
        if m is None or len(m["rates"]) < 3:
            return None
        mine = statistics.median(m["rates"])
        return float(allreduce(mine, "avg", name="kungfu/gns-growth/rate"))

    def _check(self, state: TrainingState) -> None:
        gns = state.metrics.get("gns", math.nan)
        b = state.local_batch_size
        if b is None or not math.isfinite(gns):
            return
        if self.goodput:
            self._choose(state, gns)
            return
        if b * self.factor > self.max_batch or gns <= state.global_batch_size:
            return
        new = b * self.factor
        self._apply(state, new, self._scaled_lr(state.learning_rate, b, new), gns, "grow")

    def _scaled_lr(self, lr, b, new):
        if self.lr_rule == "sqrt" and lr is not None:
            return sqrt_scaled_lr(lr, b, new)
        if self.lr_rule == "linear" and lr is not None:
            return linear_scaled_lr(lr, b, new)
        return None

    def _step_time(self, batch: int, n: int) -> Optional[float]:
        """Seconds a step at `batch` a worker (n workers): measured, or the line through the two
        measured batches nearest to it; None while fewer than two are measured."""
        times = {m[0]: m[0] * n / m[1] for m in self.measured if m[1] > 0}
        if batch in times:
            return times[batch]
        if len(times) < 2:
            return None
        (b1, t1), (b2, t2) = sorted(sorted(times.items(), key=lambda p: (abs(p[0] - batch),
                                                                         p[0]))[:2])
        return max(t1 + (t2 - t1) * (batch - b1) / (b2 - b1), 1e-9)

    def _choose(self, state: TrainingState, gns: float) -> None:
        rate = self._rate(state)
        if rate is None:
            return  # the throughput at this batch is not known yet
        b, n = state.local_batch_size, state.cluster_size
        if n != self.measured_at:  # another cluster: other step times
            self.measured, self.measured_at = [], n
        lrs = {m[0]: m[2] for m in self.measured}
        self.measured = [m for m in self.measured if m[0] != b] + [
            [b, rate, lrs.get(b, state.learning_rate)]]
        lrs[b] = self.measured[-1][2]
        larger = b * self.factor if b * self.factor <= self.max_batch else None
        if larger is not None and len(self.measured) == 1:
            self._apply(state, larger, self._scaled_lr(state.learning_rate, b, larger), gns,
                        "try")
            return

        def goodput(batch):
            t = self._step_time(batch, n)
            return None if t is None else batch * n / t / (gns + batch * n)

        now = goodput(b)
        options = [x for x in (b // self.factor, larger) if x in lrs or (
            x == larger and x is not None)]
        scored = [(goodput(x), x) for x in options if goodput(x) is not None]
        if not scored:
            return
        best, x = max(scored)
        if best > now * (1 + self.margin):
            lr = lrs.get(x) if x in lrs else self._scaled_lr(state.learning_rate, b, x)
            self._apply(state, x, lr if self.lr_rule is not None else None, gns,
                        "grow" if x > b else "shrink")

    def _apply(self, state, batch, lr, gns, why) -> None:
        set_batch_size(batch)
        if lr is not None:
            set_learning_rate(lr)
        self.mark = None  # a new window at the new batch
        self.decisions.append({"step": state.step, "gns": gns, "batch": batch, "lr": lr,
                               "why": why, "measured": [m[:2] for m in self.measured]})

    def after_step(self, state: TrainingState) -> None:
        if self.goodput:
            now, m = time.monotonic(), self.mark
            if m is None or m["batch"] != state.global_batch_size:
                # (the step after a change: its batch is the new one) a window starts here
                self.mark = {"t": now, "seen": state.samples_seen,
                             "batch": state.global_batch_size, "rates": []}
            else:
                m["rates"].append((state.samples_seen - m["seen"]) / max(now - m["t"], 1e-9))
                del m["rates"][:-5 * (self.every_steps or 1)]  # the latest steps' only
                m["t"], m["seen"] = now, state.samples_seen
        if self.every_steps and state.step % self.every_steps == 0:
            self._check(state)

    def after_epoch(self, state: TrainingState) -> None:
        if not self.every_steps:
            self._check(state)


class AdaScale(BasePolicy):
    """AdaScale SGD: at a global batch B = S x `base_batch`, the learning rate is
    `base_lr` x r_t with the gain

        r_t = (tr(S) / b0 + |G|^2) / (tr(S) / B + |G|^2)    (between 1 and S)

    from the monitor's smoothed estimates (b0 = base_batch): large while gradient noise
    dominates (a larger batch is worth a proportionally larger step), near 1 once the true
    gradient does. `progress` counts scale-invariant steps (the sum of r_t): a schedule written
    for the base batch may be followed in those units. Works with any change of B (resize,
    set_batch_size, GNSBatchGrowth in the same Hook)."""

    def __init__(self, base_batch: int, base_lr: float):
        if base_batch < 1 or not base_lr > 0:
            raise ValueError("base_batch >= 1 and base_lr > 0 are needed")
        self.base_batch, self.base_lr = base_batch, float(base_lr)
        self.gain = 1.0
        self.progress = 0.0

    def after_step(self, state: TrainingState) -> None:
        self.progress += self.gain  # the step just trained ran with this gain
        big = state.global_batch_size
        if big is None:
            return
        trace, g2 = state.metrics.get("grad_noise_stats", (math.nan, math.nan))
        if big <= self.base_batch or not (math.isfinite(trace) and math.isfinite(g2)) \
                or g2 <= 0 or trace < 0:
            gain = 1.0
        else:
            gain = (trace / self.base_batch + g2) / (trace / big + g2)
        self.gain = gain
        state.metrics["adascale_gain"] = gain
        set_learning_rate(self.base_lr * gain)
