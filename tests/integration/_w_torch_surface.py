"""Worker bodies for test_torch_surface.py: kungfu.torch's process sets, reduce_scatter,
all_to_all, grouped and async calls, factors, the collectives' gradients, the optimizer in a
process set and over several backward passes, and broadcast_optimizer_state. Each body returns
raw values (numpy); the tests compute what they must be from the inputs below."""
from __future__ import annotations

import contextlib

import numpy as np
import torch

import kungfu.torch as kf


# -- inputs (pure numpy, shared with the tests) -------------------------------------------------

def sets_for(n: int) -> dict:
    """None: the whole cluster; "ends": the first and the last rank; "tail": all but rank 0
    (at np 2 a set of one)."""
    return {"all": None, "ends": [0, n - 1], "tail": list(range(1, n))}


def x_of(r: int) -> np.ndarray:
    return np.arange(10, dtype=np.float64).reshape(5, 2) + 10 * r


def c_of(r: int) -> float:
    """Worker r's weight on its loss: the gradients tell the workers apart."""
    return float(r + 1)


def gather_rows(r: int) -> int:
    return r % 3 + 1


def a2a_splits(me: int, m: int) -> list:
    """Set rank me's splits among m workers: uneven, some zero."""
    return [(me + j) % 3 for j in range(m)]


def a2a_rows(me: int, m: int) -> np.ndarray:
    """The rows set rank me sends: those for set rank j hold (100 me + j, their index)."""
    rows = [[100 * me + j, i] for j, c in enumerate(a2a_splits(me, m)) for i in range(c)]
    return np.array(rows, np.float64).reshape(-1, 2)


# -- workers ------------------------------------------------------------------------------------

def _np(t) -> np.ndarray:
    return t.detach().to(torch.float64).numpy().copy()


def _error(fn) -> str:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the message is the result
        return f"{type(e).__name__}: {e}"
    return "no error"


def _values(ps, r: int, me: int, m: int) -> dict:
    x = torch.from_numpy(x_of(r))
    scaled = x.clone()
    kf.all_reduce(scaled, "sum", name="scaled", process_set=ps, prescale_factor=0.5,
                  postscale_factor=3.0)
    grouped = [x.clone(), x[0].clone() * 2]
    kf.group_all_reduce_async(grouped, "sum", name="grp-async", process_set=ps).wait()
    out, received = kf.all_to_all(torch.from_numpy(a2a_rows(me, m)), a2a_splits(me, m),
                                  name="a2a", process_set=ps, with_splits=True)
    even = torch.from_numpy(np.repeat(np.arange(m, dtype=np.float64)[:, None], 2, 1) + me * 10)
    return {
        "sum": _np(kf.all_reduce_fn(x, "sum", name="sum", process_set=ps)),
        "avg": _np(kf.all_reduce_fn(x, "avg", name="avg", process_set=ps)),
        "scaled": _np(scaled),
        "scaled avg": _np(kf.all_reduce_fn(x, "avg", name="scaled-avg", process_set=ps,
                                           prescale_factor=2.0, postscale_factor=0.25)),
        # Horovod's integer scaling: in float64, each product cast back toward zero
        "int scaled": _np(kf.all_reduce_fn(x.to(torch.int32) - 17, "sum", name="int-scaled",
                                           process_set=ps, prescale_factor=0.37,
                                           postscale_factor=2.5)),
        "half scaled": _np(kf.all_reduce_fn(x.to(torch.float16), "sum", name="half-scaled",
                                            process_set=ps, prescale_factor=0.5)),
        "rs int scaled": _np(kf.reduce_scatter(x.to(torch.int64) - 17, "sum", name="rs-int",
                                               process_set=ps, prescale_factor=0.37,
                                               postscale_factor=2.5)),
        "async max": _np(kf.all_reduce_async(x.to(torch.int64).clone(), "max", name="amax",
                                             process_set=ps).wait()),
        "group": [_np(t) for t in kf.group_all_reduce([x, x[0]], "avg", name="grp",
                                                      process_set=ps)],
        "group async": [_np(t) for t in grouped],
        "gather stack": _np(kf.all_gather(x, name="ags", process_set=ps)),
        "gather concat": _np(kf.all_gather(x[:gather_rows(r)], name="agc", process_set=ps,
                                           stack=False)),
        "gather async": _np(kf.all_gather_async(x[:gather_rows(r)], name="aga", process_set=ps,
                                                stack=False).wait()),
        "group gather": [_np(t) for t in kf.group_all_gather(
            [x, x[:gather_rows(r)]], name="grp-ag", process_set=ps, stack=False)],
        "broadcast": _np(kf.broadcast(x, root=m - 1, name="bc", process_set=ps)),
        "rs sum": _np(kf.reduce_scatter(x, "sum", name="rss", process_set=ps)),
        "rs avg": _np(kf.reduce_scatter(x, "avg", name="rsa", process_set=ps)),
        "rs async max": _np(kf.reduce_scatter_async(x, "max", name="rsm", process_set=ps).wait()),
        "group rs": [_np(t) for t in kf.group_reduce_scatter([x, x * 2], "sum", name="grp-rs",
                                                             process_set=ps)],
        "a2a": _np(out), "a2a received": received.tolist(),
        "a2a async": _np(kf.all_to_all_async(even, name="a2a-even", process_set=ps).wait()),
        "bool factor": _error(lambda: kf.all_reduce_fn(x > 3, "max", name="bfac",
                                                      process_set=ps, prescale_factor=2.0)),
    }


