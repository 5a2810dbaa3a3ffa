"""Adaptation policies: user code that watches training and changes it while it runs.

    class GrowBatch(kf.BasePolicy):
        def after_epoch(self, state):
            if state.metrics.get("gns", 0) > 2 * state.global_batch_size:
                kf.set_batch_size(2 * state.local_batch_size)

    data = kf.ElasticData(x, y, batch_size=32)
    model.fit(data.dataset(), callbacks=[kf.Hook(GrowBatch(), data=data)])

A policy subclasses `BasePolicy` and overrides any of its hooks; each gets a `TrainingState`.
`kf.Hook` runs the hooks of its policies on every worker and applies their actions
(`set_tree`, `set_strategy`, `set_batch_size`, `set_batch_sizes`, `set_learning_rate`,
`kf.resize`) at the same step on every worker (kungfu/elastic/_round.py: the decision round and
its agreement rule). The built-in policies read only their TrainingState (the monitored values
included): nothing here imports TensorFlow, the elastic machinery's internals or the package
face.
"""
from __future__ import annotations

from kungfu._strategy import check_tree, current_strategy, strategy_stats
from kungfu.elastic import (
    HOOKS,
    TrainingState,
    set_batch_size,
    set_batch_sizes,
    set_learning_rate,
    set_strategy,
    set_tree,
)
from kungfu.policy._base import BasePolicy
from kungfu.policy._rules import linear_scaled_lr, sqrt_scaled_lr
from kungfu.policy.adaptive_strategy import AdaptiveStrategyPolicy
from kungfu.policy.autoscaler import ScalingAutoscaler
from kungfu.policy.load_balancing import LoadBalancing
from kungfu.policy.momentum import MomentumCompensation
from kungfu.policy.noise_scale import AdaScale, GNSBatchGrowth
from kungfu.policy.stragglers import StragglerReplacement

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
