"""Scaling-efficiency autoscaler (Or, Zhang, Freedman, MLSys 2020): add workers while they pay.

From k workers it probes k + d (kf.resize), measures the job's throughput R (samples/s) at both
sizes, and computes the scaling efficiency of the added workers

    s_{k,d} = ((R_{k+d} - R_k) / d) / (R_k / k)

(1 when the new workers are as productive as the old ones on average, 0 when they add
nothing). While s exceeds `threshold` (the paper's S) it keeps the larger size and probes
further; when it does not, it walks back to k and settles there (a shrink costs no start-up).
The job's slots bound it (kungfu-run -H), and so does the largest useful global batch
(`max_batch`: no more than max_batch // the per-worker batch workers); a probe that cannot
start (no free slot) settles too. A probe's grow is quick when the job keeps warm spares
(kungfu-run -w -spares K): the new worker is already started, and only the switch is paid.

Throughput is the samples trained per second of wall-clock time over `window` steps (so the
time between steps counts too), after `settle` steps at a new size (joiners trace, caches
warm). Every worker averages its own measurement with the others' (one allreduce at each
decision), so every worker decides the same and keeps the same state. `cost` turns on the
cost/utility variant: instead of a fixed threshold, a worker is worth adding when the
throughput it adds, relative to the average worker's, exceeds `cost` (the price of a worker in
units of an average worker's throughput); with cost = S it is the same rule, so `cost` is the
threshold named as a price.
"""
from __future__ import annotations

import time
from typing import List, Optional

from kungfu._collective import allreduce
from kungfu.elastic import TrainingState, resize
from kungfu.policy._base import BasePolicy


class ScalingAutoscaler(BasePolicy):
    """`kf.Hook(kf.policy.ScalingAutoscaler(threshold=0.1))` under `kungfu-run -w`."""

    def __init__(self, threshold: float = 0.1, step: int = 1, window: int = 10,
                 settle: int = 5, max_size: Optional[int] = None,
                 cost: Optional[float] = None, max_batch: Optional[int] = None):
        if cost is not None:
            threshold = cost
        if not threshold >= 0 or step < 1 or window < 1 or settle < 0 or (
                max_batch is not None and max_batch < 1):
            raise ValueError("threshold (or cost) >= 0, step >= 1, window >= 1, settle >= 0 "
                             "and max_batch >= 1 are needed")
        self.max_batch = max_batch
        self.threshold, self.step, self.window, self.settle = float(threshold), step, window, settle
        self.max_size = max_size
        self.phase = "measure"  # measure k, then probe k + d, then settled
        self.base: Optional[dict] = None  # {"k", "rate"} of the size probed from
        self.mark: Optional[list] = None  # (time, samples seen) where the window began
        self.since_change = 0
        self.size: Optional[int] = None
        self.trace: List[dict] = []  # every decision: step, k, rate, s

    def after_step(self, state: TrainingState) -> None:
        if self.phase == "settled":
            return
        if self.phase == "probe" and state.cluster_size == self.base["k"]:
            if not state.resize_pending:  # the probe could not start: stay
                self.trace.append({"step": state.step, "k": self.base["k"], "settled": True,
                                   "why": "no worker could be added"})
                self.phase = "settled"
            return  # its new workers are starting
        if state.cluster_size != self.size:  # a resize took effect (or the first step)
            self.size, self.since_change, self.mark = state.cluster_size, 0, None
        self.since_change += 1
        if self.since_change <= self.settle:
            return
        now = time.monotonic()
        if self.mark is None:
            self.mark = [now, state.samples_seen, state.step]
            return
        if state.step - self.mark[2] < self.window:
            return
        # The job's throughput over the window, by the clock (the steps and everything between
        # them); every worker decides from the same number, the mean of the workers' measures.
        mine = (state.samples_seen - self.mark[1]) / max(now - self.mark[0], 1e-9)
        rate = float(allreduce(mine, "avg", name="kungfu/autoscaler/rate"))
        self.mark = None
        k = state.cluster_size
        if self.phase == "measure":
            self.base = {"k": k, "rate": rate}
            self._probe(state, k, rate)
            return
        # probe: k workers now, self.base["k"] before
        k0, r0 = self.base["k"], self.base["rate"]
        s = ((rate - r0) / (k - k0)) / (r0 / k0)
        self.trace.append({"step": state.step, "k": k, "rate": rate, "s": s})
        if s > self.threshold:
            self.base = {"k": k, "rate": rate}
            self._probe(state, k, rate)
        else:
            self.trace.append({"step": state.step, "k": k0, "settled": True})
            resize(k0)
            self.phase = "settled"

    def _probe(self, state: TrainingState, k: int, rate: float) -> None:
        limit = state.max_size if self.max_size is None else self.max_size
        if self.max_batch is not None and state.local_batch_size:
            limit = min(limit, max(1, self.max_batch // state.local_batch_size))
        target = min(k + self.step, limit)
        if target <= k:
            self.trace.append({"step": state.step, "k": k, "rate": rate, "settled": True,
                               "why": "the largest size allowed"})
            self.phase = "settled"
            return
        self.trace.append({"step": state.step, "k": k, "rate": rate, "probe": target})
        resize(target)
        self.phase = "probe"
