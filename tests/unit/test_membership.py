"""The membership state machine (kungfu/elastic) without TensorFlow: a binding of plain numpy
arrays shows that commits, restore and the durable checkpoint need nothing of a framework but
the `Variables` interface. (Resize and recovery with real peers: tests/integration.)"""
from __future__ import annotations

import sys

import numpy as np
import pytest

from kungfu.elastic import Membership, State, Trainer
from kungfu.policy import BasePolicy, TrainingState
from numpy_variables import NumpyVariables  # tests/numpy_variables.py


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
    (lambda b: b[:20], r"is truncated: 20 bytes, shorter than its 56-byte header"),
    (lambda b: b[:-1], r"is truncated: \d+ bytes of content, its header says \d+"),
    (lambda b: b + b"x", r"has 1 bytes more than its header says"),
    (lambda b: b[:-40] + bytes([b[-40] ^ 0x40]) + b[-39:],
     r"is corrupted: the SHA-256 of its content does not match its header"),
    (lambda b: b[56:], r"is not a kungfu checkpoint \(it starts with b'PK"),  # a bare .npz
    (lambda b: b[:8] + b"\x07" + b[9:], r"has format version 7; this kungfu reads version 2"),
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

    (tmp_path / "sub").write_text("")  # a folder that is a file (and cannot be made one)
    m.checkpoint = str(tmp_path / "sub" / "job.ckpt")
    writer.train(1)
    m.commit("step")
    err = capsys.readouterr().err
    assert f"cannot write the checkpoint {m.checkpoint} at step 6 ([Errno 20] Not a " \
           "directory" in err, err
    assert sorted(os.listdir(tmp_path)) == ["job.ckpt", "sub"]


def test_a_checkpoint_path_that_cannot_be_written_is_refused_at_once(tmp_path):
    from kungfu.elastic import CheckpointError, check_writable

    # A missing folder is made, with its parents (as Keras's ModelCheckpoint does).
    check_writable(str(tmp_path / "no" / "such" / "x.ckpt"))
    assert (tmp_path / "no" / "such").is_dir() and not list((tmp_path / "no" / "such").iterdir())
    (tmp_path / "f").write_text("")
    with pytest.raises(CheckpointError, match="its folder .*/f is not a folder"):
        check_writable(str(tmp_path / "f" / "x.ckpt"))
    with pytest.raises(CheckpointError, match=r"its folder .*/f/sub cannot be created \(Not a "
                                              r"directory\)"):
        check_writable(str(tmp_path / "f" / "sub" / "x.ckpt"))
    with pytest.raises(CheckpointError, match="is a folder: give a file name in it"):
        check_writable(str(tmp_path / "no"))


KEY = "9f2c0e5b7a1d4c3e8b6a5f0e1d2c3b4a"  # 128 bits of hex


def _keyed(path, key):
    reader = Loop([(3,), (2,)])
    reader.membership.checkpoint, reader.membership.checkpoint_key = path, key
    return reader.membership


def test_checkpoint_content_keeps_plain_data_and_refuses_objects():
    from kungfu.elastic import CheckpointError
    from kungfu.elastic._checkpoint_content import pack, unpack

    state = {"t": (1, "a"), "s": {3, 4}, "fs": frozenset({5}), "b": b"\x00\xff",
             "a": np.arange(6, dtype=np.int16).reshape(2, 3), "g": np.float32(1.5),
             "nan": float("nan"), "ints": {1: "one", (2, 3): [4.5]}, "$tag": {"$array": 0},
             "n": None, "big": 2 ** 70, "nested": [{"x": np.zeros(2)}]}
    meta, arrays = unpack(pack({"policies": [state]}, [np.ones(3, np.float64), np.int64(7)]))
    got = meta["policies"][0]
    assert [a.tolist() for a in arrays] == [[1.0, 1.0, 1.0], 7]  # the commit's arrays only
    assert arrays[1].shape == () and arrays[1].dtype == np.int64
    assert got["t"] == (1, "a") and got["s"] == {3, 4} and got["fs"] == frozenset({5})
    assert got["b"] == b"\x00\xff" and got["n"] is None and got["big"] == 2 ** 70
    assert got["a"].dtype == np.int16 and got["a"].tolist() == [[0, 1, 2], [3, 4, 5]]
    assert type(got["g"]) is np.float32 and got["g"] == 1.5 and np.isnan(got["nan"])
    assert got["ints"] == {1: "one", (2, 3): [4.5]} and got["$tag"] == {"$array": 0}
    assert got["nested"][0]["x"].tolist() == [0.0, 0.0]
    with pytest.raises(CheckpointError,
                       match=r"\['policies'\]\[0\]\['f'\] holds a builtin_function"):
        pack({"policies": [{"f": len}]}, [])
    with pytest.raises(CheckpointError, match="array of Python objects"):
        pack({}, [np.array([object()])])


