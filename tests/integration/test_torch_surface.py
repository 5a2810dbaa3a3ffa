"""kungfu.torch beyond KungFu's own calls, in real workers at np 2 and 3 (one spawn per size for
the collectives, one for the optimizers): process sets, reduce_scatter, all_to_all, the grouped
and async calls, prescale/postscale factors, all_gather of different first dimensions, the
collectives' gradients (Horovod's conventions), SynchronousSGDOptimizer in a process set and
over several backward passes, broadcast_optimizer_state. Every value is computed here from the
inputs in _w_torch_surface.py."""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch", reason="kungfu.torch needs torch (pip install kungfu[torch])")

import torch  # noqa: E402

import _w_torch_surface as W  # noqa: E402

pytestmark = pytest.mark.timeout(240)
NPS = [2, 3]
ENV = {"KUNGFU_OP_TIMEOUT": "30s"}


@pytest.fixture(scope="module")
def runs(session_spawn):
    cache = {}

    def get(body, n):
        if (body, n) not in cache:
            cache[body, n] = session_spawn(n, getattr(W, body), env=ENV, timeout=150)
        return cache[body, n]
    return get


def _parts(rows: int, m: int) -> list:
    return [rows // m + (1 if j < rows % m else 0) for j in range(m)]


def _mine(full: np.ndarray, me: int, m: int) -> np.ndarray:
    parts = _parts(full.shape[0], m)
    return full[sum(parts[:me]):sum(parts[:me]) + parts[me]]


def _owner(rows: int, m: int) -> list:
    """The set rank whose reduce_scatter part holds each row."""
    return [j for j, c in enumerate(_parts(rows, m)) for _ in range(c)]


def expected_values(ranks: list, r: int) -> dict:
    m, me = len(ranks), ranks.index(r)
    xs = [W.x_of(k) for k in ranks]
    total, peak = sum(xs), np.max(xs, axis=0)
    concat = np.concatenate([W.x_of(k)[:W.gather_rows(k)] for k in ranks])
    a2a = np.concatenate([W.a2a_rows(j, m)[sum(W.a2a_splits(j, m)[:me]):][
        :W.a2a_splits(j, m)[me]] for j in range(m)])
    int_total = sum(np.trunc((x - 17) * 0.37) for x in xs)  # each worker's product, truncated
    return {
        "int scaled": np.trunc(int_total * 2.5), "half scaled": 0.5 * total,
        "rs int scaled": _mine(np.trunc(int_total * 2.5), me, m),
        "sum": total, "avg": total / m, "scaled": 1.5 * total, "scaled avg": 0.5 * total / m,
        "async max": peak, "group": [total / m, total[0] / m],
        "group async": [total, 2 * total[0]],
        "gather stack": np.stack(xs), "gather concat": concat, "gather async": concat,
        "group gather": [np.concatenate(xs), concat],
        "broadcast": xs[-1],
        "rs sum": _mine(total, me, m), "rs avg": _mine(total / m, me, m),
        "rs async max": _mine(peak, me, m),
        "group rs": [_mine(total, me, m), _mine(2 * total, me, m)],
        "a2a": a2a, "a2a received": [W.a2a_splits(j, m)[me] for j in range(m)],
        "a2a async": np.array([[me + 10.0 * j] * 2 for j in range(m)]),
    }


def expected_grads(ranks: list, r: int) -> dict:
    m, me = len(ranks), ranks.index(r)
    c = np.array([W.c_of(k) for k in ranks])
    ones = np.ones((5, 2))
    gathered = np.zeros((5, 2))
    gathered[:W.gather_rows(r)] = c.mean()
    owner = c[_owner(5, m)][:, None] * ones
    return {
        "ar": c.sum() * ones, "ar avg": c.mean() * ones, "ar scaled": 6 * c.sum() * ones,
        "group": c.sum() * (1 + 2 * W.x_of(r)),
        # Horovod's: the average of the incoming gradients, on the root only
        "broadcast": c.mean() * ones if me == m - 1 else 0 * ones,
        # Horovod's: the average of the incoming gradients, this worker's rows
        "gather stack": c.mean() * ones, "gather concat": gathered,
        # Horovod's: the gathered gradients, times the size for a sum
        "rs sum": m * owner, "rs avg": owner, "rs scaled": 3 * m * owner,
        "a2a": np.repeat(c, W.a2a_splits(me, m))[:, None] * np.ones((1, 2)),
    }


def _close(got, want, what):
    if isinstance(want, list) and want and isinstance(want[0], np.ndarray):
        assert len(got) == len(want), what
        for g, w in zip(got, want):
            _close(g, w, what)
    elif isinstance(want, list):
        assert got == want, (what, got, want)
    else:
        assert np.shape(got) == np.shape(want), (what, np.shape(got), np.shape(want))
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12, err_msg=str(what))


