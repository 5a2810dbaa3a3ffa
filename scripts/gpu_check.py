"""The GPU checks of scripts/gpu_check.sh, one worker body per check (run under kungfu-run):

    python scripts/gpu_check.py exact      collectives on CUDA tensors, exact (NCCL at np 1,
                                           staging at np 2: KUNGFU_GPU says which)
    python scripts/gpu_check.py optimizer  a SynchronousSGDOptimizer step on CUDA: identical
                                           weights on every worker afterwards

Each prints one JSON line and exits non-zero on a wrong value."""
import json
import sys

import numpy as np
import torch

import kungfu.torch as kft
from kungfu import _device, _gpu, _peer


def exact() -> dict:
    peer = _peer.get()
    r, n = peer.rank, peer.size
    dev = torch.device("cuda", 0)
    k = torch.arange(1 << 20, dtype=torch.float32, device=dev)
    x = k * (r + 1)
    kft.ops.collective.all_reduce(x, "sum")
    assert torch.equal(x, k * sum(range(1, n + 1))), "allreduce sum"
    y = k * (r + 1)
    kft.ops.collective.all_reduce(y, "avg")
    assert torch.allclose(y, k * (n + 1) / 2), "allreduce avg"
    b = torch.full((1000,), float(r), device=dev)
    kft.ops.collective.broadcast_async(b, n - 1).wait()
    assert torch.equal(b, torch.full_like(b, n - 1.0)), "broadcast"
    out = {"check": "exact", "np": n, "rank": r, "gpu": _gpu.show_nccl_version(),
           "device": torch.cuda.get_device_name(dev)}
    if _gpu.backend_for(*_spec())[0] == "nccl":
        stream = torch.cuda.current_stream().cuda_stream
        g = torch.empty(n * 3, dtype=torch.int32, device=dev)
        s = torch.full((3,), r, dtype=torch.int32, device=dev)
        _device.allgather_async(s.data_ptr(), g.data_ptr(), 3, np.int32, stream=stream,
                                keep=(s, g)).wait()
        assert g.cpu().tolist() == [q for q in range(n) for _ in range(3)], "allgather"
        out["equal_blocks"] = True
    torch.cuda.synchronize()
    return out


def _spec():
    import os
    spec = os.environ.get("KUNGFU_SELF_SPEC", "127.0.0.1:1")
    return spec, os.environ.get("KUNGFU_INIT_PEERS", spec).split(",")


def optimizer() -> dict:
    torch.manual_seed(kft.rank())  # different starts: broadcast_parameters makes them one
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 10)).cuda()
    opt = kft.optimizers.SynchronousSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                                 named_parameters=model.named_parameters())
    kft.broadcast_parameters(model.state_dict())
    x = torch.randn(32, 64, device="cuda")
    y = torch.randint(0, 10, (32,), device="cuda")
    for _ in range(3):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    digests = kft.ops.collective.all_gather(flat.double().sum().reshape(1).cpu())
    assert torch.all(digests == digests[0]), f"weights differ: {digests.tolist()}"
    return {"check": "optimizer", "np": kft.size(), "digest": float(digests[0])}


if __name__ == "__main__":
    print(json.dumps({"exact": exact, "optimizer": optimizer}[sys.argv[1]]()), flush=True)
