"""The config store: the builtin HTTP server and its client (real HTTP on loopback)."""
from __future__ import annotations

import threading

import pytest

from kungfu import store as st


@pytest.fixture()
def client():
    server = st.ConfigServer("127.0.0.1", 0).start()
    yield st.connect(server.url)
    server.stop()


def test_compare_and_swap_and_revisions(client):
    assert client.get("a") == (None, 0)
    r1 = client.compare_and_swap("a", "x", 0)
    assert client.get("a") == ("x", r1)
    with pytest.raises(st.StaleWriteError):
        client.compare_and_swap("a", "y", 0)  # exists already
    r2 = client.compare_and_swap("a", "y", r1)
    assert r2 > r1 and client.get("a") == ("y", r2)
    with pytest.raises(st.StaleWriteError):
        client.compare_and_swap("a", "z", r1)  # stale
    assert client.get("a") == ("y", r2)
    client.put("p/1", "one")
    client.put("p/2", "two")
    client.put("q", "no")
    assert client.list("p/") == {"p/1": "one", "p/2": "two"}


def test_config_versions_follow_one_another(client):
    assert client.config() == (None, 0)
    c0 = st.ClusterConfig(0, ["127.0.0.1:10000", "127.0.0.1:10001"])
    assert client.propose(c0)
    assert client.config()[0] == c0
    assert not client.propose(st.ClusterConfig(2, ["127.0.0.1:10000"]))  # skips a version
    assert not client.propose(c0)  # v0 again
    c1 = st.ClusterConfig(1, ["127.0.0.1:10000"])
    assert client.propose(c1) and client.config()[0] == c1
    # Written around propose(): the server itself rejects malformed and out-of-order configs.
    rev = client.config()[1]
    for bad in ("not json", '{"version": 2}', '{"version": 2, "peers": ["nohost"]}',
                '{"version": 2, "peers": ["a:1", "a:1"]}', '{"version": 5, "peers": ["a:1"]}',
                '{"version": -1, "peers": ["a:1"]}'):
        with pytest.raises(st.StoreError) as e:
            client.compare_and_swap(st.CONFIG_KEY, bad, rev)
        assert not isinstance(e.value, st.StaleWriteError), bad
    assert client.config() == (c1, rev)  # nothing half-applied
    with pytest.raises(st.StoreError):
        client.put(st.CONFIG_KEY, c1.to_json())  # only compare-and-swap writes the config


def test_racing_proposals_have_one_winner(client):
    client.propose(st.ClusterConfig(0, ["127.0.0.1:1"]))
    wins = []

    def propose(n):
        peers = [f"127.0.0.1:{i + 1}" for i in range(n)]
        wins.append((n, client.propose(st.ClusterConfig(1, peers))))

    threads = [threading.Thread(target=propose, args=(n,)) for n in range(2, 10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [n for n, ok in wins if ok]
    assert len(winners) == 1
    assert len(client.config()[0].peers) == winners[0]


def test_ready_markers(client):
    client.mark_ready(3, "127.0.0.1:10002")
    client.mark_ready(3, "127.0.0.1:10003")
    client.mark_ready(4, "127.0.0.1:10004")
    assert client.ready_peers(3) == ["127.0.0.1:10002", "127.0.0.1:10003"]


def test_bad_urls_and_unreachable_store():
    with pytest.raises(ValueError, match="http://, etcd:// or etcds://"):
        st.connect("ftp://x")
    with pytest.raises(st.StoreError, match="cannot reach"):
        st.connect("http://127.0.0.1:9").get("x")
    with pytest.raises(ValueError):
        st.ClusterConfig(0, [])


def test_standalone_server_process():
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        number = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-c", "import sys; from kungfu.store import "
                             "server_main; sys.exit(server_main(sys.argv[1:]))", "--port",
                             str(number)], stdout=subprocess.PIPE, text=True)
    try:
        assert "serving http://127.0.0.1:" in proc.stdout.readline()
        client = st.connect(f"http://127.0.0.1:{number}")
        assert client.propose(st.ClusterConfig(0, ["127.0.0.1:1"]))
        assert client.config()[0].peers == ("127.0.0.1:1",)
    finally:
        proc.terminate()
        assert proc.wait(timeout=10) == 0


def test_recovery_keys(client):
    """What survivors and launchers write in a recovery (kungfu/elastic/_protocol.py, Elastic.recover)."""
    client.mark_alive(3, "h:1", 17)
    client.mark_alive(3, "h:2", 16)
    assert client.alive_peers(3) == {"h:1": 17, "h:2": 16} and client.alive_peers(4) == {}
    client.mark_dead("h:3", 2)
    assert client.dead_peers() == {"h:3": 2}
    client.mark_dead("h:3", -1)  # a new worker started there: no longer dead
    assert client.dead_peers() == {}
    assert client.recoveries() == 0 and client.recovery(3) is None
    assert client.decide_recovery(3, "first") == "first"
    assert client.decide_recovery(3, "second") == "first"  # the first decision stands
    assert client.recovery(3) == "first" and client.recoveries() == 1


def test_racing_recovery_decisions_agree(client):
    got = []
    threads = [threading.Thread(target=lambda i=i: got.append(client.decide_recovery(9, f"d{i}")))
               for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 8 and len(set(got)) == 1


def test_cooling_hosts(client):
    client.cool_down("a", 1000.0)
    client.cool_down("b", 2000.0)
    client.put(st.COOLDOWN_PREFIX + "junk", "soon")  # unreadable: ignored
    assert client.cooling_hosts(500.0) == {"a": 1000.0, "b": 2000.0}
    assert client.cooling_hosts(1000.0) == {"b": 2000.0}  # until is exclusive
    assert client.cooling_hosts(2500.0) == {}
    client.cool_down("a", 3000.0)  # a later cool-down replaces the earlier one
    assert client.cooling_hosts(2500.0) == {"a": 3000.0}


@pytest.mark.parametrize("path", ["/config", "/config/"])
def test_kungfus_config_url_reaches_the_same_store(path):
    """KungFu's launch line gives the builtin server's cluster path; the client drops it."""
    server = st.ConfigServer("127.0.0.1", 0).start()
    try:
        kungfu_form = st.connect(server.url + path)
        assert kungfu_form.propose(st.ClusterConfig(0, ["127.0.0.1:10000"]))
        assert st.connect(server.url).config()[0] == st.ClusterConfig(0, ["127.0.0.1:10000"])
        kungfu_form.put("k", "v")
        assert st.connect(server.url).get("k")[0] == "v"
    finally:
        server.stop()