def each_member(results, n):
    """(set key, its members, a member's rank, that member's results), for every set; a
    worker outside a set has no results for it."""
    for key, ranks in W.sets_for(n).items():
        members = list(range(n)) if ranks is None else ranks
        for res in results:
            assert (key in res) == (res["rank"] in members), (res["rank"], key)
            if key in res:
                yield key, members, res["rank"], res[key]


# (what the worker returned, its expected values, a call that must fail, words of its error)
PARTS = {
    "collectives": ("values", expected_values, "bool factor",
                    ("InvalidArgumentError", "prescale_factor needs a tensor of numbers, got "
                     "torch.bool")),
    # broadcast, all_gather and reduce_scatter differ from the true gradients of a summed loss
    "horovods-gradients": ("grads", expected_grads, "min", ("RuntimeError", "no gradient")),
}


@pytest.mark.parametrize("part", PARTS)
@pytest.mark.parametrize("n", NPS)
def test_in_the_cluster_and_in_process_sets(runs, n, part):
    key_in_result, expected, failing, words = PARTS[part]
    for key, members, r, res in each_member(runs("surface", n), n):
        got = res[key_in_result]
        for name, want in expected(members, r).items():
            _close(got[name], want, (key, r, name))
        assert all(w in got[failing] for w in words), (key, r, got[failing])


def reference(ranks: list, steps: int, lr: float, momentum: float = 0.9) -> list:
    """One process trained on the members' concatenated shards (equal sizes: the mean of their
    gradients is the gradient of the concatenation)."""
    model = W.mlp()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    x = torch.cat([W.shard(k)[0] for k in ranks])
    y = torch.cat([W.shard(k)[1] for k in ranks])
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return [p.detach().numpy() for p in model.parameters()]


def sparse_reference(n: int, steps: int = 2) -> list:
    """The embedding model of one process (dense gradients) on every worker's batch."""
    model = W.embedding_model()
    model[0].sparse = False
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    x = torch.cat([W.ids(k) for k in range(n)])
    for _ in range(steps):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    return [p.detach().numpy() for p in model.parameters()]


def sparse_adam_reference(n: int, steps: int = 2) -> list:
    """The embedding alone with SparseAdam in one process, on every worker's batch."""
    table = W.embedding_model()[0]
    opt = torch.optim.SparseAdam(table.parameters(), 0.1)
    x = torch.cat([W.ids(k) for k in range(n)])
    for _ in range(steps):
        opt.zero_grad()
        table(x).square().mean().backward()
        opt.step()
    return [table.weight.detach().numpy()]


def _trained(results, key, want, rtol=1e-9, atol=1e-12):
    for res in results:
        if key not in res:
            continue
        for got, first, w in zip(res[key], results[-1][key], want):
            assert got.tobytes() == first.tobytes(), key  # bit-identical on every member
            np.testing.assert_allclose(got, w, rtol=rtol, atol=atol, err_msg=key)


