"""EtcdStore against a real etcd server (its v3 JSON gateway on loopback).

Starts the `etcd` binary from PATH (Debian's etcd-server package; scripts/install.sh tries to
install it) with its data in a temporary folder and its client and peer URLs on free loopback
ports, and checks EtcdStore the way test_store.py checks the builtin server. Each test works
under its own key prefix, so one etcd serves the whole module.
"""
from __future__ import annotations

import base64
import json
import os
import threading
import uuid

import pytest

from kungfu import store as st
from kungfu._ports import free_ports
from kungfu.store._etcd import _b64

from etcd_server import ETCD, Etcd, _post  # noqa: E402 - tests/, on the path (conftest.py)

if ETCD is None:
    pytest.skip("etcd is not on PATH (apt-get install etcd-server); skipping the EtcdStore tests "
                "against a real etcd", allow_module_level=True)

pytestmark = pytest.mark.timeout(120)

@pytest.fixture(scope="module")
def etcd(tmp_path_factory):
    server = Etcd(str(tmp_path_factory.mktemp("etcd")))
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


@pytest.fixture()
def client(etcd):
    # A prefix of its own per test: the tests share one etcd but no keys.
    return st.EtcdStore(etcd.client_url, prefix=f"kungfu-test-{uuid.uuid4().hex[:12]}/")


def test_compare_and_swap_and_revisions(client):
    assert client.get("a") == (None, 0)
    r1 = client.compare_and_swap("a", "x", 0)
    assert r1 > 0 and client.get("a") == ("x", r1)
    with pytest.raises(st.StaleWriteError):
        client.compare_and_swap("a", "y", 0)  # exists already
    assert client.get("a") == ("x", r1)
    r2 = client.compare_and_swap("a", "y", r1)
    assert r2 > r1 and client.get("a") == ("y", r2)
    with pytest.raises(st.StaleWriteError):
        client.compare_and_swap("a", "z", r1)  # stale
    assert client.get("a") == ("y", r2)  # value and revision unchanged
    r3 = client.put("a", "w")  # an unconditional put moves the revision on
    assert r3 > r2 and client.get("a") == ("w", r3)
    with pytest.raises(st.StaleWriteError):
        client.compare_and_swap("a", "v", r2)
    assert client.get("a") == ("w", r3)


def test_list_by_prefix(client):
    client.put("p/1", "one")
    client.put("p/2", "two")
    client.put("p/sub/3", "three")
    client.put("q", "no")
    client.put("p0", "no")  # "p0" is the range end of "p/": not in it
    client.put("p", "no")
    assert client.list("p/") == {"p/1": "one", "p/2": "two", "p/sub/3": "three"}
    assert client.list("p/s") == {"p/sub/3": "three"}
    assert client.list("nothing/") == {}
    assert client.list("") == {"p/1": "one", "p/2": "two", "p/sub/3": "three", "q": "no",
                               "p0": "no", "p": "no"}


def test_config_versions_follow_one_another(client):
    assert client.config() == (None, 0)
    c0 = st.ClusterConfig(0, ["127.0.0.1:10000", "127.0.0.1:10001"])
    assert client.propose(c0)
    assert client.config()[0] == c0
    assert not client.propose(st.ClusterConfig(2, ["127.0.0.1:10000"]))  # skips a version
    assert not client.propose(c0)  # v0 again
    assert client.config()[0] == c0
    c1 = st.ClusterConfig(1, ["127.0.0.1:10000"])
    assert client.propose(c1) and client.config()[0] == c1
    rev = client.config()[1]
    # A well-formed v2 against a stale revision loses.
    c2 = st.ClusterConfig(2, ["127.0.0.1:10000", "127.0.0.1:10002"])
    with pytest.raises(st.StaleWriteError):
        client.compare_and_swap(st.CONFIG_KEY, c2.to_json(), rev - 1)
    assert client.config() == (c1, rev)
    with pytest.raises(st.StoreError):
        client.put(st.CONFIG_KEY, c2.to_json())  # only compare-and-swap writes the config
    assert client.config() == (c1, rev)


def test_malformed_config_writes_are_refused(client):
    c0 = st.ClusterConfig(0, ["127.0.0.1:10000"])
    assert client.propose(c0)
    rev = client.config()[1]
    for bad in ("not json", '{"version": 1}', '{"version": 1, "peers": ["nohost"]}',
                '{"version": 1, "peers": ["a:1", "a:1"]}', '{"version": 1, "peers": []}',
                '{"version": 5, "peers": ["a:1"]}', '{"version": 0, "peers": ["a:1"]}',
                '{"version": -1, "peers": ["a:1"]}', '{"version": true, "peers": ["a:1"]}'):
        with pytest.raises((ValueError, st.StoreError)) as e:
            client.compare_and_swap(st.CONFIG_KEY, bad, rev)
        assert not isinstance(e.value, st.StaleWriteError), bad
        assert client.config() == (c0, rev), bad  # nothing half-applied
    # Before any config: the first one must be a well-formed version 0.
    fresh = st.EtcdStore(client.url, prefix=client.prefix + "fresh/")
    for bad in ('{"version": 1, "peers": ["a:1"]}', "[]"):
        with pytest.raises((ValueError, st.StoreError)):
            fresh.compare_and_swap(st.CONFIG_KEY, bad, 0)
        assert fresh.config() == (None, 0)


