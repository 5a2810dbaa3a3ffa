"""Uneven data with join (Horovod's hvd.join, PyTorch's Join), in real workers at np 2 and 3
(one spawn per size, every check of the numpy core and of kungfu.torch in it) and a joined worker
that dies. Every value is computed here from the inputs in _w_join.py."""
from __future__ import annotations

import numpy as np
import pytest

import _w_join as W

pytestmark = pytest.mark.timeout(240)
ENV = {"KUNGFU_OP_TIMEOUT": "30s", "KUNGFU_MISMATCH_GRACE": "300ms"}

try:
    import torch  # noqa: F401
    HAS_TORCH = True
except ImportError:
    HAS_TORCH = False


@pytest.fixture(scope="module")
def runs(session_spawn):
    cache = {}

    def get(n):
        if n not in cache:
            cache[n] = session_spawn(n, W.uneven, HAS_TORCH, env=ENV, timeout=180)
        return cache[n]
    return get


@pytest.mark.parametrize("n", [2, 3])
def test_horovod_join_allreduce(runs, n):
    # Horovod's test_horovod_join_allreduce: the joined rank counts as zeros, the average is
    # divided by the whole size; join returns the same rank everywhere, not the first joiner.
    for case in range(2 * n):  # each rank joining first, then the same after a warm-up round
        first, others = case % n, [k for k in range(n) if k != case % n]
        for r, got in enumerate(runs(n)):
            h = got["horovod"][case]
            if case >= n:
                np.testing.assert_allclose(h["warm"], sum(W.a_of(k) for k in range(n)) / n)
            assert h["ret"] == max(others)  # they joined together, after their two collectives
            assert h["everywhere"] == [h["ret"]] * n
            if r != first:
                np.testing.assert_allclose(h["a"], sum(W.a_of(k) for k in others) / n, rtol=0)
                # integers: the floor of the exact mean, kungfu's avg (Horovod truncates)
                np.testing.assert_array_equal(h["b"], sum(W.b_of(k) for k in others) // n)


@pytest.mark.parametrize("n", [2, 3])
def test_uneven_epochs(runs, n):
    for r, got in enumerate(runs(n)):
        e = got["epochs"]
        for epoch in (0, 1):
            assert len(e["sums"][epoch]) == W.steps_of(r, n, epoch)
            for step, (s, a) in enumerate(zip(e["sums"][epoch], e["avgs"][epoch])):
                active = [k for k in range(n) if W.steps_of(k, n, epoch) > step]
                total = sum(W.grad_of(k, epoch, step) for k in active)
                np.testing.assert_array_equal(s, total)
                np.testing.assert_allclose(a, total / n, rtol=1e-15)
        # the last to join: the most batches (rank n-1 in epoch 0, rank 0 in epoch 1)
        assert e["rets"] == [n - 1, 0]
        assert e["block"] == n - 1  # everyone joined in the same round: the highest rank
        np.testing.assert_array_equal(e["after"], [n * (n + 1) / 2])
        assert "join() needs the collectives to be issued inside" in got["outside"][1]


@pytest.mark.parametrize("n", [2, 3])
def test_other_collectives_while_joined(runs, n):
    rest = list(range(1, n))
    for r, got in enumerate(runs(n)):
        o = got["others"]
        assert o["ret"] == n - 1 and o["alone ret"] == n - 1
        if r == n - 1:  # every joined rank fails a broadcast from a joined root, none serves it
            assert o["alone broadcast"][0] == "InvalidArgumentError", o["alone broadcast"]
            assert "has joined (it has no more data): broadcast 'bc0b' has the joined rank 0 as " \
                "its root" in o["alone broadcast"][1], o["alone broadcast"]
            np.testing.assert_array_equal(o["alone sum"], W.a_of(r))
        if r == 0:
            continue
        np.testing.assert_array_equal(o["max"], np.max([W.a_of(k) for k in rest], axis=0))
        np.testing.assert_array_equal(o["min"], np.min([W.b_of(k) for k in rest], axis=0))
        np.testing.assert_array_equal(o["allgather"], np.concatenate([W.rows_of(k) for k in rest]))
        np.testing.assert_array_equal(o["broadcast"], W.a_of(1))
        for key, kind in (("broadcast from 0", "broadcast 'bc0'"), ("alltoall", "alltoall 'a2a'")):
            assert o[key][0] == "InvalidArgumentError", o[key]
            assert f"rank 0 has joined (it has no more data): {kind}" in o[key][1], o[key]
        np.testing.assert_array_equal(o["after errors"], sum(W.a_of(k) for k in rest))


@pytest.mark.skipif(not HAS_TORCH, reason="kungfu.torch needs torch")
@pytest.mark.parametrize("n", [2, 3])
def test_torch_optimizer_uneven(runs, n):
    # SynchronousSGDOptimizer, rank r with r + 1 batches: each step averages the gradients of
    # the workers that still have a batch, divided by n (the joined ones count as zeros).
    w, after = W.W0.astype(np.float64), []
    for step in range(n):
        active = [k for k in range(n) if W.torch_steps(k) > step]
        w = w - W.LR * sum(W.batch_of(k, step).sum(0) for k in active) / n
        after.append(w)
    for r, got in enumerate(runs(n)):
        t = got["torch"]
        assert t["ret"] == n - 1 and t["block"] == n - 1
        np.testing.assert_allclose(t["mine"], after[r], rtol=1e-5)
        np.testing.assert_allclose(t["final"], after[-1], rtol=1e-5)
    # Join([model, optimizer]) with momentum: each worker's own weights differ (rank r stopped
    # after r + 1 steps); the block leaves the last joined rank's weights and momentum buffer
    # on every worker.
    w, m, own = W.W0.astype(np.float64), np.zeros(3), []
    for step in range(n):
        active = [k for k in range(n) if W.torch_steps(k) > step]
        m = 0.9 * m + sum(W.batch_of(k, step).sum(0) for k in active) / n
        w = w - W.LR * m
        own.append(w)
    for r, got in enumerate(runs(n)):
        t = got["torch"]
        np.testing.assert_allclose(t["own"], own[r], rtol=1e-5)
        np.testing.assert_allclose(t["synced"], own[-1], rtol=1e-5)
        np.testing.assert_allclose(t["momentum"], m, rtol=1e-5)
        assert t["bad"] == [
            ["TypeError", "Join's joinables are modules and optimizers, got object"],
            ["ValueError", "Join(throw_on_early_termination=True) is not supported: in kungfu's "
                           "Join the workers that still have data go on, the joined ones "
                           "contributing nothing"]]


def test_joined_worker_dies(spawn):
    run = spawn.run(2, W.joined_dies, env=ENV, timeout=90)
    assert run.outcomes[1].returncode == 3, run.outcomes[1].describe()
    o = run.outcomes[0]
    assert o.status == "ok", o.describe()
    assert o.value["error"][0] == "PeerFailedError", o.value
    assert "(rank 1)" in o.value["error"][1], o.value
    if "first" in o.value:  # served before it died: rank 1 counted as zeros
        np.testing.assert_array_equal(o.value["first"], np.ones(3))


@pytest.mark.parametrize("n", [2, 3])
def test_tensorflow(spawn, n):
    """Eager loops, a tf.function traced inside the block and model.fit with kf.JoinCallback."""
    pytest.importorskip("tensorflow")
    run = spawn.run(n, W.tf_uneven, env=ENV, timeout=180)

    def trained(w, steps_of, step0=0):
        """w after the steps of workers with steps_of(k) batches, a joined one adding zeros to
        the average (divided by n)."""
        w, after = w.astype(np.float64), {}
        for step in range(max(steps_of(k) for k in range(n))):
            active = [k for k in range(n) if steps_of(k) > step]
            w = w - W.LR * sum(W.batch_of(k, step0 + step).sum(0) for k in active) / n
            after.update({k: w for k in active})
        return after, w

    eager, _ = trained(W.W0, W.torch_steps)
    _, epoch0 = trained(W.W0, lambda k: W.fit_steps(k, n, 0))
    _, epoch1 = trained(epoch0, lambda k: W.fit_steps(k, n, 1), step0=10)
    _, epoch2 = trained(epoch1, lambda k: W.fit_steps(k, n, 2), step0=20)
    for r, o in enumerate(run.outcomes):
        assert o.status == "ok", o.describe()
        got = o.value
        assert got["ret"] == n - 1 and got["block"] == n - 1
        for key in ("mine", "tape", "traced"):
            np.testing.assert_allclose(got[key], eager[r], rtol=1e-5, err_msg=key)
        # every worker ends each epoch with the model of the rank that joined last
        np.testing.assert_allclose(got["fit"], epoch1, rtol=1e-5)
        assert got["fit last"] == [n - 1, 0]
        np.testing.assert_allclose(got["fit again"], epoch2, rtol=1e-5)
        assert got["fit again last"] == [0]
        # the optimizer's state too (Keras counts its own iterations over data of unknown length)
        assert got["fit iterations"] == run.outcomes[0].value["fit iterations"] >= 2 * n
        assert got["fit loss"] == run.outcomes[0].value["fit loss"]  # combined after the join
        assert got["with hook"][0] == "ValueError"
        assert "kf.JoinCallback cannot run beside kf.Hook" in got["with hook"][1]
    last = run.outcomes[n - 1].value
    np.testing.assert_array_equal(last["max"], W.a_of(n - 1))  # the joined ranks: -inf
    np.testing.assert_array_equal(last["traced alone"], W.a_of(n - 1))  # the joined ones: 0
    for key in ("broadcast", "traced broadcast"):
        assert last[key][0] in ("InvalidArgumentError", "StagingError"), last[key]
        assert "inside kungfu's Join, TensorFlow's collectives are supported only" in last[key][1]
