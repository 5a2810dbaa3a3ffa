"""The membership state machine (kungfu/elastic) without TensorFlow: a binding of plain numpy
arrays shows that commits, restore and the durable checkpoint need nothing of a framework but
the `Variables` interface. (Resize and recovery with real peers: tests/integration.)"""
from __future__ import annotations

import sys

import numpy as np
import pytest

from kungfu.elastic import Membership, State, Trainer
from kungfu.policy import BasePolicy, TrainingState
from numpy_variables import NumpyVariables  # tests/, on the path (conftest.py)


class Counting(BasePolicy):
    def __init__(self):
        self.seen = 0


class Loop(Trainer):
    def __init__(self, shapes):
        self.state = TrainingState()
        self.policies = [Counting()]
        self.data = None
        self.epochs_total = 5
        self.refreshed = 0
        self.membership = Membership(self, NumpyVariables(
            [np.zeros(s, np.float32) for s in shapes]))

    def refresh_sizes(self):
        self.refreshed += 1

    def on_detached(self):
        raise AssertionError("not detached here")

    def train(self, steps):
        for _ in range(steps):
            for v in self.membership.variables.values:
                v += 1
            self.state.step += 1
            self.policies[0].seen += 1


def test_a_commit_is_restored_with_the_trainer_and_policy_state():
    loop = Loop([(3,), (2, 2)])
    m = loop.membership
    m.recovering = True
    loop.train(3)
    m.commit("step")
    loop.train(2)
    assert loop.membership.variables.values[0][0] == 5 and loop.state.step == 5
    m.restore(m.commits[-1])
    assert [float(v.flat[0]) for v in m.variables.values] == [3.0, 3.0]
    assert loop.state.step == 3 and loop.policies[0].seen == 3
    assert m.commit_seq == 1 and m.state is State.TRAINING


def test_no_commit_without_recovery_or_a_checkpoint():
    loop = Loop([(1,)])
    loop.membership.commit("step")
    assert not loop.membership.commits and loop.membership.commit_seq == 0


def test_the_checkpoint_resumes_another_trainer_and_refuses_another_model(tmp_path):
    path = str(tmp_path / "job.ckpt")
    writer = Loop([(3,), (2,)])
    writer.membership.checkpoint, writer.membership.checkpoint_every = path, 2
    writer.train(1)
    writer.membership.commit("step")  # step 1: not due
    assert not (tmp_path / "job.ckpt").exists()
    writer.train(1)
    writer.membership.commit("step")  # step 2: written, atomically (no temporary file left)
    assert [p.name for p in tmp_path.iterdir()] == ["job.ckpt"]

    reader = Loop([(3,), (2,)])
    reader.membership.checkpoint = path
    reader.epochs_total = None
    assert reader.membership.resume()
    assert [v.tolist() for v in reader.membership.variables.values] == [[2, 2, 2], [2, 2]]
    assert reader.state.step == 2 and reader.policies[0].seen == 2 and reader.epochs_total == 5

    other = Loop([(3,), (4,)])
    other.membership.checkpoint = path
    with pytest.raises(ValueError, match=r"v1 is float32\[4\] in this model, but the checkpoint"):
        other.membership.resume()
    missing = Loop([(1,)])
    missing.membership.checkpoint = str(tmp_path / "none.ckpt")
    assert not missing.membership.resume()


def test_moves_outside_the_state_machine_are_refused():
    m = Loop([(1,)]).membership
    m._enter(State.PROPOSING)
    m._enter(State.WAITING)
    with pytest.raises(RuntimeError, match="cannot go from waiting for joiners to proposing"):
        m._enter(State.PROPOSING)
    m._enter(State.RECOVERING)
    m._enter(State.DETACHED)
    assert m.detached
    with pytest.raises(RuntimeError, match="cannot go from detached to training"):
        m._enter(State.TRAINING)


def test_recovery_is_off_outside_an_elastic_job():
    loop = Loop([(1,)])
    error = ConnectionError("peer gone")
    with pytest.raises(ConnectionError):
        loop.membership.recover(error)  # nothing committed, recovery off: the error itself
    assert loop.membership.state is State.TRAINING


