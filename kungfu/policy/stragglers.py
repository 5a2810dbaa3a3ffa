"""Straggler replacement (Or, Zhang, Freedman, MLSys 2020): a worker that stays much slower than
the others is replaced by a new one.

Each step, every worker's speed (samples per second of compute: state.metrics["part_sizes"] /
["compute_times"], the same on every worker) is divided by the median speed. Over the last
`window` steps a worker's level is the median of its ratios (one slow step, a worker
descheduled for a moment, moves it little), and the cluster's noise is how far the ratios stray
from their workers' levels (the pooled median absolute deviation). The worker with the lowest
level is a straggler when

    level < threshold  and  1 - level > spread * (the standard error of a level)

the first a floor on what is worth a replacement (0.85: a worker 15% slower than the median),
the second the cluster's own spread: on a loaded machine, where every worker's steps vary a
lot, only a worker set apart from that variation is one (a busy machine must neither invent a
straggler from noise nor, with a floor far below it, hide a slow one behind the load).

It is replaced with kf.resize(size, leave=[rank]): a new worker starts in a free slot of the job
(kungfu-run -w needs one; a warm spare, -spares, makes it quick), joins, and only then does the
straggler leave, so training never runs short of a worker. While the replacement is under way
and for `cooldown` steps after, nothing else is replaced; the window starts over with the new
cluster.
"""
from __future__ import annotations

import collections
import math
import statistics
from typing import Deque, List, Optional

from kungfu.elastic import TrainingState, resize
from kungfu.policy._base import BasePolicy

_MAD_TO_SIGMA = 1.4826  # the median absolute deviation of a normal sample, times this: sigma
_MEDIAN_SE = 1.2533  # a median of n normal samples varies sqrt(pi / 2) / sqrt(n) sigma


class StragglerReplacement(BasePolicy):
    """`kf.Hook(kf.policy.StragglerReplacement())` under `kungfu-run -w` with a free slot."""

    def __init__(self, threshold: float = 0.85, window: int = 30, spread: float = 4.0,
                 warmup: int = 3, cooldown: int = 20):
        if not 0 < threshold < 1 or window < 3 or not spread >= 0 or warmup < 0 or cooldown < 0:
            raise ValueError("threshold in (0, 1), window >= 3, spread >= 0, warmup >= 0 and "
                             "cooldown >= 0 are needed")
        self.threshold, self.window, self.spread = threshold, window, spread
        self.warmup, self.cooldown = warmup, cooldown
        self.history: Optional[List[Deque[float]]] = None  # the last `window` ratios, per rank
        self.levels: List[float] = []  # per rank: the median of its window
        self.noise = 0.0  # the cluster's sigma of one step's ratio around a worker's level
        self.waiting = False  # a replacement is under way
        self.quiet_until = 0  # no decision before this step
        self.replaced: List[dict] = []  # step, rank, level, noise of each replacement asked for

    def observe(self, speeds) -> None:
        """Adds one step's speeds (one per rank); a new cluster size starts the window over."""
        med = statistics.median(speeds)
        if self.history is None or len(self.history) != len(speeds):
            self.history = [collections.deque(maxlen=self.window) for _ in speeds]
        for h, v in zip(self.history, speeds):
            h.append(v / med)
        self.levels = [statistics.median(h) for h in self.history]
        self.noise = _MAD_TO_SIGMA * statistics.median(
            abs(x - level) for h, level in zip(self.history, self.levels) for x in h)

    def straggler(self) -> Optional[int]:
        """The rank to replace, or None (see the module doc)."""
        if self.history is None or len(self.history[0]) < self.window:
            return None
        worst = min(range(len(self.levels)), key=lambda r: self.levels[r])
        level = self.levels[worst]
        error = _MEDIAN_SE * self.noise / math.sqrt(self.window)
        if level < self.threshold and 1 - level > self.spread * error:
            return worst
        return None

    def after_step(self, state: TrainingState) -> None:
        if self.waiting:
            if state.resize_pending:
                return
            self.waiting = False  # switched (or given up): measure the new cluster afresh
            self.history = None
            self.quiet_until = state.step + self.cooldown
        times = state.metrics.get("compute_times")
        parts = state.metrics.get("part_sizes")
        if (not times or not parts or len(times) != state.cluster_size or min(parts) <= 0
                or min(times) <= 0 or state.step <= self.warmup or state.cluster_size < 2):
            return
        self.observe([p / t for p, t in zip(parts, times)])
        if state.step < self.quiet_until:
            return
        worst = self.straggler()
        if worst is not None:
            self.replaced.append({"step": state.step, "rank": worst,
                                  "level": self.levels[worst], "noise": self.noise})
            resize(state.cluster_size, leave=[worst])
            self.waiting = True
