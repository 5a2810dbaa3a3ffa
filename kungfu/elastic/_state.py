"""What a policy sees of training: the TrainingState, filled by the trainer and the round."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional


@dataclass
class TrainingState:
    """What a policy sees. Counters are global (the same on every worker). Everything a built-in
    policy reads is here: it needs neither the elastic machinery nor the framework."""

    step: int = 0  # steps finished since training began
    epoch: int = 0
    step_in_epoch: int = 0
    samples_seen: int = 0  # samples of every worker, since training began
    samples_in_epoch: int = 0  # samples of every worker, in this epoch
    local_batch_size: Optional[int] = None
    global_batch_size: Optional[int] = None
    batch_sizes: Optional[List[int]] = None  # every worker's, in rank order (kf.ElasticData)
    learning_rate: Optional[float] = None
    cluster_size: int = 1
    rank: int = 0
    # The elastic job's limits (kungfu-run -w: its slots; otherwise the fixed cluster size) and
    # whether a resize is under way (its new workers are starting); set before each hook.
    min_size: int = 1
    max_size: int = 1
    resize_pending: bool = False
    # gns, grad_variance, grad_noise_stats (tr(S), |G|^2), step_time, throughput, compute_time;
    # per worker in rank order (from the step before: they ride on its agreement):
    # compute_times, part_sizes.
    metrics: Dict[str, Any] = field(default_factory=dict)
    logs: Dict[str, Any] = field(default_factory=dict)  # Keras's logs of the last batch/epoch
