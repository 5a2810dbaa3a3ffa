"""The cluster's numbers that kf.Hook adds to Keras's logs (kf.Hook(cluster_logs=False): none),
where TensorBoard and the progress bar find them: per step (the last step's) and per epoch (the
epoch's mean step time, samples/s and allreduce bandwidth)."""
from __future__ import annotations

from kungfu import _peer
from kungfu.elastic import TrainingState


class ClusterLogs:
    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.epoch_totals = [0.0, 0, 0.0, 0]  # seconds, samples, allreduce bytes, steps
        self.traffic = 0  # bytes the runtime allreduced so far
        self.last_bytes = 0  # ... in the last step

    def begin_epoch(self) -> None:
        self.epoch_totals = [0.0, 0, 0.0, 0]

    def count(self, elapsed: float, samples: int) -> None:
        """Adds a step to the epoch's totals; reads the runtime's allreduce byte counter."""
        nbytes = sum(c[2] for c in _peer.get().strategy_counters()) if _peer.started() else 0
        self.last_bytes = max(nbytes - self.traffic, 0)  # a new native peer starts at 0
        self.traffic = nbytes
        t = self.epoch_totals
        t[0] += elapsed
        t[1] += samples
        t[2] += self.last_bytes
        t[3] += 1

    def step(self, s: TrainingState) -> dict:
        """For a step's logs: size, global batch, and the last step's time, samples/s and
        allreduce bandwidth (bytes/s over the step)."""
        if not self.enabled:
            return {}
        m = s.metrics
        out = {"cluster_size": s.cluster_size}
        if s.global_batch_size is not None:
            out["global_batch_size"] = s.global_batch_size
        if "step_time" in m:
            out["step_time"] = m["step_time"]
            out["samples_per_sec"] = m.get("throughput", 0.0)
            out["allreduce_bytes_per_sec"] = self.last_bytes / m["step_time"]
        return out

    def epoch(self, s: TrainingState) -> dict:
        """The same over the epoch that ended: mean step time, samples/s, bandwidth."""
        if not self.enabled:
            return {}
        out = self.step(s)
        seconds, samples, traffic, steps = self.epoch_totals
        if seconds > 0:
            out.update(step_time=seconds / steps, samples_per_sec=samples / seconds,
                       allreduce_bytes_per_sec=traffic / seconds)
        return out
