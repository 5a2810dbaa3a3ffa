"""The adaptation policies' decisions on controlled input (no training): LB-BSP's split for a
slowed worker, its damping under jitter, momentum compensation's learning-rate ramp."""
from __future__ import annotations

import numpy as np
import pytest

from types import SimpleNamespace

from kungfu.elastic import Round
from kungfu.policy import LoadBalancing, MomentumCompensation, TrainingState
from kungfu.policy.load_balancing import split


def decide(policy, state, hook="after_step"):
    """A policy's hook in an open decision round, as kf.Hook runs it; the decisions recorded."""
    r = Round(SimpleNamespace(state=state, policies=[policy]), None, "test")
    r.open()
    try:
        getattr(policy, hook)(state)
    finally:
        decisions = r.close()
    return decisions


def run_round(policy, state):
    """One step boundary as kf.Hook runs it: the policy's after_step, then the decisions."""
    return decide(policy, state)


def balance(policy, cost, steps, batch=32, jitter=0.0, seed=0):
    """Steps of 4 workers whose compute time is cost[r] x samples (x 1 +- jitter); returns the
    split after each step."""
    rng = np.random.default_rng(seed)
    n = len(cost)
    state = TrainingState(cluster_size=n, batch_sizes=[batch] * n, global_batch_size=batch * n)
    trace = []
    for step in range(1, steps + 1):
        state.step = step
        noise = 1 + jitter * rng.uniform(-1, 1, n)
        state.metrics["part_sizes"] = list(state.batch_sizes)
        state.metrics["compute_times"] = [c * b * e for c, b, e in
                                          zip(cost, state.batch_sizes, noise)]
        got = run_round(policy, state)
        if "batch_sizes" in got:
            state.batch_sizes = got["batch_sizes"]
        trace.append(list(state.batch_sizes))
    return trace


def test_split_is_proportional_with_a_floor_and_keeps_the_total():
    assert split(128, [1, 0.5, 1, 1]) == [37, 18, 37, 36]
    assert sum(split(7, [100, 1, 1], minimum=2)) == 7 and min(split(7, [100, 1, 1], 2)) == 2
    with pytest.raises(ValueError, match="cannot give 4 workers 2"):
        split(7, [1, 1, 1, 1], minimum=2)


@pytest.mark.parametrize("predictor", ["last", "ewma", "narx"])
def test_a_worker_slowed_twice_gets_about_half_the_batch_within_a_few_steps(predictor):
    trace = balance(LoadBalancing(predictor=predictor, every=2, warmup=2), [1, 2, 1, 1], 30)
    b = trace[-1]
    assert sum(b) == 128
    assert b[1] == pytest.approx(b[0] / 2, abs=1) and b[0] == pytest.approx(b[2], abs=1)
    first = next(i for i, s in enumerate(trace) if s[1] < 32)
    assert first <= 4  # acts after its warm-up
    settled = next(i for i, s in enumerate(trace) if abs(s[1] - b[1]) <= 1)
    assert settled <= 15, trace


def test_a_change_once_started_goes_on_past_the_dead_band_to_its_target():
    # 8 workers of 128, two of them twice as slow: the exact split is 1024 / 14 = 73.1 for the
    # slow ones, 146.3 for the others. Halving the distance from 128 stops 4.7% short (76-77)
    # if the dead band of 5% also ends a change; the slow workers' steps would then take 5%
    # longer than balanced ones, for good.
    cost = [1, 2, 2, 1, 1, 1, 1, 1]
    policy = LoadBalancing(every=2, warmup=2)
    trace = balance(policy, cost, 60, batch=128)
    b = trace[-1]
    assert sum(b) == 1024
    exact = split(1024, [1 / c for c in cost])  # [147, 73, 73, 147, 146, 146, 146, 146]
    assert all(abs(x - y) <= 1 for x, y in zip(b, exact)), (b, exact)
    # ... and then it stops: nothing moves once the split is there
    assert trace[-20:] == [b] * 20
    assert len(policy.decisions) <= 8, policy.decisions


def test_no_straggler_and_ten_percent_jitter_leave_the_split_alone():
    for predictor in ("ewma", "narx"):
        policy = LoadBalancing(predictor=predictor, threshold=0.1)
        trace = balance(policy, [1, 1, 1, 1], 60, jitter=0.1, seed=1)
        # (With threshold=0 it changes the split 11 (EWMA) or 12 (NARX) times here.)
        assert len(policy.decisions) <= 3, (predictor, policy.decisions)
        assert max(abs(x - 32) for s in trace for x in s) <= 4


