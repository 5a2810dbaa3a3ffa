"""Free ports for jobs started on one machine (the tests and benchmarks launch kungfu-run with
them). A port free now may be taken by another process before it is bound: callers retry or
accept that."""
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


def free_port_block(count: int, hosts: Sequence[str] = ("127.0.0.1",)) -> int:
    """The first of `count` consecutive ports that can be bound on every one of `hosts` now.
    They are below the ephemeral range where it leaves room (as kungfu-run's default range is):
    a port in it may be taken by any outgoing connection (the job's own) before a worker that
    starts later (a joiner) listens there."""
    rng = random.Random(os.getpid() * 7919 + time.monotonic_ns())
    low = _ephemeral_ports()[0]
    start, stop = 20000, (low if low - count > 21000 else 60000) - count
    for _ in range(500):
        base = rng.randrange(start, stop)
        socks = []
        try:
            for host in hosts:
                for port in range(base, base + count):
                    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                    socks.append(s)
                    s.bind((host, port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no block of {count} free ports found on {', '.join(hosts)}")


def free_port_range(count: int, hosts: Sequence[str] = ("127.0.0.1",)) -> str:
    """free_port_block as 'A-B', the form of kungfu-run's -port-range."""
    base = free_port_block(count, hosts)
    return f"{base}-{base + count - 1}"
