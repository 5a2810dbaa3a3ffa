"""Adaptation policies in model.fit (kf.Hook), in real worker processes."""
from __future__ import annotations

import pytest

pytest.importorskip("tensorflow")

import _w_policy as w  # noqa: E402
from _w_in_turn import in_turn  # noqa: E402

ENV = {"TF_CPP_MIN_LOG_LEVEL": "3"}
SAMPLES, EPOCHS = 101, 3
# The bodies each world size runs, one after the other in one spawn (each builds its own model
# and kf.Hook): TensorFlow starts once per size. adaptive_fit comes first, since it checks the
# strategy it starts from; the later bodies run under the tree it installs (their results do not
# depend on the strategy). adaptive_strategy runs without tensor fusion: a spawn of its own.
PLAN = {2: [("adaptive_fit", (SAMPLES, EPOCHS)), ("custom_loop", (30,)),
            ("seed_form_policy", ()), ("talk_gns_policy", (6,))],
        3: [("adaptive_fit", (SAMPLES, EPOCHS)), ("outside_hook", ())]}


@pytest.fixture(scope="module")
def planned(session_spawn):
    """planned(n, body): every rank's result of `body` in PLAN[n]."""
    cache = {}

    def get(n, body):
        if n not in cache:
            calls = [(f"_w_policy:{name}", args) for name, args in PLAN[n]]
            cache[n] = session_spawn.run(n, in_turn, calls, env=ENV, timeout=280,
                                         fail_fast=True)
        i = [name for name, _ in PLAN[n]].index(body)
        return [results[i] for results in cache[n].check()]

    return get


@pytest.fixture(scope="module", params=[2, 3])
def fit_run(request, planned):
    return request.param, planned(request.param, "adaptive_fit")


@pytest.mark.timeout(400)
def test_every_worker_sees_every_change_at_the_same_step(fit_run):
    n, results = fit_run
    logs = [r["log"] for r in results]
    assert all(len(lg) == len(logs[0]) for lg in logs)
    for entries in zip(*logs):
        # Same step, strategy, batch size, learning rate and weights before every step.
        assert len({repr({k: e[k] for k in ("step", "strategy", "batch", "lr", "weights")})
                    for e in entries}) == 1
    by_step = {e["step"]: e for e in logs[0]}
    tree = [n - 1] * n
    # state.step counts finished steps: decided in after_step when 2 steps are done, applied
    # before the next step (the one whose before_step sees step == 2).
    assert by_step[1]["strategy"] != {"tree": tree}
    assert by_step[2]["strategy"] == {"tree": tree}
    assert results[0]["strategy"] == {"tree": tree}
    assert [by_step[s]["batch"] for s in (4, 5)] == [4, 7]
    assert by_step[8]["lr"] == pytest.approx(0.01) and by_step[9]["lr"] == 0.0
    # lr 0 in the compiled step: the weights stop changing from step 9 on.
    weights = [e["weights"] for e in logs[0] if e["step"] >= 9]
    assert len(set(weights)) == 1 and results[0]["final"] == weights[0]
    assert by_step[8]["weights"] != by_step[3]["weights"]


@pytest.mark.timeout(400)
def test_malformed_tree_raises_everywhere_and_training_goes_on(fit_run):
    n, results = fit_run
    for r in results:
        assert len(r["errors"]) == 1 and "malformed tree" in r["errors"][0]
        assert f"{n + 1} entries" in r["errors"][0]
        assert r["strategy"] == {"tree": [n - 1] * n}  # the tree installed before stays


@pytest.mark.timeout(400)
def test_every_sample_once_per_epoch_despite_batch_change(fit_run):
    n, results = fit_run
    served = [r["served"] for r in results]
    steps = len(served[0])
    assert all(len(s) == steps for s in served)
    # Rebuild epochs: each epoch ends when SAMPLES samples were served over all workers.
    epoch, seen_epochs = [], []
    shapes = set()
    for i in range(steps):
        for s in served:
            epoch.extend(s[i])
            shapes.add(len(s[i]))
        if len(epoch) >= SAMPLES:
            seen_epochs.append(sorted(epoch))
            epoch = []
    assert epoch == [] and len(seen_epochs) == EPOCHS
    for e in seen_epochs:
        assert e == list(range(SAMPLES))
    assert {4, 7} <= shapes


