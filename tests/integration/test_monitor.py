"""Gradient noise scale and gradient variance, in real worker processes, against numpy.

The reference follows the definitions (docs/tensorflow.md, "Monitoring"): with workers i of batch
B_i, local gradients g_i and their average g = mean_i g_i,
  B_small = 1 / mean_i(1/B_i), B_big = n B_small,
  |G|^2 = (B_big |g|^2 - B_small mean_i|g_i|^2) / (B_big - B_small),
  tr(S) = (mean_i|g_i|^2 - |g|^2) / (1/B_small - 1/B_big),
  gns = EMA(tr(S)) / EMA(|G|^2), variance = EMA(mean_i |g_i - g|^2),
where an EMA starts at its first sample and then takes decay * old + (1 - decay) * new.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

pytest.importorskip("tensorflow")

import _w_monitor as w  # noqa: E402
from _w_in_turn import in_turn  # noqa: E402

ENV = {"TF_CPP_MIN_LOG_LEVEL": "3"}


def _ema(old, count, x, decay):
    return x if count == 0 else decay * old + (1 - decay) * x


def reference(per_rank_steps, decay, interval, scales=None):
    """[(gns, variance)] per step, from every worker's gradients, batch sizes and scales: a
    worker's own mean gradient is scale * local, it weighs 1 / (n scale) in the average, and
    one of scale 0 (no samples of its own) is left out of the means."""
    n = len(per_rank_steps)
    scales = scales or [1.0] * n
    s = g2 = var = 0.0
    samples = var_samples = 0
    last = math.nan
    out = []
    for i in range(len(per_rank_steps[0])):
        steps = [r[i] for r in per_rank_steps]
        if i % interval == 0:
            avg = steps[0]["averaged"]
            counted = [(c, st) for c, st in zip(scales, steps) if c > 0]
            own = [c * st["local"] for c, st in counted]
            small = np.mean([g @ g for g in own])
            big = avg @ avg
            spread = np.mean([(g - avg) @ (g - avg) for g in own])
            b_small = 1.0 / np.mean([1.0 / st["batch"] for _, st in counted])
            b_big = 1.0 / sum((1 / (n * c)) ** 2 / st["batch"] for c, st in counted)
            if b_big > b_small:
                G = (b_big * big - b_small * small) / (b_big - b_small)
                S = (small - big) / (1 / b_small - 1 / b_big)
                s, g2 = _ema(s, samples, S, decay), _ema(g2, samples, G, decay)
                samples += 1
                if g2 > 0:
                    last = s / g2
            var = _ema(var, var_samples, spread, decay)
            var_samples += 1
        out.append((last, var if var_samples else math.nan))
    return out


STATS_CASES = [(1, 1, "both", None), (2, 1, "both", None), (3, 2, "both", None),
               (4, 3, "both", [2.0, 0.5, 0.0, 1.0]), (1, 1, "gns", None),
               (3, 2, "gns", [1.0, 0.5, 0.0])]
DECAY, STEPS = 0.7, 7


def _stats_args(interval, monitors, scales) -> tuple:
    chosen = ("gns", "variance") if monitors == "both" else ("gns",)
    return STEPS, DECAY, interval, chosen, scales


# The bodies each world size runs, one after the other in one spawn (each builds its own model;
# none changes a process-wide setting): TensorFlow starts once per size.
PLAN = {n: [("stats_steps", _stats_args(*case[1:])) for case in STATS_CASES if case[0] == n]
        for n in (1, 2, 3, 4)}
PLAN[2] += [("fit_logs", (3, 4)), ("compat_names", ())]


@pytest.fixture(scope="module")
def planned(session_spawn):
    """planned(n, body, args): every rank's result of that call of PLAN[n]."""
    cache = {}

    def get(n, body, args=()):
        if n not in cache:
            calls = [(f"_w_monitor:{name}", a) for name, a in PLAN[n]]
            cache[n] = session_spawn.run(n, in_turn, calls, env=ENV, timeout=240,
                                         fail_fast=True)
        i = PLAN[n].index((body, args))
        return [results[i] for results in cache[n].check()]

    return get


