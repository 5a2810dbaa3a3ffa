"""Worker bodies for test_torch.py: kungfu.torch's collectives and optimizers in real processes.
Tensors come back as numpy arrays (bfloat16 as float32) so the test process can compare them."""
from __future__ import annotations

import numpy as np
import torch

import kungfu.torch as kf

DTYPES = ["float32", "float64", "float16", "bfloat16", "int32", "int64", "int8", "uint8"]
OPS = ["sum", "max", "min"]


def inputs(rank: int, dtype: str) -> np.ndarray:
    """Rank's input, as float64 values every dtype holds exactly (small integers)."""
    rng = np.random.default_rng(100 + rank)
    low = 0 if dtype == "uint8" else -20
    return rng.integers(low, 20, size=(3, 5)).astype(np.float64)


def _tensor(values: np.ndarray, dtype: str) -> torch.Tensor:
    return torch.from_numpy(values).to(getattr(torch, dtype))


def _back(t: torch.Tensor) -> np.ndarray:
    return t.detach().to(torch.float64).numpy()


def collectives():
    r, n = kf.rank(), kf.size()
    out = {}
    for dtype in DTYPES:
        for op in OPS:
            x = _tensor(inputs(r, dtype), dtype)
            before = x.clone()
            got = kf.all_reduce_fn(x, op)
            assert got.dtype == x.dtype and torch.equal(x, before)  # the input is left alone
            out[dtype, op] = _back(got)
            kf.all_reduce(x, op)  # in place, through a numpy view of x's memory
            out[dtype, op, "in place"] = _back(x)
    # A non-contiguous input (the transpose of a contiguous one), reduced in place: the result
    # must land in the base tensor's memory through the staging copy.
    base = _tensor(inputs(r, "float32"), "float32")
    view = base.t()
    assert not view.is_contiguous()
    out["transposed fn"] = _back(kf.all_reduce_fn(view, "sum"))
    kf.all_reduce(view, "sum")
    out["transposed base"] = _back(base)
    # A parameter that requires grad, reduced in place: still a parameter, still requiring grad.
    p = torch.nn.Parameter(_tensor(inputs(r, "float64"), "float64"))
    q = kf.all_reduce(p, "avg")
    out["param"] = (_back(p), q is p, p.requires_grad)
    # Started asynchronously, waited for later.
    a = _tensor(inputs(r, "int64"), "int64")
    h = kf.all_reduce_async(a, "max", name="async")
    out["async"] = (_back(h.wait()), h.done())
    out["gather"] = _back(kf.all_gather(_tensor(inputs(r, "float32"), "float32")))
    out["broadcast"] = _back(kf.broadcast(_tensor(inputs(r, "int32"), "int32"), root=n - 1))
    try:
        kf.all_reduce_fn(torch.ones(2, dtype=torch.complex64))
        out["complex"] = "accepted"
    except Exception as e:  # refused on this worker, and the others fail as well
        out["complex"] = f"{type(e).__name__}: {e}"
    return out


def _module(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4),
                               torch.nn.Linear(4, 2))


def broadcast_state():
    r = kf.rank()
    m = _module(seed=r)
    m(torch.randn(6, 3))  # BatchNorm's running stats and counter now differ per rank too
    before = {k: _back(v) for k, v in m.state_dict().items()}
    kf.broadcast_parameters(m.state_dict())
    after = {k: _back(v) for k, v in m.state_dict().items()}
    return before, after


# --- training -------------------------------------------------------------------------------

def data(n_workers: int, per_worker: int = 8):
    """A regression problem; worker r's shard is rows r*per_worker ... (r+1)*per_worker - 1."""
    rng = np.random.default_rng(7)
    x = rng.normal(size=(n_workers * per_worker, 5))
    y = np.sin(x @ rng.normal(size=(5, 1)))
    return torch.from_numpy(x), torch.from_numpy(y)


def mlp(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(),
                               torch.nn.Linear(8, 1)).double()


