"""kungfu-run under a cluster manager: when -H is not given, a job step of Slurm (slurm.py) or a
pod of a Kubernetes Indexed Job (kubernetes.py) says where the job runs, and `configure` sets
the flags a user would otherwise write on every host: -H, -self, -np when not given, and with
-w the config store (the first host's launcher hosts it). Given -H, the manager is ignored.
"""
from __future__ import annotations

import math
from typing import Optional

from kungfu._hosts import ManagedHosts, UsageError
from kungfu._launch import kubernetes, slurm


def configure(opts, np_given: bool) -> Optional[str]:
    """Sets opts from the cluster manager kungfu-run runs under, if any (see the module's doc);
    returns a line saying what it took, or None."""
    if opts.hosts is not None:
        return None
    for source in (slurm.hosts, kubernetes.hosts):
        found = source()
        if found is not None:
            return place(opts, np_given, found)
    return None


def place(opts, np_given: bool, h: ManagedHosts) -> str:
    """Sets opts as -H, -self, -np and -w's store would for the hosts `h`; the line to print."""
    if opts.self_host is not None or opts.nic is not None:
        raise UsageError(f"under a cluster manager ({h.manager}) kungfu-run takes this host from "
                         f"it: give -self or -nic only with -H")
    if len(set(h.addresses)) < len(h.addresses):
        shown = ", ".join(f"{n}={a}" for n, a in zip(h.names, h.addresses))
        raise UsageError(f"{h.manager}: hosts share addresses ({shown}): give -H and -self")
    if not np_given:
        opts.np = h.workers
    slots = max(math.ceil(opts.np / len(h.names)), h.slots)
    if opts.elastic:
        slots = max(slots, h.elastic_slots)
    opts.hosts = ",".join(f"{a}:{slots}" for a in h.addresses)
    opts.self_host = h.addresses[h.me]
    store = ""
    if opts.elastic and opts.builtin_config_port is None and opts.config_server is None:
        if h.me == 0:
            opts.builtin_config_port = h.store_port
        else:
            opts.config_server = f"http://{h.addresses[0]}:{h.store_port}"
        store = f"; the config store on {h.names[0]}, port {h.store_port}"
    shown = h.names[h.me] if h.names[h.me] == h.addresses[h.me] else \
        f"{h.names[h.me]} ({h.addresses[h.me]})"
    return (f"{h.manager}: {opts.np} worker{'s' * (opts.np != 1)} on {len(h.names)} "
            f"host{'s' * (len(h.names) != 1)} ({opts.hosts}), this one {shown}{store}")
