"""Adasum (kf.adasum, kungfu/_adasum.py) in real workers at np 2, 3, 4 and 6 (one spawn per size):
every value is computed here from _w_adasum.py's inputs, by the tree's own recursive statement."""
from __future__ import annotations

import numpy as np
import pytest

import _w_adasum as W

pytestmark = pytest.mark.timeout(120)


def pair(a, b):
    """Adasum of two gradients, written out from the paper's formula."""
    a, b = a.astype(np.float64), b.astype(np.float64)
    dot = np.vdot(a, b)
    ca = 1 - dot / (2 * np.vdot(a, a)) if np.vdot(a, a) > 0 else 1.0
    cb = 1 - dot / (2 * np.vdot(b, b)) if np.vdot(b, b) > 0 else 1.0
    return ca * a + cb * b


def tree(values):
    """The tree over ranks 0..n-1: the first p ranks (p the largest power of two below n) with
    the rest."""
    if len(values) == 1:
        return values[0].astype(np.float64)
    p = 1
    while 2 * p < len(values):
        p *= 2
    return pair(tree(values[:p]), tree(values[p:]))


@pytest.fixture(scope="module")
def runs(session_spawn):
    cache = {}

    def get(n):
        if n not in cache:
            cache[n] = session_spawn(n, W.run, timeout=90)
        return cache[n]
    return get


@pytest.mark.parametrize("n", [2, 3, 4, 6])
def test_adasum_is_the_tree_of_pairwise_adaptive_sums(runs, n):
    grads = [W.grads_of(r) for r in range(n)]
    want = [tree([g[i] for g in grads]) for i in range(2)]  # per tensor, as per layer
    results = runs(n)
    for got in results:
        for i, (t, w) in enumerate(zip(got["grads"], want)):
            assert t.dtype == grads[0][i].dtype and t.shape == grads[0][i].shape
            np.testing.assert_allclose(t, w, rtol=1e-5 if t.dtype == np.float32 else 1e-12)
        # Orthogonal gradients add up; equal ones give themselves (the average); a zero
        # gradient adds nothing.
        np.testing.assert_allclose(got["orthogonal"], np.arange(1.0, n + 1), rtol=1e-12)
        np.testing.assert_allclose(got["same"], np.linspace(-1, 2, 6), rtol=1e-12)
        np.testing.assert_allclose(got["zero"], np.ones(3), rtol=1e-12)
        assert got["half"].dtype == np.float16
        np.testing.assert_allclose(got["half"], tree([np.arange(4.0) + r for r in range(n)]),
                                   rtol=1e-3)
        assert got["integer"] == ["InvalidArgumentError",
                                  "adasum takes floating-point tensors (gradients), got int64"]
        np.testing.assert_array_equal(got["after"], [n, n])
    # Every rank ends with the same bits.
    for got in results[1:]:
        for t, t0 in zip(got["grads"], results[0]["grads"]):
            np.testing.assert_array_equal(t, t0)
    # Not a plain sum or average (the inputs are neither orthogonal nor equal).
    total = sum(g[1] for g in grads)
    assert not np.allclose(results[0]["grads"][1], total)
    assert not np.allclose(results[0]["grads"][1], total / n)


@pytest.mark.parametrize("n", [2, 3])
def test_torch_synchronous_sgd_adasum(runs, n):
    """kungfu.torch's SynchronousSGDOptimizer(op="adasum"): a step of SGD(1) from zeros ends at
    minus the tree's value of each parameter's gradients, on every worker."""
    pytest.importorskip("torch")
    grads = [W.grads_of(r) for r in range(n)]
    want = [tree([g[i] for g in grads]) for i in range(2)]
    for got in runs(n):
        t = got["torch"]
        for w_got, w in zip(t["weights"], want):
            np.testing.assert_allclose(w_got, -w, rtol=1e-5, atol=1e-6)
        assert t["fp16"] == ["ValueError", "op='adasum' combines the gradients as they are, "
                             "over the whole cluster: it takes no compression and no "
                             "process_set"]
        assert t["bad op"][0] == "ValueError" and "'mean'" in t["bad op"][1]