def test_a_slowdown_that_moves_is_followed():
    policy = LoadBalancing(every=2, warmup=2)
    first = balance(policy, [1, 2, 1, 1], 25)[-1]
    state_split = first
    assert state_split[1] < state_split[3]
    # Now worker 3 is the slow one: the policy keeps its history and follows.
    rng_trace = []
    state = TrainingState(cluster_size=4, batch_sizes=first, global_batch_size=128)
    for step in range(26, 60):
        state.step = step
        state.metrics["part_sizes"] = list(state.batch_sizes)
        state.metrics["compute_times"] = [c * b for c, b in zip([1, 1, 1, 2],
                                                                state.batch_sizes)]
        got = run_round(policy, state)
        if "batch_sizes" in got:
            state.batch_sizes = got["batch_sizes"]
        rng_trace.append(list(state.batch_sizes))
    b = rng_trace[-1]
    assert b[3] == pytest.approx(b[0] / 2, abs=1) and b[1] == pytest.approx(b[0], abs=1)


def test_momentum_compensation_ramps_the_learning_rate_over_t_steps():
    policy = MomentumCompensation(steps=4)
    state = TrainingState(global_batch_size=64, learning_rate=0.1)
    lrs = []
    for step in range(1, 10):
        if step == 3:
            state.global_batch_size = 256  # k = 4, applied before step 3 trained
        got = run_round(policy, state)
        if "learning_rate" in got:
            state.learning_rate = got["learning_rate"]
        lrs.append(state.learning_rate)
    # Steps 1-3 at 0.1 (step 3 trained the new batch with multiplier 1), then 1.75, 2.5, 3.25,
    # 4 times 0.1 over the next four steps, and 0.4 from then on.
    np.testing.assert_allclose(lrs, [0.1, 0.1, 0.175, 0.25, 0.325, 0.4, 0.4, 0.4, 0.4])
    assert policy.changes == [{"step": 0, "batch": 256, "k": 4.0}]
    state.global_batch_size = 128  # smaller: the lower rate at once
    assert run_round(policy, state)["learning_rate"] == pytest.approx(0.2)


def test_bad_policy_arguments_are_refused():
    with pytest.raises(ValueError, match="predictor must be one of"):
        LoadBalancing(predictor="arima")
    with pytest.raises(ValueError, match="damping"):
        LoadBalancing(damping=0)
    with pytest.raises(ValueError, match="steps must be a positive integer"):
        MomentumCompensation(steps=0)


def test_the_autoscaler_grows_while_workers_pay_then_walks_back(monkeypatch):
    """Throughput 100 k samples/s up to k = 2, then 220 flat: s(1->2) = 1, s(2->3) = 0.2,
    s(3->4) = 0; with S = 0.1 it probes 2, 3 and 4 and settles at 3 (the oracle's k)."""
    from kungfu.policy import ScalingAutoscaler

    asked = []
    monkeypatch.setattr("kungfu.policy.autoscaler.resize", lambda n: asked.append(n) or True)
    clock = {"t": 0.0}
    monkeypatch.setattr("kungfu.policy.autoscaler.time.monotonic", lambda: clock["t"])
    policy = ScalingAutoscaler(threshold=0.1, window=4, settle=2, max_size=4)
    state = TrainingState(cluster_size=1)
    rng = np.random.default_rng(0)
    sizes = []
    for step in range(1, 80):
        state.step = step
        k = state.cluster_size
        state.samples_seen += 100  # each step's samples, taking 100 / throughput seconds
        clock["t"] += 100 / (min(100.0 * k, 220.0) * (1 + 0.01 * rng.uniform(-1, 1)))
        policy.after_step(state)
        if asked:  # the Hook applies it at this step's agreement
            state.cluster_size = asked.pop()
        sizes.append(state.cluster_size)
    assert [t.get("probe") for t in policy.trace if "probe" in t] == [2, 3, 4]
    assert [round(t["s"], 1) for t in policy.trace if "s" in t] == [1.0, 0.2, 0.0]
    assert policy.phase == "settled" and sizes[-1] == 3
    assert sizes.count(4) <= 2 + 1 + 4  # the probe of 4: settle, the window's start, window


