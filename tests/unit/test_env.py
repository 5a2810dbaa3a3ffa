"""kungfu._env (durations, variable parsing) and worker identity from the environment."""
import os

import pytest

from kungfu import _env
from kungfu._peer import identity_from_env

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize("text,seconds", [
    ("90", 90.0), ("0", 0.0), ("2.5", 2.5), ("90s", 90.0), ("1.5m", 90.0), ("500ms", 0.5),
    ("2h", 7200.0), ("1m30s", 90.0), ("1h30m", 5400.0), ("1h2m3s4ms", 3723.004),
    (" 10S ", 10.0), ("0.25s", 0.25), ("10m0s", 600.0),
])
def test_parse_duration(text, seconds):
    assert _env.parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", [
    "", " ", "abc", "10x", "s", "ms", "-5s", "-5", "1m 30s", "1.5.2s", "5 s", "1e3", "10sec",
    "s10", "1m30", "++1s",
])
def test_parse_duration_rejects(text):
    with pytest.raises(ValueError) as e:
        _env.parse_duration(text)
    assert repr(text) in str(e.value)


def test_var_default_when_unset_or_empty():
    v = _env.Var("KUNGFU_TEST_X", int, 7, "a test variable")
    assert v.get({}) == 7
    assert v.get({"KUNGFU_TEST_X": ""}) == 7
    assert v.get({"KUNGFU_TEST_X": "12"}) == 12
    assert v.get({"OTHER": "3"}) == 7


def test_var_reads_os_environ_by_default(monkeypatch):
    monkeypatch.setenv("KUNGFU_PEER_TIMEOUT", "1m")
    assert _env.PEER_TIMEOUT.get() == 60.0
    monkeypatch.delenv("KUNGFU_PEER_TIMEOUT")
    assert _env.PEER_TIMEOUT.get() == 10.0


@pytest.mark.parametrize("var,raw", [
    (_env.OP_TIMEOUT, "soon"), (_env.OP_TIMEOUT, "0s"), (_env.OP_TIMEOUT, "-1"),
    (_env.PEER_TIMEOUT, "0"), (_env.CONNECT_TIMEOUT, "10 minutes"),
    (_env.CHUNK_BYTES, "0"), (_env.CHUNK_BYTES, "-5"), (_env.CHUNK_BYTES, "1MB"),
    (_env.CHUNK_BYTES, "1.5"), (_env.PARALLELISM, "two"), (_env.PARALLELISM, "0"),
    (_env.INIT_CLUSTER_VERSION, "v1"),
])
def test_var_parse_errors_name_the_variable(var, raw):
    with pytest.raises(ValueError) as e:
        var.get({var.name: raw})
    msg = str(e.value)
    assert var.name in msg and repr(raw) in msg, msg


@pytest.mark.parametrize("var,raw,value", [
    (_env.OP_TIMEOUT, "1s", 1.0), (_env.OP_TIMEOUT, "2m", 120.0),
    (_env.CONNECT_TIMEOUT, "45", 45.0), (_env.CHUNK_BYTES, "4096", 4096),
    (_env.PARALLELISM, "4", 4), (_env.INIT_CLUSTER_VERSION, "3", 3),
    (_env.ALLREDUCE_STRATEGY, "RING", "RING"),
])
def test_var_parses(var, raw, value):
    assert var.get({var.name: raw}) == value


def test_declared_defaults():
    d = {v.name: v.default for v in _env.ALL}
    assert d["KUNGFU_OP_TIMEOUT"] == 300.0
    assert d["KUNGFU_PEER_TIMEOUT"] == 10.0
    assert d["KUNGFU_CONNECT_TIMEOUT"] == 120.0
    assert d["KUNGFU_ALLREDUCE_STRATEGY"] == "AUTO"
    assert d["KUNGFU_INIT_CLUSTER_VERSION"] == 0
    assert d["KUNGFU_SELF_SPEC"] is None


def test_every_variable_is_declared_once_with_a_doc():
    names = [v.name for v in _env.ALL]
    assert len(names) == len(set(names))
    for v in _env.ALL:
        assert v.name.startswith("KUNGFU_") and v.doc.strip(), v
    for required in ("KUNGFU_SELF_SPEC", "KUNGFU_INIT_PEERS", "KUNGFU_INIT_CLUSTER_VERSION",
                     "KUNGFU_ALLREDUCE_STRATEGY", "KUNGFU_OP_TIMEOUT", "KUNGFU_PEER_TIMEOUT",
                     "KUNGFU_CONNECT_TIMEOUT", "KUNGFU_CHUNK_BYTES", "KUNGFU_PARALLELISM"):
        assert required in names