def test_the_elastic_package_imports_no_framework():
    import subprocess

    code = ("import sys, kungfu.elastic; "
            "assert 'tensorflow' not in sys.modules and 'keras' not in sys.modules, "
            "[m for m in sys.modules if m.startswith(('tensorflow', 'keras'))][:3]; "
            "assert 'kungfu._launch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_plan_keeps_the_members_and_skips_hosts_that_cool_down(monkeypatch):
    """Elastic.plan against a real store: members first in their order, then free slots in -H
    order, none on a host that cools down; a growth with no free slot is a ResizeError."""
    import time

    from kungfu import store as st
    from kungfu.elastic import Elastic, ResizeError

    server = st.ConfigServer("127.0.0.1", 0).start()
    try:
        monkeypatch.setenv("KUNGFU_CONFIG_SERVER", server.url)
        monkeypatch.setenv("KUNGFU_ELASTIC_HOSTS", "a:2,b:2")
        monkeypatch.setenv("KUNGFU_PORT_RANGE", "10000-10010")
        # a:10001 was lost: the members are a:10000 and b:10000 (ranks 0 and 1).
        monkeypatch.setenv("KUNGFU_SELF_SPEC", "a:10000")
        monkeypatch.setenv("KUNGFU_INIT_PEERS", "a:10000,b:10000")
        monkeypatch.setenv("KUNGFU_INIT_CLUSTER_VERSION", "3")
        e = Elastic()
        e.store.propose(st.ClusterConfig(0, ["a:10000"]))
        assert e.plan(4) == ["a:10000", "b:10000", "a:10001", "b:10001"]
        assert e.plan(1) == ["a:10000"]
        e.store.cool_down("a", time.time() + 60)
        assert e.plan(4) == ["a:10000", "b:10000", "b:10001"]
        assert list(e.propose(3).peers) == ["a:10000", "b:10000", "b:10001"]
        e.store.cool_down("b", time.time() + 60)
        with pytest.raises(ResizeError, match=r"no free slot .*\(a for \d+s more, b for"):
            e.propose(3)
        assert list(e.propose(1).peers) == ["a:10000"]  # shrinking needs no free slot
    finally:
        server.stop()


def _written(tmp_path):
    """A trainer that wrote its commit of step 2 to tmp_path/job.ckpt."""
    path = str(tmp_path / "job.ckpt")
    writer = Loop([(3,), (2,)])
    writer.membership.checkpoint, writer.membership.checkpoint_every = path, 1
    writer.train(2)
    writer.membership.commit("step")
    return path, writer


def _reader(path):
    reader = Loop([(3,), (2,)])
    reader.membership.checkpoint = path
    return reader.membership


@pytest.mark.parametrize("damage, why", [
    (lambda b: b"", r"is empty \(0 bytes\)"),
    (lambda b: b[:20], r"is truncated: 20 bytes, shorter than its 52-byte header"),
    (lambda b: b[:-1], r"is truncated: \d+ bytes of content, its header says \d+"),
    (lambda b: b + b"x", r"has 1 bytes more than its header says"),
    (lambda b: b[:-40] + bytes([b[-40] ^ 0x40]) + b[-39:],
     r"is corrupted: the SHA-256 of its content does not match its header"),
    (lambda b: b[52:], r"is not a kungfu checkpoint \(it starts with b'\\x80"),  # a bare pickle
    (lambda b: b[:8] + b"\x07" + b[9:], r"has format version 7; this kungfu reads version 1"),
], ids=["empty", "header-cut", "content-cut", "longer", "bit-flipped", "foreign", "version"])
def test_a_bad_checkpoint_file_is_refused_naming_it_and_left_alone(tmp_path, damage, why):
    from kungfu.elastic import CheckpointError

    path, _ = _written(tmp_path)
    with open(path, "rb") as f:
        bad = damage(f.read())
    with open(path, "wb") as f:
        f.write(bad)
    with pytest.raises(CheckpointError, match=f"the checkpoint {path} {why}.*delete or move it"):
        _reader(path).resume()
    with open(path, "rb") as f:
        assert f.read() == bad  # never taken for "no checkpoint", never overwritten


def test_a_checkpoint_file_is_private_and_its_temporary_file_unpredictable(tmp_path,
                                                                          monkeypatch):
    import os
    import stat

    names = []
    real_replace = os.replace
    monkeypatch.setattr(os, "replace", lambda a, b: (names.append(a), real_replace(a, b)))
    path, writer = _written(tmp_path)
    writer.train(1)
    writer.membership.commit("step")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert len(names) == 2 and names[0] != names[1], names  # not <path>.tmp<pid>
    assert all(os.path.dirname(n) == str(tmp_path) for n in names)
    assert os.listdir(tmp_path) == ["job.ckpt"]
    assert _reader(path).resume()


def test_a_checkpoint_write_that_fails_is_reported_once_and_training_goes_on(tmp_path,
                                                                             monkeypatch,
                                                                             capsys):
    """A full disk (an injected ENOSPC in the write's fsync) and a folder replaced by a file
    (a real error, also for root): reported once with the path, no temporary file left, the
    last good checkpoint kept; the next checkpoint that can be written is."""
    import errno
    import os

    from kungfu.elastic import _checkpoint

    path, writer = _written(tmp_path)  # step 2
    m = writer.membership

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(_checkpoint.os, "fsync", full)
    for _ in range(2):  # steps 3 and 4: no exception, training goes on
        writer.train(1)
        m.commit("step")
    monkeypatch.undo()
    err = capsys.readouterr().err
    assert err.count(f"kungfu: cannot write the checkpoint {path} at step 3 ([Errno 28] No "
                     "space left on device); training goes on") == 1, err
    assert "step 4" not in err and os.listdir(tmp_path) == ["job.ckpt"]
    reader = _reader(path)
    assert reader.resume() and reader.trainer.state.step == 2  # the last good one

    writer.train(1)
    m.commit("step")
    assert "job.ckpt is written again at step 5 (the writes failed since step 3)" in \
        capsys.readouterr().err
    reader = _reader(path)
    assert reader.resume() and reader.trainer.state.step == 5

    (tmp_path / "sub").write_text("")  # a folder that is a file
    m.checkpoint = str(tmp_path / "sub" / "job.ckpt")
    writer.train(1)
    m.commit("step")
    err = capsys.readouterr().err
    assert f"cannot write the checkpoint {m.checkpoint} at step 6 ([Errno 20] Not a " \
           "directory" in err, err
    assert sorted(os.listdir(tmp_path)) == ["job.ckpt", "sub"]


def test_a_checkpoint_path_that_cannot_be_written_is_refused_at_once(tmp_path):
    from kungfu.elastic import CheckpointError, check_writable

    with pytest.raises(CheckpointError, match=f"checkpoint {tmp_path}/no/x.ckpt: its folder "
                                              f"{tmp_path}/no does not exist"):
        check_writable(str(tmp_path / "no" / "x.ckpt"))
    (tmp_path / "f").write_text("")
    with pytest.raises(CheckpointError, match="its folder .*/f is not a folder"):
        check_writable(str(tmp_path / "f" / "x.ckpt"))
    with pytest.raises(CheckpointError, match="is a folder"):
        check_writable(str(tmp_path))
    check_writable(str(tmp_path / "x.ckpt"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f"]  # the probe file is gone


def test_joiners_are_switched_in_only_where_a_step_follows(monkeypatch):
    """Rank 0's decision round with a resize whose joiner is ready (a real store): no switch
    where training ends (Trainer.step_follows() False: a joiner switched in then would wait in
    its first step for workers that have left), the switch where a step follows."""
    import time

    from kungfu import store as st
    from kungfu.elastic import Elastic, _protocol

    server = st.ConfigServer("127.0.0.1", 0).start()
    try:
        for k, v in {"KUNGFU_CONFIG_SERVER": server.url, "KUNGFU_ELASTIC_HOSTS": "a:2",
                     "KUNGFU_PORT_RANGE": "10000-10010", "KUNGFU_SELF_SPEC": "a:10000",
                     "KUNGFU_INIT_PEERS": "a:10000", "KUNGFU_INIT_CLUSTER_VERSION": "0"}.items():
            monkeypatch.setenv(k, v)
        e = Elastic()
        e.store.propose(st.ClusterConfig(0, ["a:10000"]))
        e.pending, e.pending_since = st.ClusterConfig(1, ["a:10000", "a:10001"]), time.monotonic()
        e.store.mark_ready(1, "a:10001")
        monkeypatch.setattr(_protocol, "_context", e)

        class Ending(Loop):
            follows = False

            def step_follows(self):
                return self.follows

        loop = Ending([(3,)])
        decisions = {}
        loop.membership.before_agree(decisions)
        assert decisions == {} and not e.store.switched(1)
        loop.follows = True
        loop.membership.before_agree(decisions)
        assert decisions == {"elastic": {"switch": 1}} and e.store.switched(1)
    finally:
        server.stop()