def test_a_version_1_checkpoint_is_refused_without_running_its_pickle(tmp_path):
    """Format version 1 was a pickle behind a SHA-256: a file someone else wrote ran their code
    when loaded. It is refused now, naming the way on (convert_checkpoint, for a file one
    trusts), and its pickle is not loaded."""
    import hashlib
    import pickle
    import struct

    from kungfu.elastic import CheckpointError
    from kungfu.elastic._checkpoint import MAGIC

    marker = tmp_path / "code-ran"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    def v1(obj):
        content = pickle.dumps(obj)
        return struct.pack("<8sIQ32s", MAGIC, 1, len(content),
                           hashlib.sha256(content).digest()) + content

    path = tmp_path / "old.ckpt"
    path.write_bytes(v1(Payload()))
    with pytest.raises(CheckpointError, match=r"has format version 1: a pickle, which runs code "
                                              r"when it is loaded.*python -m "
                                              r"kungfu.elastic.convert_checkpoint"):
        _reader(str(path)).resume()
    assert not marker.exists()

    # A version-1 file one trusts, converted: resumed from, with its state.
    from kungfu.elastic import convert_checkpoint

    state = TrainingState(step=7, epoch=1)
    path.write_bytes(v1({"arrays": [np.full(3, 2.0, np.float32), np.ones(2, np.float32)],
                         "variables": [("v0", (3,), "float32"), ("v1", (2,), "float32")],
                         "state": state, "policies": [{"seen": 7}], "data": None,
                         "epochs_total": 4}))
    assert convert_checkpoint.main([str(path)]) == 0
    reader = _reader(str(path))
    assert reader.resume() and reader.trainer.state.step == 7
    assert reader.trainer.policies[0].seen == 7
    assert [v.tolist() for v in reader.variables.values] == [[2, 2, 2], [1, 1]]


def test_a_key_signs_the_checkpoint_and_a_forged_one_is_refused(tmp_path):
    """With an authenticity key the file carries an HMAC of itself: a file changed after it was
    written (its SHA-256 recomputed, or written unsigned) is refused; so is a signed file
    without the key, or with another. Without a key the SHA-256 finds accidents only: a file
    changed with its checksum recomputed is taken (what a key is for)."""
    import hashlib

    from kungfu.elastic import CheckpointError
    from kungfu.elastic import _checkpoint as cf
    from kungfu.elastic._checkpoint_content import pack_commit, unpack_commit

    path = str(tmp_path / "job.ckpt")
    writer = Loop([(3,), (2,)])
    writer.membership.checkpoint, writer.membership.checkpoint_every = path, 1
    writer.membership.checkpoint_key = KEY
    writer.train(2)
    writer.membership.commit("step")
    good = _keyed(path, KEY)
    assert good.resume() and good.trainer.state.step == 2

    got = unpack_commit(cf.read(path, KEY))
    forged = pack_commit([np.full(3, 99.0, np.float32), got["arrays"][1]], got["variables"],
                         got["state"], got["policies"], None, None, 5)
    blob = open(path, "rb").read()
    for why, bad in [
        ("is not signed, and an authenticity key is set", cf.encode(forged)),
        ("does not match the authenticity key", cf._head(cf.KEYED, len(forged)) + hashlib.sha256(
            cf._head(cf.KEYED, len(forged)) + forged).digest() + forged),  # flag kept, SHA-256
        ("does not match the authenticity key", cf.encode(forged, "another key " * 4)),
    ]:
        with open(path, "wb") as f:
            f.write(bad)
        with pytest.raises(CheckpointError, match=f"the checkpoint {path} {why}"):
            _keyed(path, KEY).resume()
    with open(path, "wb") as f:
        f.write(blob)
    with pytest.raises(CheckpointError, match="is signed with an authenticity key, and none is "
                                              "set.*KUNGFU_CHECKPOINT_KEY"):
        _keyed(path, None).resume()
    with open(path, "wb") as f:  # no key anywhere: a recomputed SHA-256 passes
        f.write(cf.encode(forged))
    taken = _keyed(path, None)
    assert taken.resume() and taken.variables.values[0].tolist() == [99, 99, 99]


def test_a_checkpoint_key_must_be_strong(monkeypatch):
    from kungfu._loop import _checkpoint_key

    with pytest.raises(ValueError, match="the checkpoint key is too weak"):
        _checkpoint_key("secret")
    with pytest.raises(ValueError, match="at least 16"):
        _checkpoint_key(b"short")
    monkeypatch.setenv("KUNGFU_CHECKPOINT_KEY", KEY)
    assert _checkpoint_key(None) == KEY and _checkpoint_key(b"k" * 16) == b"k" * 16
    monkeypatch.setenv("KUNGFU_CHECKPOINT_KEY", "weak")
    with pytest.raises(ValueError, match="KUNGFU_CHECKPOINT_KEY is invalid: the checkpoint key"):
        _checkpoint_key(None)