# -- identity ----------------------------------------------------------------------------------

def test_identity_without_environment_is_rank_0_of_1():
    ident = identity_from_env({})
    assert (ident.rank, ident.size, ident.local_rank, ident.local_size) == (0, 1, 0, 1)
    assert ident.self_spec is None and ident.version == 0


def test_identity_one_host():
    peers = [f"127.0.0.1:{10000 + i}" for i in range(4)]
    for r, p in enumerate(peers):
        ident = identity_from_env({"KUNGFU_SELF_SPEC": p, "KUNGFU_INIT_PEERS": ",".join(peers)})
        assert (ident.rank, ident.size, ident.local_rank, ident.local_size) == (r, 4, r, 4)
        assert ident.peers == peers


def test_identity_two_hosts_interleaved():
    # Host A holds ranks 0, 1, 4; host B holds ranks 2, 3.
    peers = ["10.0.0.1:9000", "10.0.0.1:9001", "10.0.0.2:9000", "10.0.0.2:9001",
             "10.0.0.1:9002"]
    want = {  # rank: (local_rank, local_size)
        0: (0, 3), 1: (1, 3), 2: (0, 2), 3: (1, 2), 4: (2, 3),
    }
    for r, p in enumerate(peers):
        env = {"KUNGFU_SELF_SPEC": p, "KUNGFU_INIT_PEERS": ",".join(peers),
               "KUNGFU_INIT_CLUSTER_VERSION": "2"}
        ident = identity_from_env(env)
        assert ident.rank == r and ident.size == 5
        assert (ident.local_rank, ident.local_size) == want[r], (r, p)
        assert ident.version == 2