def test_racing_proposals_have_one_winner(client):
    assert client.propose(st.ClusterConfig(0, ["127.0.0.1:1"]))
    outcomes = []
    lock = threading.Lock()
    go = threading.Event()

    def propose(n):
        peers = [f"127.0.0.1:{i + 1}" for i in range(n)]
        go.wait(10)
        try:
            result = client.propose(st.ClusterConfig(1, peers))
        except Exception as e:  # recorded: a racing proposal must lose, not raise
            result = e
        with lock:
            outcomes.append((n, result))

    threads = [threading.Thread(target=propose, args=(n,)) for n in range(2, 10)]
    for t in threads:
        t.start()
    go.set()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)
    errors = [(n, r) for n, r in outcomes if not isinstance(r, bool)]
    assert not errors, f"proposals raised instead of losing: {errors}"
    winners = [n for n, ok in outcomes if ok]
    assert len(outcomes) == 8 and len(winners) == 1, outcomes
    cfg = client.config()[0]
    assert cfg.version == 1 and len(cfg.peers) == winners[0]


def test_ready_markers(client):
    client.mark_ready(3, "127.0.0.1:10002")
    client.mark_ready(3, "127.0.0.1:10003")
    client.mark_ready(4, "127.0.0.1:10004")
    client.mark_ready(33, "127.0.0.1:10005")  # "ready/33/" is not under "ready/3/"
    assert client.ready_peers(3) == ["127.0.0.1:10002", "127.0.0.1:10003"]
    assert client.ready_peers(4) == ["127.0.0.1:10004"]
    assert client.ready_peers(5) == []


def test_connect_etcd_url(etcd):
    store = st.connect(f"etcd://{etcd.host_port}")
    assert isinstance(store, st.EtcdStore)
    assert store.url == etcd.client_url and store.prefix == "kungfu/"
    assert store.config() == (None, 0)
    c0 = st.ClusterConfig(0, ["127.0.0.1:10000", "127.0.0.1:10001"])
    assert store.propose(c0)
    cfg, rev = store.config()
    assert cfg == c0 and rev > 0
    # The config is really in etcd, under the default prefix, as the JSON the store wrote.
    raw = _post(etcd.client_url + "/v3/kv/range",
                {"key": base64.b64encode(b"kungfu/" + st.CONFIG_KEY.encode()).decode()})
    assert len(raw["kvs"]) == 1
    assert json.loads(base64.b64decode(raw["kvs"][0]["value"])) == {
        "version": 0, "peers": ["127.0.0.1:10000", "127.0.0.1:10001"]}
    assert int(raw["kvs"][0]["mod_revision"]) == rev
    # A second client of the same etcd sees it and moves it on.
    other = st.connect(f"etcd://{etcd.host_port}")
    c1 = st.ClusterConfig(1, ["127.0.0.1:10000"])
    assert other.propose(c1)
    assert store.config()[0] == c1
    store.mark_ready(1, "127.0.0.1:10000")
    assert other.ready_peers(1) == ["127.0.0.1:10000"]


def test_unreachable_etcd():
    port, = free_ports(1)
    with pytest.raises(st.StoreError, match="cannot reach"):
        st.connect(f"etcd://127.0.0.1:{port}").get("x")


def test_garbage_written_straight_into_etcd_is_a_store_error(etcd, client):
    # The probe: `{not json` put at kungfu/cluster/config around kungfu crashed the launcher.
    _post(etcd.client_url + "/v3/kv/put", {"key": _b64(client.prefix + st.CONFIG_KEY),
                                           "value": _b64("{not json")})
    with pytest.raises(st.StoreError, match="no valid configuration"):
        client.config()


def test_user_and_password(tmp_path):
    server = Etcd(str(tmp_path))
    try:
        server.wait_ready()
        url = server.client_url
        for path, body in [("/v3/auth/user/add", {"name": "root", "password": "rootpw"}),
                           ("/v3/auth/role/add", {"name": "root"}),
                           ("/v3/auth/user/grant", {"user": "root", "role": "root"}),
                           ("/v3/auth/enable", {})]:
            _post(url + path, body)
        with pytest.raises(st.StoreError):
            st.EtcdStore(url).put("k", "v")  # no credentials: refused
        with pytest.raises(st.StoreError, match="refused user"):
            st.EtcdStore(url, user="root", password="wrong").put("k", "v")
        good = st.EtcdStore(url, user="root", password="rootpw")
        assert good.propose(st.ClusterConfig(0, ["127.0.0.1:1"]))
        assert good.config()[0].peers == ("127.0.0.1:1",)
        host = url[len("http://"):]
        via_url = st.connect(f"etcd://root:rootpw@{host}")
        assert via_url.config()[0].version == 0
        # From a file only its owner reads (the URL shows the password in ps): given, or named
        # by KUNGFU_ETCD_CREDENTIALS as kungfu-run -config-server-credentials tells workers.
        creds = tmp_path / "credentials"
        creds.write_text("root:rootpw\n")
        creds.chmod(0o600)
        via_file = st.connect(f"etcd://{host}", credentials=str(creds))
        assert via_file.config()[0].version == 0
        assert via_file.propose(st.ClusterConfig(1, ["127.0.0.1:2"]))
        os.environ["KUNGFU_ETCD_CREDENTIALS"] = str(creds)
        try:
            assert st.connect(f"etcd://{host}").config()[0].peers == ("127.0.0.1:2",)
            creds.write_text("root:wrong\n")
            with pytest.raises(st.StoreError, match="refused user 'root'"):
                st.connect(f"etcd://{host}").config()
        finally:
            del os.environ["KUNGFU_ETCD_CREDENTIALS"]
    finally:
        server.stop()
