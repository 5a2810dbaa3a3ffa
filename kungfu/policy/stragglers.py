"""Straggler replacement (Or, Zhang, Freedman, MLSys 2020): a worker that stays much slower than
the others is replaced by a new one.

Each worker's speed (samples per second of compute: state.metrics["part_sizes"] /
["compute_times"], the same on every worker) is divided by the median speed; an EWMA (weight
`alpha`) of that ratio below `threshold` for `patience` steps in a row marks a straggler, the
slowest one first. It is replaced with kf.resize(size, leave=[rank]): a new worker starts in a
free slot of the job (kungfu-run -w needs one), joins, and only then does the straggler leave,
so training never runs short of a worker. While the replacement is under way and for
`cooldown` steps after, nothing else is replaced; the ratios start over with the new cluster.
"""
from __future__ import annotations

import statistics
from typing import List, Optional

from kungfu.elastic import TrainingState, resize
from kungfu.policy._base import BasePolicy


class StragglerReplacement(BasePolicy):
    """`kf.Hook(kf.policy.StragglerReplacement())` under `kungfu-run -w` with a free slot."""

    def __init__(self, threshold: float = 0.8, alpha: float = 0.1, patience: int = 10,
                 warmup: int = 3, cooldown: int = 20):
        if not 0 < threshold < 1 or not 0 < alpha <= 1 or patience < 1 or warmup < 0 \
                or cooldown < 0:
            raise ValueError("threshold in (0, 1), alpha in (0, 1], patience >= 1, warmup >= 0 "
                             "and cooldown >= 0 are needed")
        self.threshold, self.alpha, self.patience = threshold, alpha, patience
        self.warmup, self.cooldown = warmup, cooldown
        self.ratios: Optional[List[float]] = None  # EWMA of speed / median, per rank
        self.below: List[int] = []  # steps in a row under the threshold, per rank
        self.waiting = False  # a replacement is under way
        self.quiet_until = 0  # no decision before this step
        self.replaced: List[dict] = []  # step, rank, ratio of each replacement asked for

    def observe(self, speeds) -> None:
        med = statistics.median(speeds)
        ratio = [v / med for v in speeds]
        if self.ratios is None or len(self.ratios) != len(ratio):
            self.ratios, self.below = ratio, [0] * len(ratio)
        else:
            a = self.alpha
            self.ratios = [a * x + (1 - a) * r for x, r in zip(ratio, self.ratios)]
        self.below = [b + 1 if r < self.threshold else 0 for b, r in zip(self.below, self.ratios)]

    def after_step(self, state: TrainingState) -> None:
        if self.waiting:
            if state.resize_pending:
                return
            self.waiting = False  # switched (or given up): measure the new cluster afresh
            self.ratios = None
            self.quiet_until = state.step + self.cooldown
        times = state.metrics.get("compute_times")
        parts = state.metrics.get("part_sizes")
        if (not times or not parts or len(times) != state.cluster_size or min(parts) <= 0
                or min(times) <= 0 or state.step <= self.warmup or state.cluster_size < 2):
            return
        self.observe([p / t for p, t in zip(parts, times)])
        if state.step < self.quiet_until:
            return
        worst = min(range(len(self.ratios)), key=lambda r: self.ratios[r])
        if self.below[worst] >= self.patience:
            self.replaced.append({"step": state.step, "rank": worst,
                                  "ratio": self.ratios[worst]})
            resize(state.cluster_size, leave=[worst])
            self.waiting = True
