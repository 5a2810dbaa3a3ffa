"""Adaptation policies: user code that watches training and changes it while it runs.

    class GrowBatch(kf.BasePolicy):
        def after_epoch(self, state):
            gns = kf.allreduce(kf.grad_noise_scale(), "avg")
            if gns > 2 * state.global_batch_size:
                kf.set_batch_size(2 * state.local_batch_size)

    model.fit(kf.data(x, y, batch_size=32), callbacks=[kf.Hook(GrowBatch())])

A policy subclasses `BasePolicy` and overrides any of its hooks; each gets a `TrainingState`.
`kf.Hook` runs the hooks of its policies on every worker and applies their actions
(`set_tree`, `set_strategy`, `set_batch_size`, `set_batch_sizes`, `set_learning_rate`) at the
same step on every
worker (see kungfu/policy/_actions.py for the agreement rule). Nothing here imports TensorFlow.
"""
from __future__ import annotations

import copy
import functools
import inspect
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from kungfu.policy._actions import (
    check_tree,
    current_strategy,
    linear_scaled_lr,
    set_batch_size,
    set_batch_sizes,
    set_learning_rate,
    set_strategy,
    set_tree,
    sqrt_scaled_lr,
    strategy_stats,
)


@dataclass
class TrainingState:
    """What a policy sees. Counters are global (the same on every worker)."""

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
    # gns, grad_variance, step_time, throughput, compute_time; per worker in rank order (from
    # the step before: they ride on its agreement): compute_times, batch_sizes_trained.
    metrics: Dict[str, Any] = field(default_factory=dict)
    logs: Dict[str, Any] = field(default_factory=dict)  # Keras's logs of the last batch/epoch


@functools.lru_cache(maxsize=None)
def _takes_state(cls: type, hook: str) -> bool:
    try:
        params = inspect.signature(getattr(cls, hook)).parameters.values()
    except (TypeError, ValueError):
        return True
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD,
                                                    p.VAR_POSITIONAL)]
    return len(positional) > 1  # self, and the state


def call_hook(policy: "BasePolicy", hook: str, state: "TrainingState") -> None:
    """policy.<hook>(state); or policy.<hook>() for a hook written without the state argument,
    as the KungFu talk writes them (`def after_step(self):`)."""
    fn = getattr(policy, hook)
    if _takes_state(type(policy), hook):
        fn(state)
    else:
        fn()


class BasePolicy:
    """Base of adaptation policies: override the hooks you need (each receives the
    TrainingState). Policy state lives in the instance; `state_dict()` / `load_state_dict()`
    (by default: the instance's attributes) make it part of what a worker syncs."""

    def before_train(self, state: TrainingState) -> None:
        pass

    def before_epoch(self, state: TrainingState) -> None:
        pass

    def before_step(self, state: TrainingState) -> None:
        pass

    def after_step(self, state: TrainingState) -> None:
        pass

    def after_epoch(self, state: TrainingState) -> None:
        pass

    def after_train(self, state: TrainingState) -> None:
        pass

    def state_dict(self) -> Dict[str, Any]:
        """The policy's state: by default a copy of its attributes that hold plain data
        (numbers, strings, None, numpy arrays, and lists, tuples and dicts of them); attributes
        that refer to other objects (a model, a file) are the worker's own and are left out."""
        return {k: copy.deepcopy(v) for k, v in self.__dict__.items() if _plain(v)}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(copy.deepcopy(state))


from kungfu.policy.adaptive_strategy import AdaptiveStrategyPolicy  # noqa: E402
from kungfu.policy.autoscaler import ScalingAutoscaler  # noqa: E402
from kungfu.policy.load_balancing import LoadBalancing  # noqa: E402
from kungfu.policy.momentum import MomentumCompensation  # noqa: E402
from kungfu.policy.noise_scale import AdaScale, GNSBatchGrowth  # noqa: E402
from kungfu.policy.stragglers import StragglerReplacement  # noqa: E402

def _plain(v) -> bool:
    import numpy as np

    if v is None or isinstance(v, (bool, int, float, str, bytes, np.ndarray, np.generic)):
        return True
    if isinstance(v, (list, tuple, set, frozenset)):
        return all(_plain(x) for x in v)
    if isinstance(v, dict):
        return all(_plain(k) and _plain(x) for k, x in v.items())
    return False


HOOKS = ("before_train", "before_epoch", "before_step", "after_step", "after_epoch",
         "after_train")

__all__ = [
    "AdaScale",
    "AdaptiveStrategyPolicy",
    "GNSBatchGrowth",
    "LoadBalancing",
    "ScalingAutoscaler",
    "StragglerReplacement",
    "MomentumCompensation",
    "BasePolicy",
    "TrainingState",
    "HOOKS",
    "set_tree",
    "set_strategy",
    "set_batch_size",
    "set_batch_sizes",
    "set_learning_rate",
    "linear_scaled_lr",
    "sqrt_scaled_lr",
    "check_tree",
    "current_strategy",
    "strategy_stats",
]