def test_identity_from_worker_env_round_trip():
    peers = ["10.0.0.1:1", "10.0.0.2:1", "10.0.0.1:2"]
    env = _env.worker_env(peers[2], peers, 5, "RING")
    assert env == {"KUNGFU_SELF_SPEC": "10.0.0.1:2", "KUNGFU_INIT_PEERS": ",".join(peers),
                   "KUNGFU_INIT_CLUSTER_VERSION": "5", "KUNGFU_ALLREDUCE_STRATEGY": "RING",
                   "RANK": "2", "WORLD_SIZE": "3", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    ident = identity_from_env(env)
    assert (ident.rank, ident.size, ident.local_rank, ident.local_size, ident.version) == \
        (2, 3, 1, 2, 5)


def test_identity_self_not_in_peers():
    with pytest.raises(ValueError) as e:
        identity_from_env({"KUNGFU_SELF_SPEC": "127.0.0.1:5",
                           "KUNGFU_INIT_PEERS": "127.0.0.1:1,127.0.0.1:2"})
    assert "127.0.0.1:5" in str(e.value) and "KUNGFU_SELF_SPEC" in str(e.value)


def test_identity_self_only():
    ident = identity_from_env({"KUNGFU_SELF_SPEC": "127.0.0.1:7"})
    assert (ident.rank, ident.size, ident.local_rank, ident.local_size) == (0, 1, 0, 1)


def test_identity_bad_version():
    with pytest.raises(ValueError, match="KUNGFU_INIT_CLUSTER_VERSION"):
        identity_from_env({"KUNGFU_SELF_SPEC": "h:1", "KUNGFU_INIT_PEERS": "h:1,h:2",
                           "KUNGFU_INIT_CLUSTER_VERSION": "x"})


def test_set_worker_env_joining_spare_and_unchanged():
    """worker_env/set_worker_env, the one writer of a worker's identity: joining=True sets
    KUNGFU_ELASTIC_JOINING, False removes a stale one, None (a worker switching clusters)
    leaves it and the strategy as they were; NO_IDENTITY (a warm spare) removes every one."""
    peers = ["127.0.0.1:1", "127.0.0.1:2"]
    stale = {"RANK": "7", "WORLD_SIZE": "9", "KUNGFU_ELASTIC_JOINING": "1",
             "KUNGFU_ALLREDUCE_STRATEGY": "STAR", "OTHER": "x"}
    env = dict(stale)
    _env.set_worker_env(env, _env.worker_env(peers[1], peers, 3, "RING", joining=False))
    assert env["RANK"] == "1" and env["WORLD_SIZE"] == "2" and env["LOCAL_RANK"] == "1"
    assert "KUNGFU_ELASTIC_JOINING" not in env and env["KUNGFU_ALLREDUCE_STRATEGY"] == "RING"
    env = dict(stale)
    _env.set_worker_env(env, _env.worker_env(peers[0], peers, 4))
    assert (env["RANK"], env["KUNGFU_INIT_CLUSTER_VERSION"]) == ("0", "4")
    assert env["KUNGFU_ELASTIC_JOINING"] == "1" and env["KUNGFU_ALLREDUCE_STRATEGY"] == "STAR"
    _env.set_worker_env(env, _env.NO_IDENTITY)
    assert not set(env) & set(_env.IDENTITY_VARS) and env["OTHER"] == "x"


@pytest.fixture
def environ_restored():
    """os.environ as it was before the test, afterwards: what the code under test writes there
    itself (monkeypatch restores only what it set or removed) does not reach later tests."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def test_a_taken_spare_gets_worker_env(monkeypatch, environ_restored):
    """A warm spare's identity (one JSON line on its socket) goes into os.environ through
    set_worker_env: a null removes a variable the spare inherited; the listening socket sent
    with it becomes KUNGFU_LISTEN_FD, the one its peer listens on."""
    import json
    import socket

    from kungfu import _peer, _spare

    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    peers = ["127.0.0.1:1", f"127.0.0.1:{held.getsockname()[1]}"]
    sent = _env.worker_env(peers[1], peers, 2, "RING", joining=True)
    sent["LOCAL_WORLD_SIZE"] = None
    ours, theirs = socket.socketpair()
    line = (json.dumps(sent) + "\n").encode()
    socket.send_fds(ours, [line[:5]], [held.fileno()])  # the rest comes in another write
    ours.sendall(line[5:])
    ours.close()
    held.close()  # the spare's copy keeps the socket
    monkeypatch.setenv("KUNGFU_SPARE_FD", str(theirs.detach()))  # wait() closes it
    monkeypatch.delenv("KUNGFU_LISTEN_FD", raising=False)
    monkeypatch.setattr(_peer, "_listener", None)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "5")
    for name in ("KUNGFU_SELF_SPEC", "KUNGFU_INIT_PEERS", "KUNGFU_INIT_CLUSTER_VERSION",
                 "KUNGFU_ELASTIC_JOINING", "KUNGFU_ALLREDUCE_STRATEGY", "RANK", "WORLD_SIZE",
                 "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(_spare, "_assigned", False)
    _spare.wait()
    assert {k: os.environ.get(k) for k in sent} == sent
    assert "KUNGFU_SPARE_FD" not in os.environ
    fd = _peer.listen_fd(peers[1])
    assert fd >= 0 and fd == int(os.environ["KUNGFU_LISTEN_FD"])
    assert _peer.listen_fd(peers[0]) == -1  # another address: not its socket
    with socket.socket(fileno=fd):
        with socket.create_connection(("127.0.0.1", int(peers[1].split(":")[1]))):
            pass  # it still listens: the spare's descriptor is the socket the launcher held
    monkeypatch.setattr(_peer, "_listener", None)


def test_only_env_writes_a_workers_identity():
    """No module but kungfu/_env.py writes an identity variable into an environment: the
    launcher, the elastic launcher, its spares and a worker's own switch call set_worker_env."""
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parents[2] / "kungfu"
    names = "|".join(re.escape(n) for n in _env.IDENTITY_VARS)
    write = re.compile(r"(environ|env)\[[^\]]*(SELF_SPEC|INIT_PEERS|INIT_CLUSTER_VERSION|"
                       r"ELASTIC_JOINING|STANDARD_RANK_VARS|IDENTITY_VARS|" + names + r")"
                       r"|environ\.update\(|env\.update\(_env\.worker_env|"
                       r"\{_env\.ELASTIC_JOINING\.name")
    found = [f"{p.relative_to(root.parent)}:{n}: {line.strip()}"
             for p in sorted(root.rglob("*.py")) if p.name != "_env.py"
             for n, line in enumerate(p.read_text().splitlines(), 1) if write.search(line)]
    assert found == [], "\n".join(found)
