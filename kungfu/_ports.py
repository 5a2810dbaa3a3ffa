"""Ports for jobs started on one machine. kungfu-run binds its workers' ports itself and holds
them (listen, listen_block); the free_port* helpers name ports that were free a moment ago (the
tests and benchmarks launch kungfu-run with them), which another process may take before they
are bound: callers retry or accept that."""
from __future__ import annotations

import os
import random
import socket
import time
from typing import List, Sequence, Tuple


def free_ports(n: int, host: str = "127.0.0.1") -> List[int]:
    """n distinct ports of `host` that were free a moment ago (all bound at once, then
    released)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _ephemeral_ports() -> Tuple[int, int]:
    """The ports the kernel picks from for outgoing connections (Linux; else its default)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(v) for v in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def listen(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port and listening (kungfu-run's, for a worker to inherit).
    SO_REUSEADDR as the runtime's own bind has it: an earlier job's connections in TIME_WAIT do
    not keep the port; and once it listens, no other socket can bind the port, with
    SO_REUSEADDR or without. OSError when it cannot be bound."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, port))
        s.listen(128)
    except OSError:
        s.close()
        raise
    return s


def listen_at(base: int, slots: Sequence[Tuple[str, int]]) -> List[socket.socket]:
    """listen() on host:base+offset for each (host, offset) of `slots`, in their order; all or
    none (OSError, with those bound closed)."""
    socks: List[socket.socket] = []
    try:
        for host, offset in slots:
            socks.append(listen(host, base + offset))
    except OSError:
        for s in socks:
            s.close()
        raise
    return socks


def listen_block(slots: Sequence[Tuple[str, int]]) -> Tuple[int, List[socket.socket]]:
    """listen_at a base whose ports are all free: a random one below the ephemeral range where
    it leaves room (as kungfu-run's default range is), since a port in it may be taken by any
    outgoing connection (the job's own) before a worker that starts later (a joiner) listens
    there. Bound, not only seen free, so no other process can take one of them after the
    choice."""
    count = max((offset for _, offset in slots), default=0) + 1
    rng = random.Random(os.getpid() * 7919 + time.monotonic_ns())
    low = _ephemeral_ports()[0]
    start, stop = 20000, (low if low - count > 21000 else 60000) - count
    for _ in range(500):
        base = rng.randrange(start, stop)
        try:
            return base, listen_at(base, slots)
        except OSError:
            continue
    hosts = ", ".join(dict.fromkeys(host for host, _ in slots))
    raise RuntimeError(f"no block of {count} free ports found on {hosts}")


def free_port_block(count: int, hosts: Sequence[str] = ("127.0.0.1",)) -> int:
    """The first of `count` consecutive ports that can be bound on every one of `hosts` now
    (listen_block's choice, released: another process may take them before the caller binds)."""
    base, socks = listen_block([(host, offset) for host in hosts for offset in range(count)])
    for s in socks:
        s.close()
    return base


def free_port_range(count: int, hosts: Sequence[str] = ("127.0.0.1",)) -> str:
    """free_port_block as 'A-B', the form of kungfu-run's -port-range."""
    base = free_port_block(count, hosts)
    return f"{base}-{base + count - 1}"