def _grads(ps, r: int, me: int, m: int) -> dict:
    """d/dv of c_r * sum(collective(v)) for each collective: Horovod's gradients."""
    c = c_of(r)
    v0 = torch.from_numpy(x_of(r))

    def grad(f, start=v0):
        v = start.clone().requires_grad_(True)
        out = f(v)
        (c * sum(o.sum() for o in (out if isinstance(out, list) else [out]))).backward()
        return _np(v.grad)

    a2a_v = torch.from_numpy(a2a_rows(me, m))
    return {
        "ar": grad(lambda v: kf.all_reduce_fn(v, "sum", name="g-ar", process_set=ps)),
        "ar avg": grad(lambda v: kf.all_reduce_fn(v, "avg", name="g-avg", process_set=ps)),
        "ar scaled": grad(lambda v: kf.all_reduce_fn(v, "sum", name="g-ars", process_set=ps,
                                                     prescale_factor=2.0, postscale_factor=3.0)),
        "group": grad(lambda v: kf.group_all_reduce([v, v * v], name="g-grp", process_set=ps)),
        "broadcast": grad(lambda v: kf.broadcast(v, root=m - 1, name="g-bc", process_set=ps)),
        "gather stack": grad(lambda v: kf.all_gather(v, name="g-ags", process_set=ps)),
        "gather concat": grad(lambda v: kf.all_gather(v[:gather_rows(r)], name="g-agc",
                                                      process_set=ps, stack=False)),
        "rs sum": grad(lambda v: kf.reduce_scatter(v, "sum", name="g-rss", process_set=ps)),
        "rs avg": grad(lambda v: kf.reduce_scatter(v, "avg", name="g-rsa", process_set=ps)),
        "rs scaled": grad(lambda v: kf.group_reduce_scatter(
            [v], "sum", name="g-rsf", process_set=ps, prescale_factor=2.0,
            postscale_factor=1.5)),
        "a2a": grad(lambda v: kf.all_to_all(v, a2a_splits(me, m), name="g-a2a",
                                            process_set=ps), a2a_v),
        "min": _error(lambda: (c * kf.all_reduce_fn(v0.clone().requires_grad_(True), "min",
                                                    name="g-min", process_set=ps).sum())
                      .backward()),
    }


