"""The torch.distributed (gloo backend) side of benchmarks/allreduce.py.

Imported only with --compare. torch is optional: `load()` returns None when it is missing.
"""
from __future__ import annotations

import datetime
import os
from typing import Callable, List, Optional, Sequence

import numpy as np


def load():
    """The torch module, or None when it is not importable."""
    try:
        import torch
        import torch.distributed  # noqa: F401
    except ImportError:
        return None
    return torch


def _loopback_only(hosts: Sequence[str]) -> bool:
    return all(h in ("127.0.0.1", "localhost", "::1") or h.startswith("127.") for h in hosts)


class Gloo:
    """One gloo process group spanning the same workers (same ranks) as the kungfu cluster."""

    def __init__(self, rank: int, size: int, host: str, port: int, hosts: Sequence[str],
                 timeout_s: float = 120.0):
        self.torch = load()
        if self.torch is None:
            raise RuntimeError("torch is not importable")
        import torch.distributed as dist

        self.dist = dist
        # Without this, gloo picks the interface the host name resolves to, which on a machine
        # without a network (or with several) may not reach the other local workers.
        if _loopback_only(hosts):
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        self.torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://{host}:{port}", rank=rank,
                                world_size=size,
                                timeout=datetime.timedelta(seconds=timeout_s))
        self.version = self.torch.__version__

    def close(self) -> None:
        if self.dist.is_initialized():
            self.dist.destroy_process_group()

    def tensor(self, array: np.ndarray):
        """A torch tensor sharing memory with a contiguous numpy array."""
        return self.torch.from_numpy(np.ascontiguousarray(array))

    def fused(self, buf) -> Callable[[], None]:
        """One in-place sum-allreduce of `buf` per call."""
        dist = self.dist

        def run():
            dist.all_reduce(buf)

        return run

    def per_tensor(self, bufs: List) -> Callable[[], None]:
        """Starts an async sum-allreduce on every tensor, then waits for all of them."""
        dist = self.dist

        def run():
            works = [dist.all_reduce(b, async_op=True) for b in bufs]
            for w in works:
                w.wait()

        return run


def port_from_peers(peers: Sequence[str], offset: int = 1000) -> Optional[int]:
    """A port every worker derives alike from the cluster's peer list: first peer's port + offset."""
    if not peers:
        return None
    port = int(peers[0].rsplit(":", 1)[1])
    return port + offset if port + offset < 65536 else port - offset