def train_reference(n_workers: int, steps: int, momentum: float):
    """One process trained on the concatenated batch, from rank 0's initial weights."""
    model = mlp(seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum)
    x, y = data(n_workers)
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return [p.detach().numpy().copy() for p in model.parameters()]


def train(kind: str, steps: int, momentum: float, **options):
    r, n = kf.rank(), kf.size()
    model = mlp(seed=r)  # different initial weights per rank: the broadcast must fix them
    kf.broadcast_parameters(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum)
    wrap = {"sgd": kf.optimizers.SynchronousSGDOptimizer,
            "sma": kf.optimizers.SynchronousAveragingOptimizer}[kind]
    opt = wrap(opt, named_parameters=model.named_parameters(), **options)
    x, y = data(n)
    shard = slice(r * 8, (r + 1) * 8)
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x[shard]), y[shard]).backward()
        opt.step()
    return [p.detach().numpy().copy() for p in model.parameters()]


def partial_grads(bucket_bytes=None):
    """Parameter `a` is used everywhere, `b` only on rank 0, `c` nowhere."""
    r, n = kf.rank(), kf.size()
    torch.manual_seed(0)
    a, b, c = (torch.nn.Linear(2, 2).double() for _ in range(3))
    named = [(f"{k}.{n_}", p) for k, m in zip("abc", (a, b, c)) for n_, p in m.named_parameters()]
    opt = kf.optimizers.SynchronousSGDOptimizer(
        torch.optim.SGD([p for _, p in named], lr=1.0, weight_decay=0.5), named,
        **({} if bucket_bytes is None else {"bucket_bytes": bucket_bytes}))
    x = torch.ones(1, 2, dtype=torch.float64) * (r + 1)
    loss = a(x).sum() + (b(x).sum() if r == 0 else 0)
    loss.backward()
    local_b = b.weight.grad.clone() if r == 0 else None
    c_before = c.weight.detach().clone()
    opt.step()
    return {"a": _back(a.weight.grad), "b": _back(b.weight.grad),
            "b local": None if local_b is None else _back(local_b),
            "c grad": c.weight.grad, "c changed": not torch.equal(c.weight, c_before), "n": n}


def mismatched_model(where: str):
    """Rank 1 has one layer more: wrapping the optimizer (or broadcasting) must fail on every
    rank, naming the difference, instead of waiting on names the others never use."""
    layers = [torch.nn.Linear(3, 3)] + ([torch.nn.Linear(3, 3)] if kf.rank() == 1 else [])
    model = torch.nn.Sequential(*layers)
    try:
        if where == "optimizer":
            kf.optimizers.SynchronousSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                                  model.named_parameters())
        else:
            kf.broadcast_parameters(model.state_dict())
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def pair_averaging(lr: float, steps: int):
    """Every rank starts from its own weights (no broadcast) and pair-averages `steps` times
    with learning rate `lr`; returns the initial and final weights and the losses over the
    whole data set (before training, then after each step)."""
    r, n = kf.rank(), kf.size()
    model = mlp(seed=r)
    initial = [p.detach().numpy().copy() for p in model.parameters()]
    opt = kf.optimizers.PairAveragingOptimizer(torch.optim.SGD(model.parameters(), lr=lr),
                                               model.named_parameters())
    x, y = data(n)
    shard = slice(r * 8, (r + 1) * 8)
    with torch.no_grad():  # before any step: each worker's own initial model
        losses = [float(torch.nn.functional.mse_loss(model(x), y))]
    for step in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x[shard]), y[shard])
        loss.backward()
        opt.step()
        losses.append(float(torch.nn.functional.mse_loss(model(x), y)))
        if step % 5 == 4:
            # The steps take microseconds: on a busy machine one worker could take all of them
            # while the other is descheduled, averaging with the same stale model every time.
            # Within five steps of each other they still average asynchronously.
            kf.all_reduce(torch.zeros(1), name=f"pace-{step}")
    kf.all_reduce(torch.zeros(1), name="done")  # no worker leaves while others may fetch
    return initial, [p.detach().numpy().copy() for p in model.parameters()], losses
