"""The decision round (kungfu/elastic/_round.py) on one worker: policies' hooks, recording,
the registry's order of application, and kf.resize refused beyond the job's slots."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

import kungfu as kf
from kungfu import store as st
from kungfu.elastic import Round, TrainingState, _protocol


def _trainer(policies, calls):
    return SimpleNamespace(
        state=TrainingState(cluster_size=1, global_batch_size=8), policies=policies,
        set_batch_size=lambda b: calls.append(("batch_size", b)),
        set_batch_sizes=lambda s: calls.append(("batch_sizes", s)),
        set_learning_rate=lambda lr: calls.append(("learning_rate", lr)))


def test_a_round_agrees_and_applies_in_the_registry_order():
    calls = []

    class Policy(kf.BasePolicy):
        def after_step(self, state):
            kf.set_learning_rate(0.5)
            kf.set_batch_size(4)

    membership = SimpleNamespace(before_agree=lambda d: calls.append(("before", dict(d))))
    r = Round(_trainer([Policy()], calls), membership, "test")
    with pytest.raises(RuntimeError, match="kf.Hook"):
        kf.set_batch_size(4)  # no round is open
    r.run("after_step")
    assert r.recorded("batch_size") and kf.elastic.in_round()
    r.agree()
    # The membership's decisions first; then the batch size before the learning rate.
    assert calls == [("before", {"learning_rate": 0.5, "batch_size": 4}),
                     ("batch_size", 4), ("learning_rate", 0.5)]
    assert kf.elastic.in_round() and r.decisions == {}  # the next round is open
    assert r.close() == {} and not kf.elastic.in_round()


def test_a_policy_hook_written_without_the_state_runs():
    seen = []

    class Talk(kf.BasePolicy):
        def after_step(self):
            seen.append("ran")

    r = Round(_trainer([Talk()], []), SimpleNamespace(before_agree=lambda d: None), "test")
    r.run("after_step")
    r.close()
    assert seen == ["ran"]


def test_resize_beyond_the_slots_is_refused_in_a_round_and_raises_outside(monkeypatch):
    server = st.ConfigServer("127.0.0.1", 0).start()
    try:
        monkeypatch.setenv("KUNGFU_CONFIG_SERVER", server.url)
        monkeypatch.setenv("KUNGFU_ELASTIC_HOSTS", "127.0.0.1:2")
        monkeypatch.setenv("KUNGFU_PORT_RANGE", "10000-10010")
        monkeypatch.setattr(_protocol, "_context", _protocol.Elastic())
        state = TrainingState(cluster_size=1)
        r = Round(SimpleNamespace(state=state, policies=[]), None, "test")
        r.run("after_step")  # fills the state's limits
        assert (state.min_size, state.max_size, state.resize_pending) == (1, 2, False)
        try:
            with pytest.warns(UserWarning, match=r"kf.resize\(3\) refused: cannot resize to 3 "
                                                 r"workers: the job has 1 to 2 slots"):
                assert kf.resize(3) is False
            assert r.decisions == {}
            assert kf.resize(2) is True and r.decisions == {"resize": 2}
            with pytest.raises(kf.ResizeError, match="cannot resize to 0 workers: the job has"):
                kf.resize(0)
        finally:
            r.close()
        with pytest.raises(kf.ResizeError, match="the job has 1 to 2 slots"):
            kf.resize(3)  # outside a round: a collective, refused at once
    finally:
        server.stop()
