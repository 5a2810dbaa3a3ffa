"""Load-balanced BSP (LB-BSP): each worker's batch in proportion to its predicted speed.

In synchronous training every step waits for the slowest worker. LB-BSP keeps the global batch
and splits it unevenly, so that a slow worker gets fewer samples and every worker finishes its
compute at about the same time:

    b_r = B * v_r / sum(v),    v_r = predicted samples/s of worker r

The speeds come from the Hook's per-worker measurements (state.metrics["compute_times"] and
["part_sizes"]: each worker's step time less its wait in the gradients' allreduce, shared on
the step's agreement, so every worker computes the same split). Predictors of the next speed:

- "last": the last measured speed;
- "ewma": an exponentially weighted moving average (weight `alpha` on the newest);
- "narx": a small learned predictor: least squares (ridge) of the speed on its `lags` previous
  values and a constant, fit per worker on the last `window` steps (a linear NARX model whose
  exogenous input is the worker's batch share); EWMA until it has enough history.

The first `warmup` steps are not measured (they trace and compile). Damping keeps the split
from oscillating: a change starts only when some worker's size is more than `threshold`
(relative) off its share of the predicted speeds; it moves `damping` of the way there, at most
every `every` steps, and goes on until every size is within a quarter of `threshold` of its
share (or one sample). The dead band keeps noise from starting changes; it does not leave a
change that has started short of its target (a split left 5% off would cost about 5% of the
throughput for good).
"""
from __future__ import annotations

from typing import List, Optional

import numpy as np

from kungfu.elastic import TrainingState, set_batch_sizes
from kungfu.policy._base import BasePolicy

PREDICTORS = ("last", "ewma", "narx")


def split(total: int, weights, minimum: int = 1) -> List[int]:
    """`total` samples split in proportion to `weights` (positive; largest remainders), summing
    to total exactly; shares under `minimum` are raised to it, taken from the largest."""
    w = np.asarray(weights, dtype=np.float64)
    n = len(w)
    if total < minimum * n:
        raise ValueError(f"cannot give {n} workers {minimum} samples each out of {total}")
    quota = total * w / w.sum()
    shares = np.floor(quota).astype(np.int64)
    for i in np.argsort(-(quota - shares), kind="stable")[:total - int(shares.sum())]:
        shares[i] += 1
    while shares.min() < minimum:
        shares[int(np.argmin(shares))] += 1
        shares[int(np.argmax(shares))] -= 1
    return [int(s) for s in shares]


class LoadBalancing(BasePolicy):
    """LB-BSP as a policy: `kf.Hook(kf.policy.LoadBalancing())` with `kf.ElasticData`."""

    def __init__(self, predictor: str = "ewma", alpha: float = 0.3, lags: int = 3,
                 window: int = 32, every: int = 5, warmup: int = 3, damping: float = 0.5,
                 threshold: float = 0.05, min_batch: int = 1):
        if predictor not in PREDICTORS:
            raise ValueError(f"predictor must be one of {', '.join(PREDICTORS)}, got "
                             f"{predictor!r}")
        if not 0 < alpha <= 1 or not 0 < damping <= 1 or threshold < 0:
            raise ValueError("alpha and damping must be in (0, 1], threshold >= 0")
        if lags < 1 or window < lags + 2 or every < 1 or warmup < 0 or min_batch < 1:
            raise ValueError("lags >= 1, window >= lags + 2, every >= 1, warmup >= 0 and "
                             "min_batch >= 1 are needed")
        self.predictor = predictor
        self.alpha, self.lags, self.window = alpha, lags, window
        self.every, self.warmup = every, warmup
        self.damping, self.threshold, self.min_batch = damping, threshold, min_batch
        self.history: List[List[float]] = []  # measured speeds, per step: one per worker
        self.smoothed: Optional[List[float]] = None  # EWMA per worker
        self.last_change = -10 ** 9
        self.moving = False  # a change started and not yet within threshold / 4 of its target
        self.decisions: List[dict] = []  # (step, sizes) of each split applied, for the record

    # -- prediction -----------------------------------------------------------------------

    def observe(self, speeds) -> None:
        speeds = [float(v) for v in speeds]
        if self.history and len(self.history[-1]) != len(speeds):
            # another cluster size: start over
            self.history, self.smoothed, self.moving = [], None, False
        self.history.append(speeds)
        del self.history[:-self.window]
        if self.smoothed is None:
            self.smoothed = list(speeds)
        else:
            a = self.alpha
            self.smoothed = [a * v + (1 - a) * s for v, s in zip(speeds, self.smoothed)]

    def predict(self) -> List[float]:
        """The predicted next speed of every worker."""
        if self.predictor == "last":
            return list(self.history[-1])
        if self.predictor == "ewma" or len(self.history) < self.lags + 2:
            return list(self.smoothed)
        h = np.asarray(self.history)  # steps x workers
        out = []
        for r in range(h.shape[1]):
            y = h[:, r]
            # Rows: [y_{t-1}, ..., y_{t-lags}, 1] -> y_t; scaled by the mean for conditioning.
            scale = y.mean() or 1.0
            z = y / scale
            rows = np.array([np.r_[z[t - self.lags:t][::-1], 1.0]
                             for t in range(self.lags, len(z))])
            coef = np.linalg.solve(rows.T @ rows + 1e-3 * np.eye(rows.shape[1]),
                                   rows.T @ z[self.lags:])
            nxt = float(np.r_[z[-self.lags:][::-1], 1.0] @ coef) * scale
            # A fit on few noisy points may extrapolate wildly: keep it near what was seen.
            out.append(float(np.clip(nxt, 0.5 * y.min(), 2.0 * y.max())))
        return out

    # -- the policy -----------------------------------------------------------------------

    def target(self, state: TrainingState) -> Optional[List[int]]:
        """The next split, or None to keep the current one: when some worker's size is more
        than `threshold` (relative) off its share of the predicted speeds, or a change that
        started so is not yet within `threshold / 4` (or one sample), the sizes move `damping`
        of the way there (at least one sample)."""
        current = state.batch_sizes
        speeds = self.predict()
        if current is None or len(current) != len(speeds) or min(speeds) <= 0:
            return None
        total = sum(current)
        ideal = split(total, speeds, self.min_batch)
        if self.moving:
            self.moving = any(abs(t - c) > max(1.0, self.threshold / 4 * c)
                              for t, c in zip(ideal, current))
        else:
            self.moving = max(abs(t - c) / c for t, c in zip(ideal, current)) > self.threshold
        if not self.moving:
            return None
        moved = [c + self.damping * (t - c) for c, t in zip(current, ideal)]
        new = split(total, moved, self.min_batch)
        return ideal if new == list(current) else new

    def after_step(self, state: TrainingState) -> None:
        times = state.metrics.get("compute_times")
        parts = state.metrics.get("part_sizes")
        if not times or not parts or len(times) != state.cluster_size:
            return
        if min(parts) <= 0 or min(times) <= 0:
            return  # an epoch's last, short step: not a measure of speed
        if state.step <= self.warmup:
            return  # the first steps trace and compile: not a measure of speed either
        self.observe([p / t for p, t in zip(parts, times)])
        if len(self.history) < 2 or state.step - self.last_change < self.every:
            return
        new = self.target(state)
        if new is not None:
            set_batch_sizes(new)
            self.last_change = state.step
            self.decisions.append({"step": state.step, "sizes": new})
