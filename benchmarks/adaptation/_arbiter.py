"""An arbiter of accelerators between elastic jobs (emulated.py --experiment arbiter).

Several `kungfu-run -w` jobs share a pool of `total` accelerators. The arbiter measures each
job's goodput (progress a second) at the sizes it has run at, and moves `step` workers at a
time from the job that loses least by giving them up to the job that gains most by taking
them, each relative to its own goodput:

    gain_j = (R_j(k_j + d) - R_j(k_j)) / R_j(k_j)      loss_i = (R_i(k_i) - R_i(k_i - d)) / R_i(k_i)

(a job whose remaining time shrinks by a fraction f by the move gains f; a move is made when
gain - loss exceeds `margin`). R at a size not yet measured is the line through the two
measured sizes nearest to it; a job measured at one size only is first probed (it takes `step`
workers from another job, which then has a second size too). Workers of a job that ended go
to the job that gains most from them, an untried size counting as linear scaling (so it is
tried once); none is given where the measured curve says the job would be slower.

A move is the outside resize of kungfu's launcher: the donor first (a shrink frees its
accelerators at once), then the receiver, each through its job's config store
(`kungfu.store.connect(url).request_cluster(peers)`, the PUT /config of KungFu's config
server), which the job's rank 0 takes at a step boundary.

Why here and not in kungfu/: a kungfu job publishes no measure of its goodput that a process
outside it can read (its policies see their TrainingState, inside the job), so an arbiter in
the library would first need a job-level metrics channel; here the goodput comes from the
emulated workers' records. The decision (`decide`) is independent of where the measurements
come from, and the resize is kungfu's public outside-resize protocol.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence


@dataclass
class Curve:
    """A job's measured goodput by size (the latest measurement at each size)."""
    points: Dict[int, float] = field(default_factory=dict)

    def estimate(self, k: int) -> Optional[float]:
        """R(k): measured, else the line through the two measured sizes nearest to k
        (at least 0), else None (fewer than two sizes measured)."""
        if k in self.points:
            return self.points[k]
        if len(self.points) < 2:
            return None
        (k1, r1), (k2, r2) = sorted(sorted(self.points.items(), key=lambda p: (abs(p[0] - k),
                                                                            p[0]))[:2])
        return max(r1 + (r2 - r1) * (k - k1) / (k2 - k1), 0.0)


@dataclass(frozen=True)
class Move:
    donor: Optional[int]  # the job that gives `workers` up (None: the free pool)
    receiver: int
    workers: int
    why: str  # "probe", "free" or "marginal"
    gain: float  # the receiver's relative gain, estimated
    loss: float  # the donor's relative loss, estimated (0 from the pool)


def decide(sizes: Dict[int, int], curves: Dict[int, Curve], total: int, step: int,
           min_size: int = 1, margin: float = 0.05) -> Optional[Move]:
    """The next move for the running jobs (`sizes`: job -> its current size; `curves`: job ->
    its measured goodput, the current size measured), or None: stay. Every job may grow to
    `total` (its launcher has that many slots); none shrinks under `min_size`."""
    free = total - sum(sizes.values())
    jobs = sorted(sizes)

    def rel_gain(j, d):
        k, r = sizes[j], curves[j].points[sizes[j]]
        est = curves[j].estimate(k + d)
        return d / k if est is None else (est - r) / r  # untried: linear

    def rel_loss(i, d):
        k, r = sizes[i], curves[i].points[sizes[i]]
        est = curves[i].estimate(k - d)
        return None if est is None else (r - est) / r

    if free > 0:
        d = min(step, free)
        best = max(jobs, key=lambda j: rel_gain(j, d), default=None)
        if best is not None and rel_gain(best, d) > margin:
            return Move(None, best, d, "free", rel_gain(best, d), 0.0)
    can_give = [i for i in jobs if sizes[i] - step >= min_size]
    if len(jobs) < 2 or not can_give:
        return None
    single = [j for j in jobs if len(curves[j].points) < 2]
    if single:  # a probe: the first job measured at one size takes workers from another
        j = single[0]
        donors = [i for i in can_give if i != j]
        if donors:
            i = min(donors, key=lambda i: (len(curves[i].points) >= 2, rel_loss(i, step) or 0))
            return Move(i, j, step, "probe", rel_gain(j, step), rel_loss(i, step) or 0.0)
    best_move = None
    for i in can_give:
        loss = rel_loss(i, step)
        for j in jobs:
            if j == i or loss is None:
                continue
            gain = rel_gain(j, step)
            if gain - loss > margin and (best_move is None or gain - loss > best_move.gain
                                         - best_move.loss):
                best_move = Move(i, j, step, "marginal", gain, loss)
    return best_move


def goodput(rows: Sequence[dict], size: int, settle: int, window_s: float) -> Optional[float]:
    """Progress a second over the latest run of steps at `size` in a job's records (rank 0's
    rows: step, t, size, progress), from `settle` steps after the size began and over at most
    the last 3 x `window_s` seconds of it; None until it spans `window_s` seconds."""
    run: List[dict] = []
    for r in rows:
        if "step" not in r:
            continue
        if r["size"] != size:
            run = []
        else:
            run.append(r)
    run = run[settle:]
    run = [r for r in run if r["t"] >= run[-1]["t"] - 3 * window_s] if run else []
    if len(run) < 2 or run[-1]["t"] - run[0]["t"] < window_s:
        return None
    return (run[-1]["progress"] - run[0]["progress"]) / (run[-1]["t"] - run[0]["t"])


def resized_peers(current: Sequence[str], slots: Sequence[str], size: int) -> List[str]:
    """The peers of a job at `size`: the current ones first (rank 0 stays), shrunk from the
    end, grown by the job's first free slots."""
    if size <= len(current):
        return list(current[:size])
    free = [s for s in slots if s not in current]
    if size - len(current) > len(free):
        raise ValueError(f"{size} workers, but the job has {len(slots)} slots")
    return list(current) + free[:size - len(current)]