def surface() -> dict:
    """Every call of _values and _grads, in the whole cluster and in the sets that hold this
    worker (each set's names are its own: sets run in sessions of their own)."""
    r, n = kf.rank(), kf.size()
    out = {"rank": r}
    for key, ranks in sets_for(n).items():
        ps = None if ranks is None else kf.ProcessSet(ranks)
        members = list(range(n)) if ranks is None else ranks
        if r not in members:
            continue
        me, m = members.index(r), len(members)
        out[key] = {"values": _values(ps, r, me, m), "grads": _grads(ps, r, me, m)}
    return out


# -- optimizers ---------------------------------------------------------------------------------

def shard(r: int, rows: int = 8):
    """Worker r's batch of a regression problem (the same formula in the test's reference)."""
    rng = np.random.default_rng(11 + r)
    x = rng.normal(size=(rows, 5))
    return torch.from_numpy(x), torch.from_numpy(np.sin(x.sum(1, keepdims=True)))


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(),
                               torch.nn.Linear(8, 1)).double()


def train(ps, steps: int, passes: int, average: bool, **options) -> list:
    """SGD with momentum over `steps` steps of `passes` backward passes each (this worker's
    shard split into `passes` equal parts), in process set ps."""
    r = kf.rank()
    model = mlp()
    opt = kf.optimizers.SynchronousSGDOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model.named_parameters(),
        process_set=ps, backward_passes_per_step=passes, average_aggregated_gradients=average,
        **options)
    x, y = shard(r)
    for _ in range(steps):
        opt.zero_grad()
        for xs, ys in zip(x.chunk(passes), y.chunk(passes)):
            torch.nn.functional.mse_loss(model(xs), ys).backward()
        opt.step()
    return [_np(p) for p in model.parameters()]


def embedding_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(10, 3, sparse=True), torch.nn.Flatten(),
                               torch.nn.Linear(6, 1)).double()


def ids(r: int) -> torch.Tensor:
    """Worker r's batch of index pairs (rows of the embedding it touches)."""
    return torch.tensor([[r, r + 1], [r + 2, 0], [7, r]])


def _partially_named():
    model = mlp()
    return kf.optimizers.SynchronousSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                                 model[0].named_parameters())


def step_after_synchronize() -> dict:
    """op="sum": synchronize() then step(), with and without skip_synchronize() (the warning,
    and the same step: the sums are not summed again)."""
    import warnings

    out = {}
    for skip in (True, False):
        model = mlp()
        opt = kf.optimizers.SynchronousSGDOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(), op="sum")
        x, y = shard(kf.rank())
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with opt.skip_synchronize() if skip else contextlib.nullcontext():
                opt.step()
        out["skip" if skip else "plain"] = [_np(p) for p in model.parameters()]
        out[f"warnings {'skip' if skip else 'plain'}"] = [str(w.message) for w in caught]
    return out


def sparse_rows_training(steps: int = 2) -> dict:
    """sparse_as_dense=False (Horovod's default): the embedding model with plain SGD, whether
    its gradient stayed sparse, and an embedding alone with torch.optim.SparseAdam."""
    model = embedding_model()
    opt = kf.optimizers.SynchronousSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.5),
                                                model.named_parameters(), sparse_as_dense=False)
    x = ids(kf.rank())
    for _ in range(steps):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    out = {"sgd": [_np(p) for p in model.parameters()],
           "still sparse": model[0].weight.grad.is_sparse}
    table = embedding_model()[0]
    adam = kf.optimizers.SynchronousSGDOptimizer(torch.optim.SparseAdam(table.parameters(), 0.1),
                                                 sparse_as_dense=False)
    for _ in range(steps):
        adam.zero_grad()
        table(x).square().mean().backward()
        adam.step()
    out["sparse adam"] = [_np(table.weight)]
    out["max"] = _error(lambda: kf.optimizers.SynchronousSGDOptimizer(
        torch.optim.SGD(table.parameters(), lr=0.1), op="max", sparse_as_dense=False))
    return out


def sparse_training(steps: int = 2) -> list:
    """An embedding with sparse gradients, trained with plain SGD."""
    model = embedding_model()
    opt = kf.optimizers.SynchronousSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.5),
                                                model.named_parameters())
    x = ids(kf.rank())
    for _ in range(steps):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    return [_np(p) for p in model.parameters()]