def test_the_autoscaler_stops_at_the_largest_useful_global_batch(monkeypatch):
    """Every worker pays (throughput 100 k), but a global batch above 96 is no use: with 32
    per worker it probes 2 and 3 and stops there, though the job has 8 slots."""
    from kungfu.policy import ScalingAutoscaler

    asked = []
    monkeypatch.setattr("kungfu.policy.autoscaler.resize", lambda n: asked.append(n) or True)
    clock = {"t": 0.0}
    monkeypatch.setattr("kungfu.policy.autoscaler.time.monotonic", lambda: clock["t"])
    policy = ScalingAutoscaler(window=4, settle=2, max_batch=96)
    state = TrainingState(cluster_size=1, max_size=8, local_batch_size=32)
    for step in range(1, 60):
        state.step = step
        state.samples_seen += 100
        clock["t"] += 100 / (100.0 * state.cluster_size)
        policy.after_step(state)
        if asked:
            state.cluster_size = asked.pop()
    assert [t.get("probe") for t in policy.trace if "probe" in t] == [2, 3]
    assert policy.trace[-1]["why"] == "the largest size allowed"
    assert policy.phase == "settled" and state.cluster_size == 3
    with pytest.raises(ValueError, match="max_batch >= 1"):
        ScalingAutoscaler(max_batch=0)


def test_the_autoscaler_settles_when_no_worker_can_be_added(monkeypatch):
    from kungfu.policy import ScalingAutoscaler

    monkeypatch.setattr("kungfu.policy.autoscaler.resize", lambda n: True)  # nothing changes
    policy = ScalingAutoscaler(window=2, settle=0, max_size=4)
    state = TrainingState(cluster_size=2)
    for step in range(1, 10):
        state.step = step
        state.samples_seen += 100
        policy.after_step(state)
    assert policy.phase == "settled" and policy.trace[-1]["why"] == "no worker could be added"


def straggle(policy, factors, steps, monkeypatch, jitter=0.0, seed=0, switch_after=3, load=0.0):
    """4 workers with equal parts whose compute time per sample is factors(step)[r] (x 1 +-
    jitter), plus on a loaded machine (`load` > 0) a wait for a core on every step, drawn from
    an exponential distribution with mean `load` times a normal step's compute; a replacement
    asked for takes effect `switch_after` steps later with a worker of factor 1 in the leaver's
    place. Returns the replacements asked for (step, rank)."""
    asked = []
    monkeypatch.setattr("kungfu.policy.stragglers.resize",
                        lambda n, leave=(): asked.append((n, list(leave))))
    pending = {"until": None}
    rng = np.random.default_rng(seed)
    replaced = {}
    state = TrainingState(cluster_size=4)
    out = []
    for step in range(1, steps + 1):
        state.step = step
        f = [replaced.get(r, x) for r, x in enumerate(factors(step))]
        noise = 1 + jitter * rng.uniform(-1, 1, 4)
        state.metrics["part_sizes"] = [32] * 4
        wait = 0.001 * 32 * rng.exponential(load, 4) if load else np.zeros(4)
        state.metrics["compute_times"] = [0.001 * 32 * x * e + w
                                          for x, e, w in zip(f, noise, wait)]
        if pending["until"] == step:
            state.resize_pending, pending["until"] = False, None
        policy.after_step(state)
        if asked:
            (n, [rank]) = asked.pop()
            assert n == 4
            out.append((step, rank))
            replaced[rank] = 1.0  # the new worker, once switched (a few steps on)
            state.resize_pending = True
            pending["until"] = step + switch_after
    return out


def test_a_straggler_is_replaced_once_half_its_window_is_slow(monkeypatch):
    from kungfu.policy import StragglerReplacement

    policy = StragglerReplacement(window=20)
    got = straggle(policy, lambda s: [1, 1, 2 if s > 20 else 1, 1], 120, monkeypatch)
    assert len(got) == 1 and got[0][1] == 2
    # Without noise the level is the window's median: under 0.85 once 10 of its 20 steps are
    # slow (the median of ten 0.5s and ten 1s is 0.75), at step 30.
    assert got[0][0] == 30, got
    assert policy.replaced[0]["level"] == pytest.approx(0.75)


