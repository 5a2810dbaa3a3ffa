"""The builtin config store refuses strangers and bad requests, and EtcdStore survives garbage:
each case here was found by probing the store, and fails on the store before it was hardened."""
import http.client
import json
import secrets
import socket
import threading
import time

import pytest

from kungfu import store as st

pytestmark = pytest.mark.timeout(60)
TOKEN = secrets.token_hex(32)


@pytest.fixture
def server():
    s = st.ConfigServer("127.0.0.1", 0, token=TOKEN, idle_timeout=0.5).start()
    yield s
    s.stop()


def raw(server, method, path, body=b"", headers=None):
    host, port = server._server.server_address[:2]
    c = http.client.HTTPConnection(host, port, timeout=5)
    c.request(method, path, body=body, headers=headers or {})
    r = c.getresponse()
    data = r.read()
    c.close()
    return r.status, json.loads(data or b"{}")


def auth():
    return {"Authorization": f"Bearer {TOKEN}"}


def test_strangers_get_401_and_change_nothing(server):
    client = st.HTTPStore(server.url, token=TOKEN)
    assert client.propose(st.ClusterConfig(0, ["127.0.0.1:1000"]))
    body = json.dumps({"version": 1, "peers": ["127.0.0.1:1"]}).encode()
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
        code, reply = raw(server, "PUT", "/v1/kv/cluster%2Fconfig?revision=1", body, headers)
        assert code == 401 and "token" in reply["error"]
        assert raw(server, "GET", "/v1/kv/cluster%2Fconfig", headers=headers)[0] == 401
    assert client.config()[0].peers == ("127.0.0.1:1000",)
    with pytest.raises(st.StoreError, match="refused this client"):
        st.HTTPStore(server.url, token="wrong").config()


def test_hosts_must_be_names_or_addresses(server):
    for peer in ["  \u2603 ;rm -rf /:80", "a b:1", "$(x):2", "host/../x:3"]:
        body = json.dumps({"version": 0, "peers": [peer]}).encode()
        code, _ = raw(server, "PUT", "/v1/kv/cluster%2Fconfig?revision=0", body, auth())
        assert code == 400, peer
    ok = json.dumps({"version": 0, "peers": ["node-1.example.org:9", "10.0.0.2:9"]}).encode()
    assert raw(server, "PUT", "/v1/kv/cluster%2Fconfig?revision=0", ok, auth())[0] == 200


def test_deeply_nested_json_is_400_and_the_server_goes_on(server):
    code, _ = raw(server, "PUT", "/v1/kv/cluster%2Fconfig?revision=0", b"[" * 200000, auth())
    assert code == 400
    assert raw(server, "GET", "/v1/kv?prefix=", headers=auth())[0] == 200


def test_a_truncated_body_is_not_stored(server):
    host, port = server._server.server_address[:2]
    s = socket.create_connection((host, port))
    s.sendall(b"PUT /v1/kv/k5 HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + TOKEN.encode()
              + b"\r\nContent-Length: 100\r\n\r\nhello")
    s.shutdown(socket.SHUT_WR)
    s.recv(4096)
    s.close()
    for length in ("-1", "abc"):
        s = socket.create_connection((host, port))
        s.sendall(b"PUT /v1/kv/k3 HTTP/1.1\r\nAuthorization: Bearer " + TOKEN.encode()
                  + b"\r\nContent-Length: " + length.encode() + b"\r\n\r\nhello")
        assert b" 411 " in s.recv(4096)
        s.close()
    time.sleep(0.2)
    assert server.store.get("k5") == (None, 0)
    assert server.store.get("k3") == (None, 0)


def _read_until_closed(s):
    """The whole reply: headers and body may arrive in separate segments."""
    reply = b""
    while True:
        chunk = s.recv(4096)
        if not chunk:
            break
        reply += chunk
    s.close()
    return reply


def test_values_are_limited(server):
    host, port = server._server.server_address[:2]
    s = socket.create_connection((host, port))
    s.sendall(b"PUT /v1/kv/big HTTP/1.1\r\nAuthorization: Bearer " + TOKEN.encode()
              + f"\r\nContent-Length: {2 << 20}\r\n\r\n".encode())  # refused from the header alone
    s.settimeout(10)
    reply = _read_until_closed(s)
    assert b" 413 " in reply and str(st.MAX_VALUE_BYTES).encode() in reply
    assert server.store.get("big") == (None, 0)


def test_a_silent_client_is_dropped(server):
    host, port = server._server.server_address[:2]
    s = socket.create_connection((host, port))
    s.sendall(b"PUT /v1/kv/k HTTP/1.1\r\nContent-Length: 10\r\n")  # and then nothing
    s.settimeout(5)
    start = time.time()
    assert s.recv(4096) == b""  # closed by the server
    assert time.time() - start < 3
    s.close()


def test_concurrent_writers_see_no_resets(server):
    client = st.HTTPStore(server.url, token=TOKEN)
    errors = []

    def bump(i):
        c = st.HTTPStore(server.url, token=TOKEN)
        for _ in range(20):
            while True:
                try:
                    value, rev = c.get("counter")
                    c.compare_and_swap("counter", str(int(value or 0) + 1), rev)
                    break
                except st.StaleWriteError:
                    continue
                except st.StoreError as e:
                    errors.append(str(e))
                    return

    threads = [threading.Thread(target=bump, args=(i,)) for i in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert client.get("counter")[0] == "400"


def test_garbage_in_the_store_is_a_store_error():
    s = st.MemoryStore()
    s._data[st.CONFIG_KEY] = ("{not json", 1)  # as written straight into etcd, around kungfu
    with pytest.raises(st.StoreError, match="no valid configuration"):
        s.config()
