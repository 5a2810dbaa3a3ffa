"""The models of the emulated cluster (emulated.py): no kungfu, no framework, only arithmetic.

- `Device`: an emulated accelerator. A step on b samples takes

      t(b) = (fixed + per_sample * max(b, saturation)) * speed

  seconds: a fixed part (kernel launches, the optimizer's update, what does not grow with the
  batch), a part per sample, and below `saturation` samples the device is not full, so a
  smaller batch takes no less time (the non-linear curve LB-BSP describes for GPUs; 0: linear).
  `speed` is the worker's slowness factor at that moment (1: nominal; 2: twice as slow).
- `Speeds`: the speed factors of the workers over the job, `RANK:FACTOR@STEP,...` (the worker
  that started as RANK runs FACTOR times slower from global step STEP on; later entries of a
  rank replace earlier ones). A worker started later (a joiner, a replacement) runs at 1.
- `Link`: the time of the allreduce of a large model's gradients (`nbytes`) across n workers,
  hosts of `per_host` workers: a ring inside each host (bandwidth `intra`), then a ring across
  the hosts (bandwidth `inter`, bytes/s, each way), `alpha` seconds per message of each ring.
- `efficiency`, `Progress`: the statistical efficiency of a batch size (Pollux, Qiao et al.,
  OSDI 2021): a step on a global batch M makes (phi + M0) / (phi + M) as much progress per
  sample as a step on the base batch M0, phi the gradient noise scale; progress is counted in
  samples at M0, so "time to a target" is time to a number of base-batch samples' worth.
- `NoiseScale`: the gradient noise scale from squared gradient norms at two batch sizes
  (McCandlish et al.'s unbiased estimators, numerator and denominator smoothed separately).
- `fit_device`: least squares of (fixed, per_sample) on measured (batch, seconds) pairs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple


@dataclass(frozen=True)
class Device:
    fixed: float  # seconds per step
    per_sample: float  # seconds per sample
    saturation: int = 0  # samples below which the device is not full (0: linear)

    def __post_init__(self):
        if self.fixed < 0 or self.per_sample < 0 or self.saturation < 0:
            raise ValueError(f"a device needs fixed, per_sample, saturation >= 0: {self}")

    def step_time(self, batch: int, speed: float = 1.0) -> float:
        """Seconds for a step on `batch` samples at slowness `speed` (an empty part: 0)."""
        if batch <= 0:
            return 0.0
        return (self.fixed + self.per_sample * max(batch, self.saturation)) * speed

    @classmethod
    def parse(cls, text: str) -> "Device":
        """`FIXED,PER_SAMPLE[,SATURATION]` (seconds, seconds, samples)."""
        parts = text.split(",")
        if len(parts) not in (2, 3):
            raise ValueError(f"a device is FIXED,PER_SAMPLE[,SATURATION], got {text!r}")
        sat = int(parts[2]) if len(parts) == 3 else 0
        return cls(float(parts[0]), float(parts[1]), sat)


class Speeds:
    """Per-worker slowness over the job (module doc)."""

    def __init__(self, events: Sequence[Tuple[int, float, int]] = ()):
        self.events: Dict[int, List[Tuple[int, float]]] = {}
        for rank, factor, step in events:
            if factor <= 0 or rank < 0 or step < 0:
                raise ValueError(f"a speed needs rank >= 0, factor > 0, step >= 0: "
                                 f"{rank}:{factor}@{step}")
            self.events.setdefault(rank, []).append((step, factor))

    @classmethod
    def parse(cls, text: str) -> "Speeds":
        out = []
        for item in filter(None, (s.strip() for s in (text or "").split(","))):
            head, _, step = item.partition("@")
            rank, sep, factor = head.partition(":")
            if not sep:
                raise ValueError(f"a speed is RANK:FACTOR[@STEP], got {item!r}")
            out.append((int(rank), float(factor), int(step or 0)))
        return cls(out)

    def factor(self, rank: Optional[int], step: int) -> float:
        """The slowness of the worker that started as `rank` (None: started later) at `step`."""
        f = 1.0
        for at, factor in self.events.get(rank, []) if rank is not None else []:
            if step >= at:
                f = factor  # later entries replace earlier ones
        return f


@dataclass(frozen=True)
class Link:
    nbytes: int  # the gradients' bytes
    intra: float  # bytes/s inside a host
    inter: float  # bytes/s between hosts, each way
    per_host: int  # workers per host
    alpha: float = 0.0  # seconds per message

    def allreduce_time(self, n: int) -> float:
        if n <= 1 or self.nbytes <= 0:
            return 0.0
        m = min(n, self.per_host)
        hosts = -(-n // self.per_host)
        t = 2 * (m - 1) / m * self.nbytes / self.intra + 2 * (m - 1) * self.alpha
        if hosts > 1:
            # each host's share crosses between hosts once (a reduce-scatter and an allgather)
            t += 2 * (hosts - 1) / hosts * self.nbytes / self.inter + 2 * (hosts - 1) * self.alpha
        return t

    @classmethod
    def parse(cls, text: str) -> "Link":
        """`NBYTES,INTRA,INTER,PER_HOST[,ALPHA]` (bytes, bytes/s, bytes/s, workers, seconds)."""
        f = text.split(",")
        if len(f) not in (4, 5):
            raise ValueError(f"a link is NBYTES,INTRA,INTER,PER_HOST[,ALPHA], got {text!r}")
        return cls(int(float(f[0])), float(f[1]), float(f[2]), int(f[3]),
                   float(f[4]) if len(f) > 4 else 0.0)


def efficiency(batch: float, noise_scale: float, base: float) -> float:
    """Pollux's statistical efficiency of a global batch against the base batch, in (0, 1] for
    batch >= base: (phi + M0) / (phi + M). A noise scale not known (NaN) or not positive counts
    as none at all (phi = 0: a larger batch buys nothing), the pessimistic reading."""
    phi = noise_scale if math.isfinite(noise_scale) and noise_scale > 0 else 0.0
    return (phi + base) / (phi + batch)


class Progress:
    """Progress of training in base-batch samples (module doc)."""

    def __init__(self, base: int, target: float):
        if base < 1 or not target > 0:
            raise ValueError("base >= 1 and target > 0 are needed")
        self.base, self.target = base, float(target)
        self.done = 0.0

    def add(self, batch: int, noise_scale: float) -> float:
        """Adds a step on `batch` samples (the global batch); returns its progress."""
        gain = batch * efficiency(batch, noise_scale, self.base)
        self.done += gain
        return gain

    @property
    def reached(self) -> bool:
        return self.done >= self.target


class NoiseScale:
    """B_simple = tr(Sigma) / |G|^2 from |G_s|^2 (mean squared norm of gradients over b_s
    samples) and |G_b|^2 (of the gradient over b_b samples), unbiased per step:

        |G|^2 ~ (b_b |G_b|^2 - b_s |G_s|^2) / (b_b - b_s)
        tr(S) ~ (|G_s|^2 - |G_b|^2) / (1 / b_s - 1 / b_b)

    each an EMA (weight 1 - `decay` on the newest); the scale is the ratio of the EMAs."""

    def __init__(self, decay: float = 0.9):
        if not 0 <= decay < 1:
            raise ValueError("decay in [0, 1) is needed")
        self.decay = decay
        self.g2: Optional[float] = None
        self.trace: Optional[float] = None

    def update(self, small_sq: float, b_small: float, big_sq: float, b_big: float) -> None:
        if not b_big > b_small > 0:
            return
        g2 = (b_big * big_sq - b_small * small_sq) / (b_big - b_small)
        tr = (small_sq - big_sq) / (1 / b_small - 1 / b_big)
        d = self.decay
        self.g2 = g2 if self.g2 is None else d * self.g2 + (1 - d) * g2
        self.trace = tr if self.trace is None else d * self.trace + (1 - d) * tr

    @property
    def value(self) -> float:
        if self.g2 is None or self.g2 <= 0 or self.trace is None or self.trace < 0:
            return math.nan
        return self.trace / self.g2


def fit_device(batches: Sequence[float], seconds: Sequence[float]) -> Device:
    """The linear device (fixed, per_sample) closest to the measured pairs (least squares)."""
    n = len(batches)
    if n < 2 or len(set(batches)) < 2 or len(seconds) != n:
        raise ValueError("at least two different batch sizes are needed")
    mx, my = sum(batches) / n, sum(seconds) / n
    sxx = sum((x - mx) ** 2 for x in batches)
    sxy = sum((x - mx) * (y - my) for x, y in zip(batches, seconds))
    per = max(sxy / sxx, 0.0)
    return Device(max(my - per * mx, 0.0), per)