@pytest.mark.parametrize("seed", range(6))
def test_a_loaded_machine_neither_hides_a_straggler_nor_invents_one(monkeypatch, seed):
    """Every step also waits for a core (exponential, mean half a step's compute): a x2
    straggler from step 30 is still replaced within 50 steps, and without one, with +-10%
    jitter on top of the load, no one is replaced in 300 steps."""
    from kungfu.policy import StragglerReplacement

    got = straggle(StragglerReplacement(), lambda s: [1, 2 if s >= 30 else 1, 1, 1], 300,
                   monkeypatch, jitter=0.1, seed=seed, load=0.5)
    assert got and got[0][1] == 1 and got[0][0] < 30 + 50, got
    assert len(got) == 1, got
    got = straggle(StragglerReplacement(), lambda s: [1, 1, 1, 1], 300, monkeypatch,
                   jitter=0.1, seed=seed, load=0.5)
    assert got == []


def test_bad_straggler_settings_are_refused():
    from kungfu.policy import StragglerReplacement

    for bad in ({"threshold": 1.0}, {"threshold": 0}, {"window": 2}, {"spread": -1},
                {"warmup": -1}, {"cooldown": -1}):
        with pytest.raises(ValueError, match="threshold in"):
            StragglerReplacement(**bad)


@pytest.mark.parametrize("factor", [1.33, 4.0])
def test_mild_and_severe_stragglers(monkeypatch, factor):
    from kungfu.policy import StragglerReplacement

    got = straggle(StragglerReplacement(), lambda s: [factor, 1, 1, 1], 100, monkeypatch)
    assert [r for _, r in got] == [0]  # rank 0 too: any rank may be replaced


def test_no_straggler_and_ten_percent_jitter_replace_no_one(monkeypatch):
    from kungfu.policy import StragglerReplacement

    for seed in range(5):
        got = straggle(StragglerReplacement(), lambda s: [1, 1, 1, 1], 300, monkeypatch,
                       jitter=0.1, seed=seed)
        assert got == []


def test_gns_batch_growth_doubles_while_the_noise_scale_exceeds_the_batch():
    from kungfu.policy import GNSBatchGrowth

    policy = GNSBatchGrowth(max_batch=64)
    state = TrainingState(local_batch_size=8, global_batch_size=32, cluster_size=4,
                          learning_rate=0.1)
    gns = state.metrics
    gns["gns"] = 300.0
    seen = []
    for epoch in range(6):
        got = decide(policy, state, "after_epoch")
        if "batch_size" in got:
            state.local_batch_size = got["batch_size"]
            state.global_batch_size = 4 * got["batch_size"]
            state.learning_rate = got["learning_rate"]
        seen.append((state.local_batch_size, round(state.learning_rate, 4)))
        if epoch == 1:
            gns["gns"] = 40.0  # below the next global batch (64): no growth...
        if epoch == 3:
            gns["gns"] = float("nan")  # ...nor without an estimate
    assert seen[:2] == [(16, 0.1414), (32, 0.2)]
    assert seen[2:] == [(32, 0.2)] * 4
    gns["gns"] = 1e6
    assert decide(GNSBatchGrowth(max_batch=32), state, "after_epoch") == {}  # 64 > max_batch