@pytest.mark.timeout(300)
def test_actions_outside_a_hook(planned):
    results = planned(3, "outside_hook")
    for r in results:
        assert r["tree"] == {"tree": [0, 0, 0]}
        assert r["ring"] == {"name": "RING"}
        assert "different" in r["one_bad"]  # malformed on rank 0 only: a disagreement
        assert "different" in r["differ"]
        assert r["after"] == {"name": "RING"}
        assert r["sum"] == [0.0, 3.0, 6.0, 9.0, 12.0]
        assert r["batch"].startswith("RuntimeError") and "kf.Hook" in r["batch"]
        assert r["lr"].startswith("RuntimeError")
        assert r["bad_batch"].startswith("ValueError")
        assert r["bad_strategy"].startswith("ValueError")


@pytest.mark.timeout(200)
def test_adaptive_strategy_picks_the_fastest_and_leaves_a_slowed_one(spawn):
    # The slowdown is rank 0 entering its allreduces late, a stand-in for a strategy that got
    # slow. With tensor fusion the others wait for a late peer in the fusion queue, outside the
    # allreduce, so (rightly) no strategy's counters would see it: fusion is off here.
    env = dict(ENV, KUNGFU_FUSION_BYTES="0")
    results = spawn(3, w.adaptive_strategy, 200.0, env=env, timeout=150)
    r0 = results[0]
    for r in results[1:]:
        assert r["seen"] == r0["seen"] and r["decisions"] == r0["decisions"]
        assert r["history"] == r0["history"]
    decisions = r0["decisions"]
    # Explore the three candidates in order, then install the fastest.
    assert [d[1] for d in decisions[:3]] == ["BINARY_TREE_STAR", "RING", "STAR"]
    first = {name: rate for _, name, rate in r0["history"][:3]}
    fastest = max(first, key=first.get)
    assert decisions[3][1:] == (fastest, "fastest")
    assert r0["slowed"] == fastest
    # Slowed from step 40 (rank 0 enters 200 ms late): a check sees the drop, the policy explores again and settles on
    # another strategy.
    again = [d for d in decisions[4:] if "dropped" in d[2]]
    assert again, decisions
    # Every exploration that ended after the slowdown chose another strategy (load on the
    # machine may trigger more than one; at least one must have ended).
    chosen = [d[1] for d in decisions[4:] if d[2] == "fastest" and d[0] > again[0][0]]
    assert chosen and fastest not in chosen, decisions


@pytest.mark.timeout(300)
def test_hook_in_a_custom_loop(planned):
    results = planned(2, "custom_loop")
    r0, r1 = results
    # Steps 0-2 at batch 3 (3 x 2 x 3 = 18 samples), then 6: 12 left in epoch 0 -> one step.
    assert r0["shapes"][:4] == [3, 3, 3, 6] and r1["shapes"][:4] == [3, 3, 3, 6]
    assert r0["seen"] == [30, 60] and r0["batch"] == 6
    for epoch_start, epoch_end in ((0, 4), (4, 4 + 3)):
        got = sorted(i for r in results for s in r["served"][epoch_start:epoch_end] for i in s)
        assert got == list(range(30))


@pytest.mark.timeout(300)
def test_policy_hooks_without_the_state_argument(planned):
    # The seed's form (`def after_step(self):`) failed with "takes 1 positional argument".
    for calls in planned(2, "seed_form_policy"):
        # 12 samples, 3 per worker per step at np=2: 2 steps per epoch, 2 epochs.
        assert calls == {"before_epoch": 2, "after_step": 4, "after_epoch": 1 + 2}


@pytest.mark.timeout(300)
def test_a_policy_asking_for_more_workers_than_slots_is_refused_and_training_goes_on(planned):
    """The talk's GNS policy under a plain (not elastic) kungfu-run: every kf.resize(size + 1)
    returns False with a warning that says why; training ends normally with the same weights."""
    results = planned(2, "talk_gns_policy")
    digests = {r["weights"] for r in results}
    assert len(digests) == 1
    for r in results:
        assert r["size"] == 2
        asks = r["asked"]
        assert asks and asks[0::2] == [3] * (len(asks) // 2) and not any(asks[1::2])
        assert len(r["warnings"]) == len(asks) // 2
        assert "kf.resize(3) refused: kf.resize needs an elastic job" in r["warnings"][0]
        assert "training goes on with 2 workers" in r["warnings"][0]
