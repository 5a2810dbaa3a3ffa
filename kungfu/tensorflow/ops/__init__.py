"""TensorFlow ops over the kungfu runtime (KungFu-compatible names).

Every collective takes a `name` that must be the same on every worker for the same tensor: the
k-th run of a named op on one worker meets the k-th run of that name on the others. Ops read rank
and size when they run, so a traced `tf.function` stays correct after the cluster changes.
"""
from __future__ import annotations

from kungfu.tensorflow.ops._collectives import (  # noqa: F401
    all_gather,
    all_reduce,
    all_to_all,
    barrier,
    broadcast,
    cluster_size,
    consensus,
    counter,
    defuse,
    fuse,
    global_noise_scale,
    group_all_reduce,
    peer_info,
    rank,
    reduce_scatter,
    request_variable,
    save_variable,
)
from kungfu.tensorflow.ops._adapt import (  # KungFu's names (docs/tensorflow.md)
    calc_stats,
    check_interference,
    egress_rates,
    get_init_checkpoint,
    get_neighbour_mask,
    get_peer_latencies,
    global_minimum_spanning_tree,
    group_nccl_all_reduce,
    log_stats,
    monitored_all_reduce,
    request_variable_with_template,
    resize,
    resize_cluster_from_url,
    round_robin,
    set_tree,
    step_based_schedule,
    subset_all_reduce,
)

__all__ = [
    "global_noise_scale",
    "set_tree", "resize", "resize_cluster_from_url", "monitored_all_reduce",
    "request_variable_with_template", "calc_stats", "log_stats", "check_interference",
    "egress_rates", "get_peer_latencies", "global_minimum_spanning_tree", "get_neighbour_mask",
    "round_robin", "group_nccl_all_reduce", "subset_all_reduce", "step_based_schedule",
    "get_init_checkpoint",
    "all_reduce", "group_all_reduce", "broadcast", "all_gather", "all_to_all", "reduce_scatter",
    "barrier", "consensus",
    "peer_info", "rank", "cluster_size", "counter", "fuse", "defuse", "save_variable",
    "request_variable",
]
