"""kungfu.torch: the PyTorch binding (docs/torch.md), under the original KungFu's names.

    import kungfu.torch as kf
    kf.broadcast_parameters(model.state_dict())
    optimizer = kf.optimizers.SynchronousSGDOptimizer(optimizer, model.named_parameters())
    kf.broadcast_optimizer_state(optimizer)

    trainer = kf.ElasticTrainer(model, optimizer, MyPolicy(), data=kf.ElasticData(x, y))
    trainer.fit(train_step, epochs=5)                # elastic: resize, recovery, policies

Importing it imports torch; `import kungfu` alone never does. Launch workers with
`kungfu-run -np N python train.py`.
"""
from __future__ import annotations

from kungfu import _gpu, _peer
from kungfu._collective import allgather_object, barrier, broadcast_object
from kungfu._join import join
from kungfu._process_set import ProcessSet
from kungfu.elastic import ElasticData
from kungfu.torch import ops, optimizers
from kungfu.torch._join import Join
from kungfu.torch.elastic import ElasticTrainer
from kungfu.torch.ops import *  # noqa: F401,F403 - the collectives, under KungFu's names
from kungfu.torch.optimizers import Compression


def rank() -> int:
    """This worker's rank, 0 <= rank < size()."""
    return _peer.identity().rank


def size() -> int:
    """The number of workers in the cluster."""
    return _peer.identity().size


def local_rank() -> int:
    """This worker's index among the workers on its host (e.g. its GPU)."""
    return _peer.identity().local_rank


def local_size() -> int:
    """The number of workers on this worker's host."""
    return _peer.identity().local_size


def nccl_available() -> bool:
    """Whether NCCL and the CUDA runtime were found in this process, so CUDA tensors stay on the
    device (docs/torch.md, GPUs). kungfu loads them at run time: no build has them built in."""
    return _gpu.nccl_available()


def nccl_built() -> bool:
    """KungFu's name for nccl_available()."""
    return _gpu.nccl_available()


def show_nccl_version() -> str:
    """NCCL's version and where it was found, or why it was not."""
    return _gpu.show_nccl_version()


__all__ = [
    "nccl_available",
    "nccl_built",
    "show_nccl_version",
    "ops",
    "optimizers",
    "rank",
    "size",
    "local_rank",
    "local_size",
    "ElasticData",
    "ElasticTrainer",
    "Compression",
    "ProcessSet",
    "allgather_object",
    "barrier",
    "broadcast_object",
    "join",
    "Join",
] + [name for name in ops.__all__ if name != "agree_on"]
