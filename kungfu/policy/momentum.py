"""Momentum compensation (Lin et al., dynamic mini-batch SGD): a gradual learning rate when the
global batch changes.

With momentum, the update after a change of the global batch by k still carries the old
velocity; jumping the learning rate by k at once (the linear scaling rule) gives a loss spike.
Instead, the multiplier ramps from 1 to k over `steps` steps (the paper's T; 8 in its
experiments, also 8k):

    lr_t = lr_0 * (1 + (k - 1) * t / T),   t = 1 .. T

where lr_0 is the learning rate before the change. A smaller batch (k < 1) takes the lower
rate at once (`ramp_down=True` ramps that too). It watches state.global_batch_size, so it
reacts to every change, whatever made it: kf.set_batch_size, kf.resize, or another policy in
the same Hook (an autoscaler). A ramp in progress when the batch changes again starts over from
the rate reached.
"""
from __future__ import annotations

from typing import List, Optional

from kungfu.elastic import TrainingState, set_learning_rate
from kungfu.policy._base import BasePolicy


class MomentumCompensation(BasePolicy):
    """`kf.Hook(autoscaler, kf.policy.MomentumCompensation(steps=8))`."""

    def __init__(self, steps: int = 8, ramp_down: bool = False):
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"steps must be a positive integer, got {steps!r}")
        self.steps = steps
        self.ramp_down = bool(ramp_down)
        self.batch: Optional[int] = None  # the global batch size last seen
        self.ramp: Optional[dict] = None  # {"from": lr_0, "to": k lr_0, "t": steps done}
        self.changes: List[dict] = []  # (step, batch, k), for the record

    def after_step(self, state: TrainingState) -> None:
        b, lr = state.global_batch_size, state.learning_rate
        if b is None or lr is None:
            return
        if self.batch is not None and b != self.batch:
            k = b / self.batch
            start = lr
            self.changes.append({"step": state.step, "batch": b, "k": k})
            if k > 1 or self.ramp_down:
                self.ramp = {"from": start, "to": start * k, "t": 0}
            else:
                self.ramp = None
                set_learning_rate(start * k)
        self.batch = b
        if self.ramp is not None:
            r = self.ramp
            r["t"] += 1
            set_learning_rate(r["from"] + (r["to"] - r["from"]) * r["t"] / self.steps)
            if r["t"] >= self.steps:
                self.ramp = None
