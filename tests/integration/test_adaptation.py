"""Mechanisms of adaptation, in real processes: per-worker batch sizes (kf.set_batch_sizes) and
per-worker compute times shared at every step."""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("tensorflow")

import _w_adapt as w  # noqa: E402

ENV = {"TF_CPP_MIN_LOG_LEVEL": "3"}


@pytest.mark.parametrize("sizes,monitors", [([1, 7], ["gns"]), ([2, 3, 7], ["gns", "variance"])],
                         ids=["np2", "np3"])
def test_an_uneven_split_trains_on_the_mean_gradient_of_the_union_batch(spawn, sizes, monitors):
    n = len(sizes)
    results = spawn(n, w.uneven_split, sizes, monitors, env=ENV, timeout=150)
    for rank, r in enumerate(results):
        # Bad splits were refused on every worker, by name, before the good one.
        assert len(r["errors"]) == 6, r["errors"]
        assert "the cluster has" in r["errors"][0] and "sum to" in r["errors"][4]
        assert "positive integer" in r["errors"][2] and "positive integer" in r["errors"][3]
        assert r["before"] == [sum(sizes) // n] * n
        assert r["batch_sizes"] == sizes and r["local"] == sizes[rank]
        assert r["global"] == sum(sizes)
        assert len(r["served"]) == sizes[rank]
        # One SGD step (lr 1) with the averaged gradient is the step on the union batch.
        for got, want in zip(r["after"], r["expected"]):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        # Every worker's compute time and part size of the step, in rank order.
        assert r["part_sizes"] == sizes
        assert len(r["compute_times"]) == n and all(t > 0 for t in r["compute_times"])
        assert r["compute_times"] == results[0]["compute_times"]
    served = sorted(i for r in results for i in r["served"])
    assert served == list(range(sum(sizes)))  # every sample of the step once
    # The gradient noise scale's statistics use each worker's own mean gradient and batch size
    # (the sample weights that make the average exact are taken out again), and the average's
    # noise is that of the union batch: 1/B_big = 1/sum(sizes), not mean(1/B_i)/n as for an
    # unweighted average. The noise scale alone reduces them alongside the gradients, without
    # the spread around the average (NaN).
    g = np.array([r["own_grad"] for r in results])
    union = np.array(results[0]["union_grad"])
    spread = np.mean(np.sum((g - union) ** 2, axis=1)) if "variance" in monitors else np.nan
    want = [np.mean(np.sum(g * g, axis=1)), union @ union, spread,
            np.mean([1 / b for b in sizes]), n, 1 / sum(sizes)]
    for r in results:
        np.testing.assert_allclose(r["stats"], want, rtol=1e-4)
    # The step's noise-scale sample, from the two batch sizes B_small = 1/mean(1/B_i) and
    # B_big = sum(sizes) (the one step sets the EMAs; NaN where |G|^2 comes out <= 0).
    small, big, b_small, b_big = want[0], want[1], 1 / want[3], sum(sizes)
    g2 = (b_big * big - b_small * small) / (b_big - b_small)
    trace = (small - big) / (1 / b_small - 1 / b_big)
    expected = trace / g2 if g2 > 0 else np.nan
    for r in results:
        assert r["gns"] == pytest.approx(expected, rel=1e-4, nan_ok=True), (r["gns"], expected)


def test_policies_compose_in_one_hook_under_an_emulated_straggler(spawn):
    """LB-BSP, momentum compensation and a batch doubling in one Hook, with worker 1 three
    times slower per sample (emulated): the split moves to about 3:1, the doubling ramps the
    learning rate over 4 steps, and LB-BSP balances the doubled batch again."""
    env = dict(ENV, KUNGFU_SAMPLE_TIME="0.002", KUNGFU_SLOWDOWN="1:3")
    r0, r1 = spawn(2, w.composed, 24, 44, env=env, timeout=200)
    assert r0 == r1  # the same decisions and measurements on both workers
    trace = {row["step"]: row for row in r0["trace"]}
    before = trace[24]["sizes"]
    assert sum(before) == 32 and before[1] == pytest.approx(8, abs=2), r0["decisions"]
    # The doubling is applied at step 24's agreement: 64 in all, the split undone.
    assert trace[25]["sizes"] == [32, 32]
    lrs = [trace[s]["lr"] for s in range(24, 31)]
    np.testing.assert_allclose(lrs, [0.01, 0.01, 0.0125, 0.015, 0.0175, 0.02, 0.02])
    after = trace[44]["sizes"]
    assert sum(after) == 64 and after[1] == pytest.approx(16, abs=3), r0["decisions"]
    # Measured compute: worker 1 took about 3x as long before the split moved (step 4's, seen
    # at step 5), about as long as worker 0 once it moved.
    t0, t1 = trace[5]["times"]
    assert trace[4]["sizes"] == [16, 16] and 1.8 < t1 / t0 < 4.0, trace[5]
    t0, t1 = trace[24]["times"]
    assert 0.6 < t1 / t0 < 1.6, trace[24]