@pytest.mark.parametrize("n", NPS)
def test_optimizer_passes_sets_and_state(runs, n):
    results = runs("optimizers", n)
    everyone, tail = list(range(n)), W.sets_for(n)["tail"]
    _trained(results, "one pass", reference(everyone, 3, 0.1))
    # 2 passes of half the shard, averaged: the step of the whole shard
    _trained(results, "two averaged", reference(everyone, 3, 0.1))
    _trained(results, "predivided", reference(everyone, 3, 0.1))  # the same average
    # summed (Horovod's): twice the gradient, so plain momentum SGD at twice the rate
    _trained(results, "two summed", reference(everyone, 3, 0.2))
    _trained(results, "tail", reference(tail, 3, 0.1))
    # fp16 compression: the same on every worker, within float16's precision of the exact step
    _trained(results, "fp16", reference(everyone, 3, 0.1), rtol=2e-3, atol=2e-3)
    _trained(results, "fp16 predivided", reference(everyone, 3, 0.1), rtol=2e-3, atol=2e-3)
    assert any(a.tobytes() != b.tobytes() for a, b in zip(results[0]["fp16"],
                                                        results[0]["one pass"]))
    _trained(results, "sparse", sparse_reference(n))
    # named_parameters must name every parameter, each name once (Horovod's checks)
    assert results[0]["duplicate names"] == (
        "ValueError: named_parameters names two parameters 'same': give each its own name (a "
        "prefix per model, say)")
    assert results[0]["partial names"].startswith(
        "ValueError: named_parameters does not name 2 of the optimizer's parameters (group0.2, "
        "group0.3)"), results[0]["partial names"]
    # step() after synchronize(): Horovod's warning, and the sums are not summed again
    for res in results:
        after = res["step after synchronize"]
        assert after["warnings skip"] == []
        assert len(after["warnings plain"]) == 1
        assert ("optimizer.step() called without optimizer.skip_synchronize() after "
                "optimizer.synchronize()") in after["warnings plain"][0]
        for a, b in zip(after["plain"], after["skip"]):
            assert a.tobytes() == b.tobytes()
    # sparse_as_dense=False: the rows gathered, the same steps, .grad sparse; SparseAdam
    rows = [res["sparse rows"] for res in results]
    _trained(rows, "sgd", sparse_reference(n))
    assert all(r["still sparse"] for r in rows)
    _trained(rows, "sparse adam", sparse_adam_reference(n))
    assert rows[0]["max"] == ("ValueError: sparse_as_dense=False gathers sparse rows: op must "
                              "be 'avg' or 'sum', got 'max'")
    # AMP: rank 0 overflowed in the first step; every worker skipped it and halved its scale,
    # then took the two steps of one process (float32)
    amp = reference(everyone, 2, 0.1, momentum=0.0)
    for res in results:
        assert res["amp"]["scales"] == [512.0, 512.0, 512.0], res["amp"]["scales"]
        for got, first, want in zip(res["amp"]["weights"], results[0]["amp"]["weights"], amp):
            assert got.tobytes() == first.tobytes()
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    assert not np.allclose(reference(everyone, 3, 0.1)[0], reference(everyone, 3, 0.2)[0])
    root = results[n - 1]["state"]["before"]
    for res in results:
        r = res["rank"]
        assert "RuntimeError" in res["too many"] and "backward_passes_per_step=2" in \
            res["too many"], res["too many"]
        assert res["bad compression"].startswith("ValueError") and "'int8'" in \
            res["bad compression"], res["bad compression"]
        assert res["predivided sum"].startswith("ValueError") and "op='sum'" in \
            res["predivided sum"], res["predivided sum"]
        before, after = res["state"]["before"], res["state"]["after"]
        assert before["lr"] == pytest.approx(0.01 * (r + 1))
        assert after["lr"] == root["lr"] and after["tensors"].keys() == root["tensors"].keys()
        for k, v in root["tensors"].items():
            np.testing.assert_array_equal(after["tensors"][k], v, err_msg=k)
        assert ("tail state" in res) == (r in tail)
        if r in tail:
            first = results[tail[0]]["tail state"]["before"]
            assert res["tail state"]["after"]["lr"] == first["lr"]
            for k, v in first["tensors"].items():
                np.testing.assert_array_equal(res["tail state"]["after"]["tensors"][k], v)
    # the states did differ: rank 0 stepped once, the root n times
    assert not np.array_equal(results[0]["state"]["before"]["tensors"]["0/exp_avg"],
                              root["tensors"]["0/exp_avg"])
