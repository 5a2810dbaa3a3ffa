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
    s = st.ConfigServer("127.0.0.1", 0, token=TOKEN, request_deadline=0.5).start()
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


def _trickle(sock, data, every, stop):
    """Sends `data` one byte every `every` seconds until done, closed or `stop` is set."""
    for i in range(len(data)):
        if stop.wait(every):
            return
        try:
            sock.send(data[i:i + 1])
        except OSError:
            return


def _closed_by_server(sock, within):
    """Whether the server closes the connection (or refuses it) within `within` seconds."""
    sock.settimeout(within)
    try:
        while sock.recv(4096):
            pass  # a refusal's 503, then the close
        return True
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False


def test_a_trickling_client_is_dropped_at_the_request_deadline():
    # The probe (4g): one byte every 5 s held a store thread for as long as the client liked
    # (each byte reset the per-read timeout). The deadline is for the whole request now.
    s = st.ConfigServer("127.0.0.1", 0, token=TOKEN, request_deadline=1.5).start()
    stop = threading.Event()
    try:
        host, port = s._server.server_address[:2]
        request = (b"PUT /v1/kv/k HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + TOKEN.encode()
                   + b"\r\nX-Pad: " + b"a" * 200 + b"\r\nContent-Length: 2\r\n\r\nhi")
        slow = socket.create_connection((host, port))
        sender = threading.Thread(target=_trickle, args=(slow, request, 0.2, stop))
        sender.start()  # 0.2 s apart: never silent for the 1.5 s; the whole takes 60 s
        t0 = time.monotonic()
        assert _closed_by_server(slow, 10)
        assert time.monotonic() - t0 < 5  # at the deadline, not at the end of the trickle
        slow.close()
        assert s.store.get("k") == (None, 0)
        assert st.HTTPStore(s.url, token=TOKEN).put("k2", "v") > 0  # the server goes on
    finally:
        stop.set()
        s.stop()


def test_connections_per_address_are_capped_and_the_job_goes_on():
    # Connections from 127.0.0.2 (a stranger trickling requests) beyond the cap are refused at
    # once; the job's clients, from 127.0.0.1, are served meanwhile, and once the stranger's
    # connections end its address may connect again.
    s = st.ConfigServer("127.0.0.1", 0, token=TOKEN, request_deadline=60,
                        max_per_address=4).start()
    stop = threading.Event()
    held = []
    try:
        host, port = s._server.server_address[:2]

        def stranger():
            c = socket.socket()
            c.bind(("127.0.0.2", 0))
            c.connect((host, port))
            return c

        for _ in range(4):
            held.append(stranger())
            held[-1].send(b"GET /v1/kv?prefix= HTTP/1.1\r\n")  # and then nothing more
        time.sleep(0.3)  # the four are being served (each on its thread)
        for c in held:
            assert not _closed_by_server(c, 0.05)  # held, not refused
        extra = stranger()
        assert _closed_by_server(extra, 5)  # refused at once
        extra.close()
        job = st.HTTPStore(s.url, token=TOKEN)
        assert job.propose(st.ClusterConfig(0, ["127.0.0.1:10000"]))
        assert job.config()[0].peers == ("127.0.0.1:10000",)
        for c in held:
            c.close()
        deadline = time.monotonic() + 10
        while True:  # the server sees the closes and frees the address's connections
            again = stranger()
            again.sendall(b"GET /v1/kv/cluster%2Fconfig HTTP/1.0\r\nAuthorization: Bearer "
                          + TOKEN.encode() + b"\r\n\r\n")
            again.settimeout(5)
            try:
                reply = again.recv(4096)
            except ConnectionResetError:
                reply = b""
            again.close()
            if b" 200 " in reply or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert b" 200 " in reply, reply
    finally:
        stop.set()
        for c in held:
            c.close()
        s.stop()


def _credentials(tmp_path, text, mode=0o600):
    path = tmp_path / "etcd.credentials"
    path.write_text(text)
    path.chmod(mode)
    return str(path)


def test_etcd_credentials_come_from_a_file_only_its_owner_reads(tmp_path, monkeypatch):
    # The probe (3g): etcd://USER:PASSWORD@... put the password in every local user's ps.
    monkeypatch.delenv("KUNGFU_ETCD_CREDENTIALS", raising=False)
    path = _credentials(tmp_path, "alice:S3cret:PW\n")  # the password may hold ':'
    assert st.read_credentials(path) == ("alice", "S3cret:PW")
    s = st.connect("etcd://127.0.0.1:2379", credentials=path)
    assert (s._user, s._password, s.url) == ("alice", "S3cret:PW", "http://127.0.0.1:2379")
    monkeypatch.setenv("KUNGFU_ETCD_CREDENTIALS", path)  # how workers get it
    s = st.connect("etcds://127.0.0.1:2379")
    assert (s._user, s._password, s.url) == ("alice", "S3cret:PW", "https://127.0.0.1:2379")
    with pytest.raises(ValueError, match="given twice"):
        st.connect("etcd://bob:pw@127.0.0.1:2379")
    monkeypatch.delenv("KUNGFU_ETCD_CREDENTIALS")
    for mode in (0o644, 0o640, 0o604, 0o620):
        with pytest.raises(ValueError, match=f"open to other users \\(mode 0{mode:o}\\): chmod 600"):
            st.read_credentials(_credentials(tmp_path, "alice:pw", mode))
    with pytest.raises(ValueError, match="is empty"):
        st.read_credentials(_credentials(tmp_path, "", 0o600))
    for bad in ("alice", "alice:", ":pw", "alice:pw\nbob:pw"):
        with pytest.raises(ValueError, match="must hold USER:PASSWORD") as e:
            st.read_credentials(_credentials(tmp_path, bad))
        assert "pw" not in str(e.value).replace(str(tmp_path), "")
    with pytest.raises(ValueError, match="cannot read"):
        st.read_credentials(str(tmp_path / "missing"))


def test_a_password_in_the_url_still_works_and_is_never_shown():
    s = st.connect("etcd://alice:S3cret%40PW@127.0.0.1:2379")
    assert (s._user, s._password) == ("alice", "S3cret@PW")
    assert st.url_password("etcd://alice:S3cret%40PW@h:1") == ("alice", "S3cret@PW")
    assert st.url_password("etcd://alice@h:1") is None and st.url_password("http://a:b@h:1") is None
    assert st.shown_url("etcd://alice:S3cret%40PW@h:1") == "etcd://alice:***@h:1"
    assert st.shown_url("etcds://h:1") == "etcds://h:1"


def test_the_config_server_takes_its_token_only_from_a_private_file(tmp_path, monkeypatch, capsys):
    # Probe 3, 4i: --token-file with mode 0644 was taken without a word; the secret in it is
    # every local user's.
    import secrets

    from kungfu import store

    monkeypatch.delenv("KUNGFU_JOB_TOKEN", raising=False)
    token = secrets.token_hex(32)
    path = tmp_path / "token"
    path.write_text(token + "\n")
    path.chmod(0o644)
    with pytest.raises(SystemExit) as e:
        store.server_main(["--port", "0", "--token-file", str(path)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "open to other users" in err and "chmod 600" in err and token not in err
    path.write_text("\n")
    path.chmod(0o600)
    with pytest.raises(SystemExit) as e:
        store.server_main(["--port", "0", "--token-file", str(path)])
    assert e.value.code == 2 and "is empty" in capsys.readouterr().err
