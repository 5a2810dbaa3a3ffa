"""AdaptiveStrategyPolicy: pick the allreduce strategy that is fastest on this cluster, online,
and move away from it when its throughput drops (KungFu's second adaptation, OSDI'20 Fig. 5).

How it works, on every worker alike (all numbers are averaged over the workers first, so every
worker takes the same decision):

1. Explore: each candidate strategy in turn is installed for `trial_steps` steps; the first
   `warmup_steps` of a trial are not measured. Its throughput is the allreduce bytes per second
   the runtime counted for it in the measured steps (kungfu.policy.strategy_stats()).
2. Exploit: the fastest candidate is installed, and its throughput becomes the reference.
3. Watch: every `check_steps` steps the throughput of the last window is measured. Each worker
   votes "degraded" when its own throughput is below `drop_ratio` x reference; when more than
   half vote so, the policy explores again (a slow link may have made another strategy the
   fastest).

`history` keeps every measurement as (step, strategy, bytes/s) and `decisions` every switch.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

from kungfu._collective import allreduce
from kungfu._strategy import current_strategy, strategy_stats
from kungfu.elastic import TrainingState, set_strategy
from kungfu.policy._base import BasePolicy

DEFAULT_CANDIDATES = ("BINARY_TREE_STAR", "RING", "HIERARCHICAL", "STAR", "TREE", "CLIQUE")


class AdaptiveStrategyPolicy(BasePolicy):
    def __init__(self, candidates: Sequence[str] = DEFAULT_CANDIDATES, trial_steps: int = 10,
                 warmup_steps: int = 2, check_steps: int = 50, drop_ratio: float = 0.8):
        if not candidates:
            raise ValueError("AdaptiveStrategyPolicy needs at least one candidate strategy")
        if trial_steps <= warmup_steps or warmup_steps < 0:
            raise ValueError(f"trial_steps ({trial_steps}) must exceed warmup_steps "
                             f"({warmup_steps}) >= 0")
        if check_steps < 1 or not 0 < drop_ratio < 1:
            raise ValueError("check_steps must be >= 1 and drop_ratio in (0, 1)")
        self.candidates = [c.upper() for c in candidates]
        if "AUTO" in self.candidates:
            raise ValueError("AUTO is not a candidate: its operations count under the strategy "
                             "it resolves to; list concrete strategies")
        self.trial_steps = int(trial_steps)
        self.warmup_steps = int(warmup_steps)
        self.check_steps = int(check_steps)
        self.drop_ratio = float(drop_ratio)
        self.phase = "explore"
        self.trial = 0  # index of the candidate on trial
        self.steps_in_phase = 0
        self.trials: Dict[str, float] = {}
        self.best: Optional[str] = None
        self.reference: Optional[float] = None
        self.history: List[Tuple[int, str, float]] = []
        self.decisions: List[Tuple[int, str, str]] = []  # (step, strategy, why)
        self._mark: Optional[Tuple[int, float]] = None  # counters at the window start

    # -- measurement ------------------------------------------------------------------------

    @staticmethod
    def _counters(name: str) -> Tuple[int, float]:
        s = strategy_stats().get(name)
        return (0, 0.0) if s is None else (s["bytes"], s["seconds"])

    def _strategy_name(self) -> str:
        # What the runtime counts under: a named strategy, AUTO resolved by size (so a
        # candidate should be a concrete strategy), a user tree as TREE.
        cur = current_strategy()
        return cur.get("name", "TREE")

    def _window_rate(self) -> float:
        """This worker's allreduce bytes/s since the window began."""
        b1, s1 = self._counters(self._strategy_name())
        b0, s0 = self._mark or (0, 0.0)
        return (b1 - b0) / (s1 - s0) if s1 > s0 else 0.0

    def _start_window(self) -> None:
        self._mark = self._counters(self._strategy_name())

    # -- the hooks --------------------------------------------------------------------------

    def before_train(self, state: TrainingState) -> None:
        self._begin_explore(state.step, "start")

    def _begin_explore(self, step: int, why: str) -> None:
        self.phase, self.trial, self.steps_in_phase, self.trials = "explore", 0, 0, {}
        self._switch(step, self.candidates[0], why)

    def _switch(self, step: int, name: str, why: str) -> None:
        set_strategy(name)
        self.decisions.append((step, name, why))
        self._mark = None  # the new strategy's window starts once it is installed

    def after_step(self, state: TrainingState) -> None:
        self.steps_in_phase += 1
        if self._mark is None:  # the first step on the new strategy is done: start counting
            self._start_window()
        if self.phase == "explore":
            if self.steps_in_phase == self.warmup_steps:
                self._start_window()
            if self.steps_in_phase < self.trial_steps:
                return
            name = self.candidates[self.trial]
            rate = float(allreduce(self._window_rate(), "avg"))
            self.trials[name] = rate
            self.history.append((state.step, name, rate))
            self.trial += 1
            self.steps_in_phase = 0
            if self.trial < len(self.candidates):
                self._switch(state.step, self.candidates[self.trial], "explore")
                return
            self.best = max(self.trials, key=lambda k: (self.trials[k], -self.candidates.index(k)))
            self.reference = self.trials[self.best]
            self.phase = "exploit"
            self._switch(state.step, self.best, "fastest")
            return
        if self.steps_in_phase % self.check_steps:
            return
        mine = self._window_rate()
        self._start_window()
        rate = float(allreduce(mine, "avg"))
        self.history.append((state.step, self.best, rate))
        votes = int(allreduce(int(self.degraded(mine)), "sum"))
        if 2 * votes > state.cluster_size:
            self._begin_explore(state.step, f"throughput dropped ({votes} of "
                                            f"{state.cluster_size} votes)")

    def degraded(self, rate: float) -> bool:
        """Whether `rate` (this worker's last window) is below drop_ratio x reference."""
        return self.reference is not None and rate < self.drop_ratio * self.reference