@pytest.mark.timeout(300)
@pytest.mark.parametrize("n,interval,monitors,scales", STATS_CASES)
def test_estimates_match_numpy_reference(planned, n, interval, monitors, scales):
    # "gns" alone takes the other path: its statistics are reduced alongside the gradients
    # (start), |g|^2 comes from the averages afterwards. With scales, the average weighs the
    # workers unequally (as kf.ElasticData's parts), and one has no samples of its own.
    decay = DECAY
    results = planned(n, "stats_steps", _stats_args(interval, monitors, scales))
    assert {step["early"] for r in results for step in r} == {monitors == "gns"}
    # The same averaged gradient everywhere (the reference reads rank 0's).
    for r in results[1:]:
        for a, b in zip(r, results[0]):
            assert np.array_equal(a["averaged"], b["averaged"])
    ref = reference(results, decay, interval, scales)
    for i, (gns, var) in enumerate(ref):
        got = [r[i] for r in results]
        assert [g["ran"] for g in got] == [i % interval == 0] * n
        # Identical on every worker, bit for bit, and through kf.grad_noise_scale/grad_variance.
        assert len({repr((g["gns"], g["variance"])) for g in got}
                   | {repr(g["api"]) for g in got}) == 1
        if monitors == "gns":
            assert math.isnan(got[0]["variance"])
        if n == 1:
            # One worker: no noise scale (NaN, never a division by zero), and no spread.
            assert math.isnan(got[0]["gns"]) and math.isnan(got[0]["api"][0])
            assert var == 0.0
            if monitors == "both":
                assert got[0]["variance"] == 0.0
            continue
        assert got[0]["gns"] == pytest.approx(gns, rel=1e-9), f"step {i}"
        if monitors == "both":
            assert got[0]["variance"] == pytest.approx(var, rel=1e-9), f"step {i}"
        assert var > 0 and gns > 0


@pytest.mark.timeout(300)
@pytest.mark.parametrize("n,passes", [(2, 1), (3, 2)])
def test_noise_scale_of_linear_regression_matches_closed_form(spawn, n, passes):
    # With backward_passes_per_step = 2 each averaged gradient holds 2 x 32 samples: the
    # estimate is of the same noise scale (told 32, it would be half of it).
    d, sigma = 8, 1.0
    true = ((d + 1) * 1.0 + d * sigma ** 2) / 1.0
    results = spawn(n, w.linear_regression, d, sigma, 32, 500, 0.99, passes, env=ENV,
                    timeout=200)
    estimates = {r["estimate"] for r in results}
    assert len(estimates) == 1, estimates
    est = estimates.pop()
    assert abs(est - true) / true < 0.2, (est, true)
    for r in results:
        assert r["api"] == est
        assert r["history"] == [pytest.approx(est)]


@pytest.mark.timeout(300)
def test_mixed_precision_estimates_are_of_the_unscaled_gradients(spawn):
    # Under a LossScaleOptimizer (outside kf.Optimizer, as compile makes it, or inside) the
    # gradients the monitors see carry the loss scale L = 2^15; the estimates must be those of
    # the float32 run at the same point (float16 compute: a few parts in a thousand), not L^2
    # (about 1e9) times them.
    r0, r1 = spawn(2, w.mixed_precision_estimates, env=ENV, timeout=200)
    assert r0 == r1  # the same on both workers
    base = r0["float32"]
    assert base["variance"] > 0 and base["trace"] != 0 and base["scale"] is None
    for order in ("compile", "inner"):
        got = r0[order]
        assert got["wrapper"] == "LossScaleOptimizer" and got["scale"] >= 2 ** 10, got
        for key in ("variance", "trace", "g2"):
            assert got[key] == pytest.approx(base[key], rel=0.05), (order, key, got, base)


