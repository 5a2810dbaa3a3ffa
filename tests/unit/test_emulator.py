"""The emulated cluster's models (benchmarks/adaptation/_emulator.py) and the calibration's
arithmetic (emulated.py): no processes, no clocks."""
from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import numpy as np
import pytest

HERE = Path(__file__).resolve().parents[2] / "benchmarks" / "adaptation"


def _load(name):
    sys.path.insert(0, str(HERE))
    try:
        spec = importlib.util.spec_from_file_location(f"bench_{name}", HERE / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod  # (dataclasses look their module up)
        spec.loader.exec_module(mod)
        return mod
    finally:
        sys.path.remove(str(HERE))


emu = _load("_emulator")


def test_a_device_step_is_its_fixed_part_plus_its_samples_times_its_slowness():
    d = emu.Device(0.06, 0.002, saturation=48)
    assert d.step_time(64) == pytest.approx(0.06 + 0.128)
    assert d.step_time(64, speed=2.0) == pytest.approx(2 * (0.06 + 0.128))
    # Below the saturation the device is not full: fewer samples take no less time.
    assert d.step_time(16) == d.step_time(48) == pytest.approx(0.06 + 0.096)
    assert d.step_time(0) == 0.0  # an empty part (the end of an epoch) computes nothing
    assert emu.Device.parse("0.0599,0.002673,48") == emu.Device(0.0599, 0.002673, 48)
    assert emu.Device.parse("1,2") == emu.Device(1.0, 2.0, 0)
    with pytest.raises(ValueError):
        emu.Device.parse("1")
    with pytest.raises(ValueError):
        emu.Device(-1, 0)


def test_speeds_change_at_their_step_for_the_worker_that_started_with_that_rank():
    s = emu.Speeds.parse("1:2@30, 1:4@80, 3:1.5")
    assert [s.factor(1, k) for k in (0, 29, 30, 79, 80, 500)] == [1, 1, 2, 2, 4, 4]
    assert s.factor(3, 0) == 1.5
    assert s.factor(0, 100) == 1.0
    assert s.factor(None, 100) == 1.0  # a worker started later (a replacement) is nominal
    assert emu.Speeds.parse("").factor(0, 0) == 1.0
    for bad in ("1", "1:0", "-1:2"):
        with pytest.raises(ValueError):
            emu.Speeds.parse(bad)


def test_the_link_is_a_ring_inside_each_host_then_a_ring_across_hosts():
    link = emu.Link(nbytes=100, intra=10.0, inter=1.0, per_host=4)
    assert link.allreduce_time(1) == 0.0
    assert link.allreduce_time(2) == pytest.approx(2 * 1 / 2 * 100 / 10)  # 10 s
    assert link.allreduce_time(4) == pytest.approx(2 * 3 / 4 * 100 / 10)  # 15 s
    # 8 workers: two full hosts, then 2 (h-1)/h of the bytes between them
    assert link.allreduce_time(8) == pytest.approx(15 + 2 * 1 / 2 * 100 / 1)
    assert link.allreduce_time(16) == pytest.approx(15 + 2 * 3 / 4 * 100 / 1)
    # 5 workers are 2 hosts as well: crossing a host boundary costs the cross-host ring
    assert link.allreduce_time(5) == link.allreduce_time(8)
    with_alpha = emu.Link(100, 10.0, 1.0, 4, alpha=0.5)
    assert with_alpha.allreduce_time(8) == pytest.approx(115 + 2 * 3 * 0.5 + 2 * 1 * 0.5)
    assert emu.Link.parse("1e2,10,1,4") == link
    assert emu.Link.parse("100,10,1,4,0.5") == with_alpha
    for bad in ("100,10,1", "100,10,1,4,0.5,9"):
        with pytest.raises(ValueError, match="NBYTES,INTRA,INTER,PER_HOST"):
            emu.Link.parse(bad)


def test_statistical_efficiency_is_pollux_s_and_progress_counts_base_batch_samples():
    assert emu.efficiency(256, 0.0, 256) == 1.0
    assert emu.efficiency(1024, 256.0, 256) == pytest.approx(512 / 1280)
    # A noise scale far above the batch: a larger batch is almost as good per sample.
    assert emu.efficiency(1024, 1e6, 256) == pytest.approx(1.0, abs=1e-3)
    # No estimate yet (NaN) or a negative one: no gain from the larger batch at all.
    assert emu.efficiency(1024, math.nan, 256) == 0.25
    assert emu.efficiency(1024, -5.0, 256) == 0.25
    p = emu.Progress(base=256, target=1000)
    assert p.add(256, 100.0) == 256
    assert not p.reached
    assert p.add(1024, 256.0) == pytest.approx(1024 * 0.4)
    assert p.done == pytest.approx(665.6)
    p.add(1024, 256.0)
    assert p.reached
    with pytest.raises(ValueError):
        emu.Progress(0, 1)


def test_the_noise_scale_estimator_finds_a_known_noise_scale():
    # Per-sample gradients g = G + noise, noise ~ N(0, sigma^2 I): tr(S) = d sigma^2.
    rng = np.random.default_rng(0)
    d, sigma = 50, 2.0
    G = rng.normal(0, 1, d)
    truth = d * sigma ** 2 / (G @ G)
    est = emu.NoiseScale(decay=0.99)
    b_s, b_b = 8, 64
    for _ in range(2000):
        samples = G + rng.normal(0, sigma, (b_b, d))
        small = samples.reshape(b_b // b_s, b_s, d).mean(axis=1)  # 8 batches of 8
        small_sq = float(np.mean(np.sum(small ** 2, axis=1)))
        big = samples.mean(axis=0)
        est.update(small_sq, b_s, float(big @ big), b_b)
    assert est.value == pytest.approx(truth, rel=0.15)
    assert math.isnan(emu.NoiseScale().value)  # nothing measured yet
    # No second batch size (one worker, one half): nothing is learned from it.
    one = emu.NoiseScale()
    one.update(1.0, 8, 1.0, 8)
    assert math.isnan(one.value)


def test_fit_device_recovers_a_linear_device():
    truth = emu.Device(0.04, 0.0005)
    bs = [16, 32, 64]
    fit = emu.fit_device(bs, [truth.step_time(b) for b in bs])
    assert fit.fixed == pytest.approx(0.04)
    assert fit.per_sample == pytest.approx(0.0005)
    with pytest.raises(ValueError):
        emu.fit_device([16, 16], [0.1, 0.2])


def test_calibration_counts_a_step_by_its_compute_and_its_allreduce():
    driver = _load("emulated")
    rows = [{"step": s, "step_time": 0.050, "cpu": 0.010, "compute": 0.040,
             "compute_times": [0.045, 0.030]} for s in range(1, 12)]
    rows.append({"done": True})
    assert driver.step_median(rows) == pytest.approx(0.050)
    # own: the 40 ms the clock saw for rank 0's compute before the allreduce becomes its 10 ms
    # of CPU; the 10 ms of allreduce, waiting and update stay.
    assert driver.step_median(rows, own=True) == pytest.approx(0.020)
    # the device is fitted to the compute alone (the emulated worker runs the rest for real)
    assert driver.compute_median(rows) == pytest.approx(0.040)
    assert driver.compute_median(rows, own=True) == pytest.approx(0.010)
    rows[6]["step_time"] = 9.0  # one slow step does not move a median
    assert driver.step_median(rows) == pytest.approx(0.050)
    rows[0]["step_time"] = rows[1]["step_time"] = 9.0  # the first steps are left out
    assert driver.step_median(rows) == pytest.approx(0.050)


arb = _load("_arbiter")


def test_the_arbiter_probes_then_moves_workers_to_the_larger_marginal_goodput():
    Curve = arb.Curve
    # Two jobs at 8 and 8, each measured at one size: the first takes 4 from the other (a
    # probe: then both are measured at two sizes).
    move = arb.decide({0: 8, 1: 8}, {0: Curve({8: 2263.0}), 1: Curve({8: 733.0})}, 16, 4)
    assert (move.donor, move.receiver, move.workers, move.why) == (1, 0, 4, "probe")
    # The probe went the wrong way (job 1 gained little, job 0 lost much): moved back...
    c = {0: Curve({8: 2263.0, 4: 1402.0}), 1: Curve({8: 733.0, 12: 560.0})}
    move = arb.decide({0: 4, 1: 12}, c, 16, 4)
    assert (move.donor, move.receiver, move.why) == (1, 0, "marginal")
    assert move.gain == pytest.approx((2263 - 1402) / 1402)
    assert move.loss == pytest.approx((560 - 733) / 560)  # job 1 is faster with fewer
    # ...and past the even split: job 0's 12 and job 1's 4 are lines through its two points.
    move = arb.decide({0: 8, 1: 8}, c, 16, 4)
    assert (move.donor, move.receiver) == (1, 0)
    assert move.gain == pytest.approx((2263 + (2263 - 1402) - 2263) / 2263)
    assert move.loss == pytest.approx((733 - (733 + (733 - 560))) / 733)
    # Measured there, no move pays: 12 and 4 stay.
    c[0].points[12], c[1].points[4] = 2844.0, 981.0
    assert arb.decide({0: 12, 1: 4}, c, 16, 4) is None
    # A job that ended frees its workers: to the job whose curve says it gains, not to one
    # that would be slower with them.
    move = arb.decide({0: 12}, {0: c[0]}, 16, 4)
    assert (move.donor, move.receiver, move.why) == (None, 0, "free")
    assert move.gain == pytest.approx((2844 + (2844 - 2263) - 2844) / 2844)
    assert arb.decide({1: 4}, {1: c[1]}, 16, 4) is None
    # A move under the margin is no move; no job goes under min_size.
    flat = {0: Curve({8: 100.0, 12: 103.0}), 1: Curve({8: 100.0, 4: 99.0})}
    assert arb.decide({0: 8, 1: 8}, flat, 16, 4, margin=0.05) is None
    assert arb.decide({0: 8, 1: 8}, flat, 16, 4, margin=0.0).receiver == 0
    assert arb.decide({0: 8, 1: 8}, c, 16, 4).receiver == 0
    assert arb.decide({0: 8, 1: 8}, c, 16, 4, min_size=5) is None  # job 1 would be at 4


def test_the_arbiter_measures_goodput_over_the_latest_run_at_a_size_and_keeps_rank_0():
    rows = [{"step": s, "t": float(s), "size": 8, "progress": 10.0 * s} for s in range(10)]
    rows += [{"step": s, "t": float(s), "size": 4, "progress": 90 + 5.0 * (s - 9)}
             for s in range(10, 20)]
    assert arb.goodput(rows, 4, settle=2, window_s=5) == pytest.approx(5.0)
    assert arb.goodput(rows, 4, settle=2, window_s=8) is None  # 7 s of it only
    assert arb.goodput(rows, 8, settle=0, window_s=1) is None  # not the latest run
    assert arb.goodput(rows[:10], 8, settle=0, window_s=1) == pytest.approx(10.0)
    slots = [f"h:{p}" for p in range(10, 16)]
    assert arb.resized_peers(["h:12", "h:10", "h:11"], slots, 1) == ["h:12"]
    assert arb.resized_peers(["h:12", "h:10"], slots, 4) == ["h:12", "h:10", "h:11", "h:13"]
    with pytest.raises(ValueError):
        arb.resized_peers(["h:10"], slots, 7)
