"""SyncBatchNormalization, kf.Optimizer(compression="fp16") and sparse_as_dense=False in real
workers at np 2 and 3, against numpy and against the uncompressed / dense results."""
import numpy as np
import pytest

import _w_training_surface as W
from _w_in_turn import in_turn

pytestmark = pytest.mark.timeout(240)
NPS = [2, 3]
ENV = {"TF_CPP_MIN_LOG_LEVEL": "2", "KUNGFU_OP_TIMEOUT": "60s"}
BODIES = ["sync_batch_norm", "compression", "sparse_gradients"]


@pytest.fixture(scope="module")
def surface(session_spawn):
    """surface(n, body): every rank's result of _w_training_surface's `body` on n workers. The
    three bodies run one after the other in one spawn per n (each builds its own model)."""
    cache = {}

    def get(n, body):
        if n not in cache:
            calls = [(f"_w_training_surface:{name}", ()) for name in BODIES]
            cache[n] = session_spawn.run(n, in_turn, calls, env=ENV, timeout=220,
                                         fail_fast=True)
        return [results[BODIES.index(body)] for results in cache[n].check()]

    return get


@pytest.mark.parametrize("n", NPS)
def test_sync_batch_norm_uses_the_cluster_batch(surface, n):
    results = surface(n, "sync_batch_norm")
    everything = np.concatenate([W.bn_input(k) for k in range(n)]).astype(np.float64)
    mean, var = everything.mean(0), everything.var(0)
    for r, res in enumerate(results):
        want = (W.bn_input(r) - mean) / np.sqrt(var + 1e-3)
        assert np.allclose(res["y"], want, atol=1e-4), r
        # momentum 0.5 from mean 0 and variance 1
        assert np.allclose(res["moving_mean"], 0.5 * mean, atol=1e-5), r
        assert np.allclose(res["moving_variance"], 0.5 + 0.5 * var, rtol=1e-4), r
        # inference: the moving statistics, not the batch's
        inf = (W.bn_input(r) - 0.5 * mean) / np.sqrt(0.5 + 0.5 * var + 1e-3)
        assert np.allclose(res["inference"], inf, atol=1e-4), r
    for res in results[1:]:
        for a, b in zip(res["fit_weights"], results[0]["fit_weights"]):
            assert np.array_equal(np.array(a), np.array(b))


@pytest.mark.parametrize("n", NPS)
def test_fp16_compression_is_close_and_the_same_everywhere(surface, n):
    results = surface(n, "compression")
    for res in results:
        assert res["bad"] is not None and "fp16" in res["bad"], res["bad"]
        for full, half, named in zip(res["none"], res["fp16"], res["hvd-name"]):
            full, half = np.array(full), np.array(half)
            assert np.allclose(half, full, rtol=2e-3, atol=1e-4)
            assert np.array_equal(half, np.array(named))
        # Compressed for real: float16 rounding shows in the update.
        assert any(not np.array_equal(np.array(a), np.array(b))
                   for a, b in zip(res["none"], res["fp16"]))
    for res in results[1:]:
        assert res["fp16"] == results[0]["fp16"]


@pytest.mark.parametrize("n", NPS)
def test_sparse_gradients_train_like_dense_ones(surface, n):
    results = surface(n, "sparse_gradients")
    for res in results:
        for s, d in zip(res["sparse"], res["dense"]):
            assert np.allclose(s, d, rtol=1e-6, atol=1e-7)
    for res in results[1:]:
        for a, b in zip(res["sparse"], results[0]["sparse"]):
            assert np.allclose(a, b, rtol=0, atol=0)
