"""kungfu-run in a pod of a Kubernetes Indexed Job (docs/kubernetes.md): one pod per host, the
pods found by their DNS names under a headless Service.

Kubernetes names an Indexed Job's pods `<job>-<index>` (their hostname) and sets
JOB_COMPLETION_INDEX; with `spec.subdomain: <service>` and a headless Service of that name, pod i
is reachable as `<job>-<i>.<service>`. The manifest (examples/kubernetes/digits.yaml) tells
kungfu-run the rest: KUNGFU_K8S_PODS (the Job's completions) and KUNGFU_K8S_SERVICE (the
Service). Without -H, each launcher then takes:

- the hosts: `<job>-0.<service>`, ..., one per pod, with ceil(np / pods) slots (at least
  KUNGFU_K8S_GPUS, the GPUs the manifest gives a pod);
- this host: `<job>-<index>.<service>`;
- -np when not given: one worker per GPU of each pod, else one per pod;
- -w without a store: pod 0 hosts the builtin one, on port KUNGFU_K8S_STORE_PORT (default 29400,
  which the Service names), the others use it.

The names are resolved by the workers when they connect (a pod that is not up yet is retried
until the connect deadline): the Service must publish pods that are not ready
(`publishNotReadyAddresses: true`), as kungfu's workers answer no readiness probe.
"""
from __future__ import annotations

import os
import socket
from typing import Mapping, Optional

from kungfu._hosts import ManagedHosts, UsageError

STORE_PORT = 29400


def _number(environ: Mapping[str, str], name: str, default: Optional[int] = None,
            least: int = 1) -> int:
    text = environ.get(name)
    if text is None and default is not None:
        return default
    if text is None or not text.strip().isdigit() or int(text) < least:
        raise UsageError(f"{name} must be a number >= {least} (the manifest sets it; see "
                         f"docs/kubernetes.md), got {text!r}")
    return int(text)


def hosts(environ: Optional[Mapping[str, str]] = None,
          hostname: Optional[str] = None) -> Optional[ManagedHosts]:
    """The pods of the Indexed Job this pod belongs to (see the module's doc), or None outside
    one (no JOB_COMPLETION_INDEX, or no KUNGFU_K8S_SERVICE: a Job not written for kungfu)."""
    environ = os.environ if environ is None else environ
    index, service = environ.get("JOB_COMPLETION_INDEX"), environ.get("KUNGFU_K8S_SERVICE")
    if index is None or not service:
        return None
    index_n = _number(environ, "JOB_COMPLETION_INDEX", least=0)
    pods = _number(environ, "KUNGFU_K8S_PODS")
    gpus = _number(environ, "KUNGFU_K8S_GPUS", 0, least=0)
    port = _number(environ, "KUNGFU_K8S_STORE_PORT", STORE_PORT)
    name = hostname or environ.get("HOSTNAME") or socket.gethostname()
    job, dash, own = name.rpartition("-")
    if not dash or own != str(index_n):
        raise UsageError(f"this pod's hostname {name!r} is not <job>-{index_n}: kungfu-run "
                         f"runs in the pods of an Indexed Job (completionMode: Indexed)")
    if index_n >= pods:
        raise UsageError(f"JOB_COMPLETION_INDEX {index_n} is not below KUNGFU_K8S_PODS {pods}: "
                         f"set it to the Job's completions")
    names = [f"{job}-{i}.{service}" for i in range(pods)]
    return ManagedHosts(f"Kubernetes job {job}", names, names, index_n, pods * max(gpus, 1),
                        gpus, 0, port)