def amp_training(steps: int = 3) -> dict:
    """torch.amp.GradScaler in Horovod's recipe (synchronize, unscale_, step without a second
    synchronize). Rank 0's first loss overflows: every worker must skip that step."""
    r = kf.rank()
    model = mlp().float()
    opt = kf.optimizers.SynchronousSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                                model.named_parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    x, y = (t.float() for t in shard(r))
    scales = []
    for step in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y) * (1e38 if (r, step) == (0, 0) else 1)
        scaler.scale(loss).backward()
        opt.synchronize()
        scaler.unscale_(opt)
        with opt.skip_synchronize():
            scaler.step(opt)
        scaler.update()
        scales.append(float(scaler.get_scale()))
    return {"scales": scales, "weights": [_np(p).astype(np.float32) for p in model.parameters()]}


def _too_many_passes() -> str:
    model = mlp()
    opt = kf.optimizers.SynchronousSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                                model.named_parameters(),
                                                backward_passes_per_step=2)
    x, y = shard(kf.rank())
    return _error(lambda: [torch.nn.functional.mse_loss(model(x), y).backward()
                           for _ in range(3)])


def _optimizer_state(root: int, ps) -> dict:
    """An Adam optimizer whose state and learning rate differ per worker, then root's."""
    r = kf.rank()
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=0.01 * (r + 1))
    x, y = shard(r)
    for _ in range(r + 1):  # a step count of its own, too
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()

    def state():
        sd = opt.state_dict()
        return {"lr": sd["param_groups"][0]["lr"],
                "tensors": {f"{i}/{k}": _np(v) if isinstance(v, torch.Tensor) else v
                            for i, s in sd["state"].items() for k, v in s.items()}}

    before = state()
    kf.broadcast_optimizer_state(opt, root, process_set=ps)
    return {"before": before, "after": state()}


def optimizers() -> dict:
    """The optimizer in the whole cluster and in the "tail" set, over 2 averaged and 2 summed
    passes, with fp16 compression (also predivided), with sparse gradients (dense and as
    rows), with AMP's GradScaler, a step after synchronize(); the errors of a third pass and of
    an unknown compression;
    broadcast_optimizer_state, whole and in "tail"."""
    r, n = kf.rank(), kf.size()
    tail = sets_for(n)["tail"]
    ps = kf.ProcessSet(tail) if r in tail else None
    out = {"rank": r,
           "one pass": train(None, 3, 1, True),
           "two averaged": train(None, 3, 2, True),
           "two summed": train(None, 3, 2, False),
           "fp16": train(None, 3, 1, True, compression=kf.Compression.fp16),
           "predivided": train(None, 3, 1, True, gradient_predivide_factor=4.0),
           "fp16 predivided": train(None, 3, 1, True, compression=kf.Compression.fp16,
                                    gradient_predivide_factor=4.0),
           "sparse": sparse_training(),
           "sparse rows": sparse_rows_training(),
           "step after synchronize": step_after_synchronize(),
           "amp": amp_training(),
           "bad compression": _error(lambda: kf.optimizers.SynchronousSGDOptimizer(
               torch.optim.SGD(mlp().parameters(), lr=0.1), compression="int8")),
           "predivided sum": _error(lambda: kf.optimizers.SynchronousSGDOptimizer(
               torch.optim.SGD(mlp().parameters(), lr=0.1), op="sum",
               gradient_predivide_factor=2.0)),
           "too many": _too_many_passes(),
           "duplicate names": _error(lambda: kf.optimizers.SynchronousSGDOptimizer(
               torch.optim.SGD(mlp().parameters(), lr=0.1),
               [("same", p) for p in mlp().parameters()])),
           "partial names": _error(lambda: _partially_named()),
           "state": _optimizer_state(n - 1, None)}
    if ps is not None:
        out["tail"] = train(ps, 3, 1, True)
        out["tail state"] = _optimizer_state(0, ps)
    return out