@pytest.mark.timeout(300)
def test_keras_logs_carry_the_estimates(planned):
    results = planned(2, "fit_logs", (3, 4))
    r0, r1 = results
    assert r0 == r1  # the same logs on both workers
    batches = r0["batches"]
    assert len(batches) == 12 and r0["iterations"] == 12
    # Monitored at steps 0, 3, 6, 9: four samples of each.
    assert r0["samples"] == (4.0, 4.0)
    for i, b in enumerate(batches):
        assert b["gns"] is not None and b["grad_variance"] is not None
        assert b["grad_variance"] > 0
        if i % 3 != 0:  # unchanged between monitored steps
            assert b["grad_variance"] == batches[i - 1]["grad_variance"]
    assert batches[3]["grad_variance"] != batches[2]["grad_variance"]
    assert r0["history"]["grad_variance"] == [batches[5]["grad_variance"],
                                              batches[11]["grad_variance"]]
    assert r0["history"]["gns"][1] == batches[11]["gns"] or math.isnan(batches[11]["gns"])


@pytest.mark.timeout(200)
def test_kungfu_compatible_names(planned):
    results = planned(2, "compat_names")
    for r in results:
        assert r["gns_opt"] == ("sync-sgd", ("gns",), 2, 0.8, 16.0)
        assert r["var_opt"] == ("sync-sgd", ("variance",))
    assert results[0]["values"] == results[1]["values"]
    # The reference, with both workers' batch of 16 and decay 0.5 over three equal samples.
    small = np.mean([r["local"] @ r["local"] for r in results])
    avg = results[0]["averaged"]
    big = avg @ avg
    G = (32 * big - 16 * small) / 16
    S = (small - big) / (1 / 16 - 1 / 32)
    assert results[0]["values"] == pytest.approx([S / G] * 3, rel=1e-9)


@pytest.mark.timeout(120)
def test_bad_input_is_explained(spawn):
    # A spawn of its own: it checks what a fresh process says (no monitor enabled yet).
    e = spawn(1, w.bad_input, env=ENV, timeout=90)[0]
    assert e["none"].startswith("RuntimeError") and "monitor=['gns']" in e["none"]
    assert e["unknown"].startswith("ValueError") and "'noise'" in e["unknown"]
    assert e["not_a_list"].startswith("TypeError")
    assert e["no_batch"] is None  # kf.Hook learns it (tests/integration/test_keras_habits.py)
    assert e["bad_batch"].startswith("ValueError") and "-2" in e["bad_batch"]
    assert e["bad_interval"].startswith("ValueError") and "monitor_interval" in e["bad_interval"]
    assert e["bad_decay"].startswith("ValueError") and "[0, 1)" in e["bad_decay"]
    assert e["sma"].startswith("TypeError") and "sync-sgd" in e["sma"]
    assert e["lengths"].startswith("ValueError")
    assert "InvalidArgument" in e["sizes"] and "3 elements" in e["sizes"]
    assert "InvalidArgument" in e["zero_batch"] and "batch size" in e["zero_batch"]
    assert e["int_grads"] is not None
    assert e["variance_only_ok"] is None


@pytest.mark.parametrize("settings", [("gns", "variance"), ("variance", "gns")],
                         ids=["gns-variance", "variance-gns"])
def test_monitors_that_differ_between_workers_fail_every_worker(spawn, settings):
    """kf.Optimizer(monitor=["gns"]) on one worker and ["variance"] on the other ran their
    statistics' allreduce under one name and summed different statistics (half the right
    variance, no error). Now every worker fails, naming both settings."""
    results = spawn(2, w.monitors_that_differ, list(settings), timeout=120,
                    env={**ENV, "KUNGFU_MISMATCH_GRACE": "1s", "KUNGFU_OP_TIMEOUT": "30s"})
    for rank, r in enumerate(results):
        err = r["error"]
        assert err, (rank, r)
        assert "monitor/gns'" in err and "monitor/variance'" in err, (rank, err)
