"""KungFu's adaptation ops (`set_tree`, `resize`, `resize_cluster_from_url`,
`monitored_all_reduce`) and the other names KungFu's examples import from
`kungfu.tensorflow.ops`.

`set_tree`, `resize` and `resize_cluster_from_url` are thin wrappers over kf.set_tree and
kf.resize, run eagerly: they change the cluster between operations (a new session, agreed by
every worker), which is a step-boundary action, not a node of a step's graph. Inside a
`tf.function` they raise a RuntimeError that says to call them outside it (a kf.BasePolicy hook,
or the loop around the compiled step). They take tensors or Python values and return tensors,
as KungFu's ops do.

Names of KungFu's that kungfu does not have are defined too, so that an import of them works;
calling one raises NotImplementedError naming what to use instead.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import tensorflow as tf

from kungfu import python as _kp
from kungfu.elastic import set_tree as _set_tree
from kungfu.tensorflow.ops._collectives import all_reduce, request_variable


def _eager_only(what: str) -> None:
    if not tf.executing_eagerly():
        raise RuntimeError(
            f"kungfu.tensorflow.ops.{what} changes the cluster between operations and runs "
            "eagerly only: call it outside tf.function (from a kf.BasePolicy hook run by kf.Hook, "
            "or from the loop around the compiled step)")


def _value(x):
    return x.numpy() if isinstance(x, (tf.Tensor, tf.Variable)) else x


def set_tree(tree, name: Optional[str] = None):
    """KungFu's set_tree: reduce along this tree from now on (tree[i] is rank i's parent, one
    root). kf.set_tree: every worker agrees on the tree before it is installed; a malformed tree
    or trees that differ fail on every worker with ValueError. Returns True (a bool tensor).
    KungFu's idiom set_tree(broadcast(tree)) works as it is."""
    _eager_only("set_tree")
    tree = np.asarray(_value(tree))
    if tree.ndim != 1 or not np.issubdtype(tree.dtype, np.integer):
        raise ValueError(f"set_tree: a tree is a 1-D integer array of fathers, got {tree!r}")
    _set_tree([int(f) for f in tree])
    return tf.constant(True)


def resize(n=None):
    """KungFu's resize op: (changed, detached) as bool tensors. kungfu.python.resize: with n, a
    resize to n workers; without, the cluster put into the config store from outside the job
    (see resize_cluster_from_url). Needs an elastic job (kungfu-run -w): elsewhere it raises
    kf.ResizeError saying so, and nothing changes. Outside a kf.Hook it is a collective that
    every worker calls at the same point; from a policy hook, the Hook applies it."""
    _eager_only("resize")
    changed, detached = _kp.resize(None if n is None else int(_value(n)))
    return tf.constant(bool(changed)), tf.constant(bool(detached))


def resize_cluster_from_url():
    """KungFu's resize_cluster_from_url: adopts the cluster that was PUT into the job's config
    store from outside (docs/elastic.md, "Changing the cluster from outside"); (changed,
    detached) as bool tensors, (False, False) when none is waiting."""
    return resize()


def monitored_all_reduce(t, tree=None, op: str = "sum", name: Optional[str] = None):
    """KungFu's monitored_all_reduce: all_reduce, whose traffic is counted per strategy like
    every allreduce of the default strategy (kungfu.policy.strategy_stats(): operations, bytes,
    seconds, bytes per second). KungFu's per-call `tree` is deprecated there; here it is refused:
    install a tree for every allreduce with set_tree."""
    if tree is not None:
        raise NotImplementedError(
            "monitored_all_reduce(tree=...): a tree per call is not supported (KungFu deprecated "
            "it); install one with kungfu.tensorflow.ops.set_tree(tree) (or kf.set_tree)")
    return all_reduce(t, op=op, name=name)


def request_variable_with_template(target, template, version=None, name: Optional[str] = None,
                                   timeout: Optional[float] = None):
    """KungFu's request_variable_with_template: request_variable shaped like `template`."""
    return request_variable(target, version=version, name=name, like=template, timeout=timeout)


def _missing(name: str, instead: str):
    def missing(*args, **kwargs):
        raise NotImplementedError(f"kungfu.tensorflow.ops.{name} (KungFu) is not available in "
                                  f"kungfu: {instead}")

    missing.__name__ = missing.__qualname__ = name
    missing.__doc__ = f"Not available: {instead}"
    return missing


_STRATEGY_MONITORING = ("use kungfu.policy.strategy_stats() (allreduce throughput per strategy) "
                        "and kungfu.policy.AdaptiveStrategyPolicy (switches the strategy when "
                        "throughput drops)")
_TOPOLOGY = ("install a tree of your choice with set_tree(fathers), or let "
             "kungfu.policy.AdaptiveStrategyPolicy pick a strategy")
_NCCL = ("there is no NCCL path (collectives run on the CPU); use group_all_reduce, or "
         "all_reduce per tensor")

calc_stats = _missing("calc_stats", _STRATEGY_MONITORING)
log_stats = _missing("log_stats", _STRATEGY_MONITORING)
check_interference = _missing("check_interference", _STRATEGY_MONITORING)
egress_rates = _missing("egress_rates", "per-peer egress rates are not measured; " +
                        _STRATEGY_MONITORING)
get_peer_latencies = _missing("get_peer_latencies", _TOPOLOGY)
global_minimum_spanning_tree = _missing("global_minimum_spanning_tree", _TOPOLOGY)
get_neighbour_mask = _missing("get_neighbour_mask", _TOPOLOGY)
round_robin = _missing("round_robin", _TOPOLOGY)
group_nccl_all_reduce = _missing("group_nccl_all_reduce", _NCCL)
subset_all_reduce = _missing("subset_all_reduce", "a collective among some workers is what a "
                             "process set is for (kf.ProcessSet, where this kungfu has it); "
                             "otherwise all_reduce over every worker")
step_based_schedule = _missing("step_based_schedule", "write a kf.BasePolicy whose after_step "
                               "calls kf.resize(n) at the steps of the schedule")
get_init_checkpoint = _missing("get_init_checkpoint", "resume from a checkpoint with "
                               "kf.Hook(checkpoint=path)")

KUNGFU_NAMES = ["set_tree", "resize", "resize_cluster_from_url", "monitored_all_reduce",
                "request_variable_with_template"]
MISSING = ["calc_stats", "log_stats", "check_interference", "egress_rates", "get_peer_latencies",
           "global_minimum_spanning_tree", "get_neighbour_mask", "round_robin",
           "group_nccl_all_reduce", "subset_all_reduce", "step_based_schedule",
           "get_init_checkpoint"]
