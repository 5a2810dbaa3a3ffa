"""The slots of a job: hosts and their slots (-H), the ports workers listen on (-port-range),
and the plan that places N workers on them (host-major in -H order).

Shared by the launcher (kungfu-run) and the workers (a resize plans its next peers the same
way); it imports nothing of either.
"""
from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from typing import List, Sequence, Tuple


class UsageError(Exception):
    """A bad command line; the message becomes the one-line error."""


# ---------------------------------------------------------------------------------------------
# Command line


def parse_port_range(text: str) -> Tuple[int, int]:
    m = re.fullmatch(r"\s*(\d+)\s*-\s*(\d+)\s*", text)
    if not m:
        raise UsageError(f"-port-range must look like 10000-11000, got {text!r}")
    begin, end = int(m.group(1)), int(m.group(2))
    if not (1 <= begin <= end <= 65535):
        raise UsageError(
            f"-port-range {text!r} is invalid: need 1 <= first <= last <= 65535"
        )
    return begin, end


_HOSTNAME_LABEL = re.compile(r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?")


def _is_ipv4(text: str) -> bool:
    try:
        ipaddress.IPv4Address(text)
        return True
    except ValueError:
        return False


def _valid_host(text: str) -> bool:
    if _is_ipv4(text):
        return True
    if re.fullmatch(r"[\d.]+", text):  # looks numeric but is not a valid address
        return False
    if len(text) > 253:
        return False
    return all(_HOSTNAME_LABEL.fullmatch(label) for label in text.split("."))


@dataclass(frozen=True)
class HostSpec:
    host: str
    slots: int


def parse_hosts(text: str) -> List[HostSpec]:
    """'a:2,b,c:4' -> [HostSpec('a', 2), HostSpec('b', 1), HostSpec('c', 4)]."""
    hosts: List[HostSpec] = []
    seen = set()
    for entry in text.split(","):
        entry = entry.strip()
        if not entry:
            raise UsageError(f"-H {text!r} has an empty entry")
        host, colon, slots_text = entry.partition(":")
        if colon:
            if not re.fullmatch(r"\d+", slots_text):
                raise UsageError(f"-H entry {entry!r}: slots must be a positive integer")
            slots = int(slots_text)
            if slots < 1:
                raise UsageError(f"-H entry {entry!r}: slots must be at least 1")
        else:
            slots = 1
        if not _valid_host(host):
            raise UsageError(
                f"-H entry {entry!r}: {host!r} is not an IPv4 address or a host name"
            )
        if host in seen:
            raise UsageError(f"-H names host {host!r} more than once")
        seen.add(host)
        hosts.append(HostSpec(host, slots))
    return hosts


@dataclass(frozen=True)
class Worker:
    rank: int
    host: str
    port: int
    local_rank: int

    @property
    def spec(self) -> str:
        return f"{self.host}:{self.port}"


def plan_workers(np: int, hosts: Sequence[HostSpec], port_range: Tuple[int, int]) -> List[Worker]:
    """Every worker of the job, in rank order: host-major in -H order."""
    total = sum(h.slots for h in hosts)
    if np > total:
        raise UsageError(f"-np {np} is more than the {total} slots of -H")
    begin, end = port_range
    nports = end - begin + 1
    for h in hosts:
        if h.slots > nports:
            raise UsageError(
                f"-port-range {begin}-{end} has {nports} ports, fewer than the "
                f"{h.slots} slots of host {h.host}"
            )
    workers: List[Worker] = []
    for h in hosts:
        for slot in range(h.slots):
            if len(workers) == np:
                return workers
            workers.append(Worker(len(workers), h.host, begin + slot, slot))
    return workers


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    return _is_ipv4(host) and ipaddress.IPv4Address(host).is_loopback


@dataclass
class ManagedHosts:
    """Where a cluster manager runs a job, one launcher on each host (kungfu/_launch/cluster.py)."""

    manager: str  # "Slurm job 42", "Kubernetes job digits"
    names: List[str]  # the hosts' names, in the manager's order
    addresses: List[str]  # the addresses the workers use, in the same order
    me: int  # this host's position
    workers: int  # -np when not given
    slots: int  # at least this many slots a host
    elastic_slots: int  # with -w, at least this many (room to grow within the allocation)
    store_port: int  # -w: the builtin store's port on the first host