def test_gns_growth_with_goodput_moves_to_the_batch_of_the_highest_goodput(monkeypatch):
    from kungfu.policy import GNSBatchGrowth

    clock = {"t": 0.0}
    monkeypatch.setattr("kungfu.policy.noise_scale.time.monotonic", lambda: clock["t"])

    def run(gns, steps=60, policy=None, state=None, stall=None):
        """4 workers whose step on b samples takes 10 ms + 1 ms a sample: a larger batch has
        more throughput, but not twice as much (1.13x from 32 to 64 a worker). `gns`: the
        noise scale, or a function of the step."""
        policy = policy or GNSBatchGrowth(max_batch=128, every_steps=5, goodput=True)
        state = state or TrainingState(local_batch_size=32, global_batch_size=128,
                                       cluster_size=4, learning_rate=0.1)
        sizes = []
        for step in range(state.step + 1, state.step + steps + 1):
            state.step = step
            state.metrics["gns"] = gns(step) if callable(gns) else gns
            state.samples_seen += state.global_batch_size
            clock["t"] += 0.01 + 0.001 * state.local_batch_size + (0.3 if step == stall else 0)
            got = decide(policy, state)
            if "batch_size" in got:
                state.local_batch_size = got["batch_size"]
                state.global_batch_size = 4 * got["batch_size"]
                state.learning_rate = got.get("learning_rate", state.learning_rate)
            sizes.append(state.local_batch_size)
        return policy, sizes, state

    # Noise scale 1e5: the efficiency hardly falls; the throughput rises. 64 is tried (one
    # batch measured), then 128 chosen from the line through 32's and 64's step times (42 and
    # 74 ms: 138 ms, exact here) without a trial: 512 / 0.138 / (1e5 + 512) > 256 / 0.074 /
    # (1e5 + 256).
    policy, sizes, _ = run(1e5)
    assert [(d["why"], d["batch"]) for d in policy.decisions] == [("try", 64), ("grow", 128)]
    assert sizes[-1] == 128 and len(policy.decisions) == 2  # 128 is max_batch: it stays
    assert [m[0] for m in policy.measured] == [32, 64, 128]
    assert policy.measured[0][1] == pytest.approx(128 / 0.042)  # samples/s at 32
    # A step of the trial stalled 0.3 s (by something else): by the clock over the window, 64
    # would measure slower than 32; the median of its steps is not moved.
    policy, sizes, _ = run(1e5, stall=8)
    assert [(d["why"], d["batch"]) for d in policy.decisions] == [("try", 64), ("grow", 128)]
    assert policy.measured[1][1] == pytest.approx(256 / 0.074)
    # Noise scale 200 (above the global batch, so the plain rule grows): at 64 the efficiency
    # falls to (200 + 128) / (200 + 256) = 0.72 while the throughput rises 1.13x: back to 32,
    # with its learning rate, and no further trial while the noise scale stays...
    policy, sizes, state = run(200.0)
    assert [(d["why"], d["batch"]) for d in policy.decisions] == [("try", 64), ("shrink", 32)]
    assert sizes[-1] == 32 and policy.decisions[-1]["lr"] == 0.1
    # ...but once it has risen, to 64 (measured: no trial) and 128 (by the line).
    policy, sizes, _ = run(lambda step: 1e5, steps=20, policy=policy, state=state)
    assert [(d["why"], d["batch"]) for d in policy.decisions[2:]] == [("grow", 64),
                                                                     ("grow", 128)]
    assert policy.decisions[2]["lr"] == pytest.approx(0.1 * 2 ** 0.5)
    # A noise scale where 64 and 32 are within the margin: no move.
    r32, r64 = 128 / 0.042, 256 / 0.074
    even = (128 * r64 - 256 * r32) / (r32 - r64)  # r32 / (even + 128) = r64 / (even + 256)
    policy, sizes, _ = run(lambda step: 1e5 if step <= 5 else even, steps=40)
    assert [d["why"] for d in policy.decisions] == ["try"] and sizes[-1] == 64
    plain, plain_sizes = GNSBatchGrowth(max_batch=128, every_steps=5), []
    state = TrainingState(local_batch_size=32, global_batch_size=128, cluster_size=4,
                          learning_rate=0.1)
    state.metrics["gns"] = 200.0
    for step in range(1, 21):
        state.step = step
        got = decide(plain, state)
        if "batch_size" in got:
            state.local_batch_size, state.global_batch_size = got["batch_size"], 4 * got[
                "batch_size"]
        plain_sizes.append(state.local_batch_size)
    assert plain_sizes[-1] == 64  # the plain rule: 200 > 128, grown; 200 < 256, stays
    with pytest.raises(ValueError, match="every_steps"):
        GNSBatchGrowth(max_batch=64, goodput=True)


def test_adascale_gain_is_between_1_and_the_scale():
    from kungfu.policy import AdaScale

    policy = AdaScale(base_batch=32, base_lr=0.1)
    state = TrainingState(global_batch_size=128)
    stats = {}

    def lr():
        if "v" in stats:
            state.metrics["grad_noise_stats"] = stats["v"]
        return decide(policy, state)["learning_rate"]

    assert lr() == pytest.approx(0.1)  # no estimate yet: gain 1
    stats["v"] = (3200.0, 1.0)  # noise dominates: gain = (100 + 1) / (25 + 1) ~ 3.88 of 4
    assert lr() == pytest.approx(0.1 * 101 / 26)
    stats["v"] = (0.0, 5.0)  # no noise: a larger batch is worth no larger step
    assert lr() == pytest.approx(0.1)
    state.global_batch_size = 32  # the base batch: gain 1 whatever the noise
    stats["v"] = (3200.0, 1.0)
    assert lr() == pytest.approx(0.1)
    assert policy.progress == pytest.approx(1 + 1 + 101 / 26 + 1)
