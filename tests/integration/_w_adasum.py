"""Worker body for test_adasum.py: every rank's Adasum of inputs the test computes too."""
from __future__ import annotations

import numpy as np

import kungfu as kf
from _w_kungfu_names import error_of


def grads_of(r: int) -> list:
    """Worker r's gradients: two tensors of different dtypes and shapes."""
    rng = np.random.default_rng(10 + r)
    return [rng.standard_normal((3, 4)).astype(np.float32), rng.standard_normal(5)]


def tf_grads_of(r: int) -> list:
    """Worker r's gradients of the two variables in _w_tf_optim's op="adasum" step."""
    rng = np.random.default_rng(20 + r)
    return [rng.standard_normal(4).astype(np.float32),
            rng.standard_normal((2, 2)).astype(np.float32)]


def torch_step(r: int) -> dict:
    """A step of SynchronousSGDOptimizer(op="adasum") with SGD(lr=1) from zero weights, whose
    gradients are grads_of(r) (so the weights end at minus their Adasum), and the refusals."""
    import torch

    from kungfu.torch.optimizers import SynchronousSGDOptimizer

    g = grads_of(r)
    params = [torch.zeros(t.shape, dtype=torch.float32) for t in g]
    for p in params:
        p.requires_grad_()
    opt = SynchronousSGDOptimizer(torch.optim.SGD(params, lr=1.0), op="adasum")
    sum((p * torch.from_numpy(t.astype(np.float32))).sum() for p, t in zip(params, g)).backward()
    opt.step()
    plain = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    return {"weights": [p.detach().numpy().copy() for p in params],
            "fp16": error_of(lambda: SynchronousSGDOptimizer(plain, op="adasum",
                                                             compression="fp16")),
            "bad op": error_of(lambda: SynchronousSGDOptimizer(plain, op="mean"))}


def run() -> dict:
    r, n = kf.rank(), kf.size()
    unit = np.zeros(n, np.float64)
    unit[r] = r + 1.0  # orthogonal across ranks
    same = np.linspace(-1, 2, 6)
    half = (np.arange(4, dtype=np.float16) + r)  # float16 in, float16 out
    return {
        "grads": kf.adasum(grads_of(r), name="g"),
        "orthogonal": kf.adasum(unit, name="o"),
        "same": kf.adasum(same, name="s"),
        "zero": kf.adasum(np.zeros(3) if r else np.ones(3), name="z"),
        "half": kf.adasum(half, name="h"),
        "integer": error_of(lambda: kf.adasum(np.arange(3))),
        "after": kf.allreduce(np.ones(2)),  # the cluster's collectives still pair up
        "torch": torch_step(r) if n in (2, 3) and _has_torch() else None,
    }


def _has_torch() -> bool:
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True
