"""Policies driven by the gradient noise scale: batch growth (KungFu's headline policy,
McCandlish et al.'s critical batch) and AdaScale's learning-rate gain (Johnson et al.).

Both read the estimates of the optimizer's monitor (kf.Optimizer(..., monitor="gns")), which are
the same on every worker: kf.grad_noise_scale() = B_noise = tr(S) / |G|^2, and
kf.grad_noise_stats() = (tr(S), |G|^2).
"""
from __future__ import annotations

import math
from typing import List, Optional

from kungfu.elastic import TrainingState, set_batch_size, set_learning_rate
from kungfu.policy._base import BasePolicy
from kungfu.policy._rules import linear_scaled_lr, sqrt_scaled_lr

LR_RULES = ("sqrt", "linear", None)


class GNSBatchGrowth(BasePolicy):
    """Doubles every worker's batch when the gradient noise scale exceeds the global batch
    (the batch is below the critical batch, so a larger one wastes few samples), checked at
    each epoch's end (or every `every_steps` steps), up to `max_batch` per worker. The learning
    rate follows the `lr_rule`: "sqrt" (default), "linear", or None (leave it, e.g. to AdaScale
    or MomentumCompensation in the same Hook)."""

    def __init__(self, max_batch: int, lr_rule: Optional[str] = "sqrt",
                 every_steps: Optional[int] = None, factor: int = 2):
        if lr_rule not in LR_RULES:
            raise ValueError(f"lr_rule must be one of {LR_RULES}, got {lr_rule!r}")
        if max_batch < 1 or factor < 2 or (every_steps is not None and every_steps < 1):
            raise ValueError("max_batch >= 1, factor >= 2 and every_steps >= 1 are needed")
        self.max_batch, self.lr_rule, self.every_steps, self.factor = (
            max_batch, lr_rule, every_steps, factor)
        self.decisions: List[dict] = []  # step, gns, the new local batch and learning rate

    def _check(self, state: TrainingState) -> None:
        gns = state.metrics.get("gns", math.nan)
        b = state.local_batch_size
        if b is None or not math.isfinite(gns) or b * self.factor > self.max_batch:
            return
        if gns > state.global_batch_size:
            new = b * self.factor
            set_batch_size(new)
            lr = state.learning_rate
            if self.lr_rule == "sqrt" and lr is not None:
                lr = sqrt_scaled_lr(lr, b, new)
            elif self.lr_rule == "linear" and lr is not None:
                lr = linear_scaled_lr(lr, b, new)
            if self.lr_rule is not None and lr is not None:
                set_learning_rate(lr)
            self.decisions.append({"step": state.step, "gns": gns, "batch": new, "lr": lr})

    def after_step(self, state: TrainingState) -> None:
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
