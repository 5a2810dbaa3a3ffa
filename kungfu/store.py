"""Versioned cluster configurations with compare-and-swap, behind one interface.

    store = kungfu.store.connect("http://127.0.0.1:9100")      # kungfu-run's builtin server
    store = kungfu.store.connect("etcd://10.0.0.1:2379")        # etcd v3, through its JSON gateway
    cfg = store.config()                                        # ClusterConfig(version, peers)
    store.propose(ClusterConfig(cfg.version + 1, peers))        # False if someone was first

A `Store` holds keys with string values and a revision per key (0: absent). `compare_and_swap`
writes only if the key's revision is still the one the caller read. The cluster configuration
lives under CONFIG_KEY; `propose` accepts only version v + 1 over a stored v, so two proposers
race and exactly one wins. Workers that are ready for a version put "ready/<version>/<peer>".

Backends: `ConfigServer` (an HTTP server kungfu-run hosts with -builtin-config-port, or
`kungfu-config-server`) with `HTTPStore` as its client, and `EtcdStore` (etcd v3's JSON gateway,
/v3/kv/range and /v3/kv/txn; no client library). The server checks every write to the config key:
a malformed configuration (bad JSON, bad peers, a version other than the stored one + 1) gets
400 and a stale revision 409; nothing is half-applied. Every request has a deadline.
"""
from __future__ import annotations

import base64
import json
import threading
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Dict, List, Optional, Tuple

CONFIG_KEY = "cluster/config"
READY_PREFIX = "cluster/ready/"
DONE_KEY = "cluster/done"  # written when training has finished (the launchers may exit)
REQUEST_TIMEOUT = 5.0  # seconds


class StoreError(RuntimeError):
    """The store refused a request or could not be reached."""


class StaleWriteError(StoreError):
    """A compare-and-swap lost: the key changed since it was read."""


@dataclass(frozen=True)
class ClusterConfig:
    version: int
    peers: Tuple[str, ...]

    def __post_init__(self):
        object.__setattr__(self, "peers", tuple(self.peers))
        check_config(self)

    def to_json(self) -> str:
        return json.dumps({"version": self.version, "peers": list(self.peers)})

    @staticmethod
    def from_json(text: str) -> "ClusterConfig":
        try:
            d = json.loads(text)
            return ClusterConfig(d["version"], d["peers"])
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"malformed cluster configuration {text[:200]!r}: {e}") from None


def check_config(c: ClusterConfig) -> None:
    if isinstance(c.version, bool) or not isinstance(c.version, int) or c.version < 0:
        raise ValueError(f"cluster version must be an integer >= 0, got {c.version!r}")
    if not c.peers:
        raise ValueError("a cluster configuration needs at least one peer")
    for p in c.peers:
        host, _, port = p.rpartition(":") if isinstance(p, str) else ("", "", "")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"peer {p!r} is not host:port")
    if len(set(c.peers)) != len(c.peers):
        raise ValueError(f"peers are listed twice in {list(c.peers)}")


def ready_key(version: int, peer: str) -> str:
    return f"{READY_PREFIX}{version}/{peer}"


class Store:
    """Keys with string values and revisions (0: absent). Backends implement the first four."""

    def get(self, key: str) -> Tuple[Optional[str], int]:
        raise NotImplementedError

    def compare_and_swap(self, key: str, value: str, revision: int) -> int:
        """Writes if the key's revision is `revision` (0: absent); returns the new revision,
        raises StaleWriteError otherwise."""
        raise NotImplementedError

    def put(self, key: str, value: str) -> int:
        raise NotImplementedError

    def list(self, prefix: str) -> Dict[str, str]:
        raise NotImplementedError

    # -- cluster configuration --------------------------------------------------------------

    def config(self) -> Tuple[Optional[ClusterConfig], int]:
        """The stored configuration and its revision ((None, 0) before the first)."""
        value, rev = self.get(CONFIG_KEY)
        return (None if value is None else ClusterConfig.from_json(value)), rev

    def propose(self, new: ClusterConfig) -> bool:
        """Stores `new` if the stored version is new.version - 1 (or nothing is stored and
        new.version is 0); False if another proposal won."""
        current, rev = self.config()
        expected = -1 if current is None else current.version
        if new.version != expected + 1:
            return False
        try:
            self.compare_and_swap(CONFIG_KEY, new.to_json(), rev)
        except StaleWriteError:
            return False
        return True

    def mark_ready(self, version: int, peer: str) -> None:
        self.put(ready_key(version, peer), "1")

    def ready_peers(self, version: int) -> List[str]:
        prefix = f"{READY_PREFIX}{version}/"
        return sorted(k[len(prefix):] for k in self.list(prefix))


# -- the builtin server --------------------------------------------------------------------------

class MemoryStore(Store):
    """The builtin server's data, in memory; usable directly in one process."""

    def __init__(self):
        self._lock = threading.Lock()
        self._data: Dict[str, Tuple[str, int]] = {}
        self._revision = 0

    def get(self, key):
        with self._lock:
            value, rev = self._data.get(key, (None, 0))
            return value, rev

    def compare_and_swap(self, key, value, revision):
        with self._lock:
            current = self._data.get(key, (None, 0))[1]
            if current != revision:
                raise StaleWriteError(f"{key}: revision {current}, not {revision}")
            if key == CONFIG_KEY:
                _check_config_write(self._data.get(key, (None, 0))[0], value)
            self._revision += 1
            self._data[key] = (value, self._revision)
            return self._revision

    def put(self, key, value):
        if key == CONFIG_KEY:
            raise StoreError("the cluster configuration is written with compare_and_swap only")
        with self._lock:
            self._revision += 1
            self._data[key] = (value, self._revision)
            return self._revision

    def list(self, prefix):
        with self._lock:
            return {k: v for k, (v, _) in self._data.items() if k.startswith(prefix)}


def _check_config_write(old: Optional[str], new: str) -> None:
    cfg = ClusterConfig.from_json(new)  # ValueError: malformed
    want = 0 if old is None else ClusterConfig.from_json(old).version + 1
    if cfg.version != want:
        raise ValueError(f"cluster version {cfg.version} cannot follow "
                         f"{'nothing' if old is None else want - 1}: expected {want}")


class ConfigServer:
    """An HTTP server over a MemoryStore: GET/PUT /v1/kv/<key>[?revision=R], GET /v1/kv?prefix=P.

    PUT with ?revision=R is a compare-and-swap (409 when stale); 400 for a malformed write."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0):
        self.store = MemoryStore()
        store = self.store

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def _reply(self, code: int, body: dict):
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _key(self):
                url = urllib.parse.urlparse(self.path)
                q = urllib.parse.parse_qs(url.query)
                if url.path == "/v1/kv":
                    return None, q
                if not url.path.startswith("/v1/kv/"):
                    return False, q
                return urllib.parse.unquote(url.path[len("/v1/kv/"):]), q

            def do_GET(self):
                key, q = self._key()
                if key is False:
                    return self._reply(404, {"error": f"no such path {self.path}"})
                if key is None:
                    prefix = q.get("prefix", [""])[0]
                    return self._reply(200, {"kvs": store.list(prefix)})
                value, rev = store.get(key)
                if value is None:
                    return self._reply(404, {"error": f"no key {key}", "revision": 0})
                return self._reply(200, {"value": value, "revision": rev})

            def do_PUT(self):
                key, q = self._key()
                if not key:
                    return self._reply(404, {"error": f"no such path {self.path}"})
                try:
                    length = int(self.headers.get("Content-Length", "0"))
                    value = self.rfile.read(length).decode()
                    if "revision" in q:
                        rev = store.compare_and_swap(key, value, int(q["revision"][0]))
                    else:
                        rev = store.put(key, value)
                except StaleWriteError as e:
                    return self._reply(409, {"error": str(e), "revision": store.get(key)[1]})
                except (ValueError, StoreError, UnicodeDecodeError) as e:
                    return self._reply(400, {"error": str(e)})
                return self._reply(200, {"revision": rev})

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="kungfu-config",
                                        daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> "ConfigServer":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def _request(method: str, url: str, body: Optional[bytes] = None,
             timeout: float = REQUEST_TIMEOUT) -> Tuple[int, dict]:
    req = urllib.request.Request(url, data=body, method=method)
    if body is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        try:
            payload = json.loads(e.read() or b"{}")
        except ValueError:
            payload = {}
        return e.code, payload
    except (urllib.error.URLError, OSError) as e:
        raise StoreError(f"cannot reach the config store at {url}: {e}") from None


class HTTPStore(Store):
    """Client of ConfigServer."""

    def __init__(self, url: str):
        self.url = url.rstrip("/")

    def _kv(self, key: str, query: str = "") -> str:
        return f"{self.url}/v1/kv/{urllib.parse.quote(key, safe='')}{query}"

    def get(self, key):
        code, body = _request("GET", self._kv(key))
        if code == 404:
            return None, 0
        if code != 200:
            raise StoreError(f"GET {key}: {code} {body.get('error')}")
        return body["value"], int(body["revision"])

    def _put(self, key, value, query):
        code, body = _request("PUT", self._kv(key, query), value.encode())
        if code == 409:
            raise StaleWriteError(body.get("error", "stale"))
        if code != 200:
            raise StoreError(f"PUT {key}: {code} {body.get('error')}")
        return int(body["revision"])

    def compare_and_swap(self, key, value, revision):
        return self._put(key, value, f"?revision={int(revision)}")

    def put(self, key, value):
        return self._put(key, value, "")

    def list(self, prefix):
        code, body = _request("GET", f"{self.url}/v1/kv?prefix={urllib.parse.quote(prefix)}")
        if code != 200:
            raise StoreError(f"list {prefix}: {code} {body.get('error')}")
        return dict(body["kvs"])


# -- etcd ------------------------------------------------------------------------------------------

def _b64(s: str) -> str:
    return base64.b64encode(s.encode()).decode()


def _unb64(s: str) -> str:
    return base64.b64decode(s).decode()


class EtcdStore(Store):
    """etcd v3 through its JSON gateway (POST /v3/kv/range, /v3/kv/txn). Revisions are etcd's
    mod_revision; a write to the config key is checked here before the transaction."""

    def __init__(self, url: str, prefix: str = "kungfu/"):
        self.url = url.rstrip("/")
        self.prefix = prefix

    def _post(self, path: str, body: dict) -> dict:
        code, reply = _request("POST", self.url + path, json.dumps(body).encode())
        if code != 200:
            raise StoreError(f"etcd {path}: {code} {reply}")
        return reply

    def get(self, key):
        r = self._post("/v3/kv/range", {"key": _b64(self.prefix + key)})
        kvs = r.get("kvs") or []
        if not kvs:
            return None, 0
        return _unb64(kvs[0].get("value", "")), int(kvs[0]["mod_revision"])

    def compare_and_swap(self, key, value, revision):
        if key == CONFIG_KEY:
            # Checked against the config stored at `revision`: if the key has moved on since, the
            # write is stale (as the builtin server answers), not malformed. The transaction
            # below still compares the revision, so a change after this read is stale too.
            old, current = self.get(key)
            if current != revision:
                raise StaleWriteError(f"{key}: revision {current}, not {revision}")
            _check_config_write(old, value)
        k = _b64(self.prefix + key)
        compare = ({"key": k, "target": "CREATE", "create_revision": "0"} if revision == 0 else
                   {"key": k, "target": "MOD", "mod_revision": str(revision)})
        r = self._post("/v3/kv/txn", {"compare": [compare],
                                      "success": [{"request_put": {"key": k, "value": _b64(value)}}]})
        if not r.get("succeeded"):
            raise StaleWriteError(f"{key}: changed since revision {revision}")
        return int(r["header"]["revision"])

    def put(self, key, value):
        if key == CONFIG_KEY:
            raise StoreError("the cluster configuration is written with compare_and_swap only")
        r = self._post("/v3/kv/put", {"key": _b64(self.prefix + key), "value": _b64(value)})
        return int(r["header"]["revision"])

    def list(self, prefix):
        start = self.prefix + prefix
        # range_end: the prefix with its last byte incremented (every key that starts with it)
        end = start[:-1] + chr(ord(start[-1]) + 1) if start else "\0"
        r = self._post("/v3/kv/range", {"key": _b64(start), "range_end": _b64(end)})
        out = {}
        for kv in r.get("kvs") or []:
            out[_unb64(kv["key"])[len(self.prefix):]] = _unb64(kv.get("value", ""))
        return out


def connect(url: str) -> Store:
    """A Store for http://host:port (the builtin server) or etcd://host:port."""
    if url.startswith("etcd://"):
        return EtcdStore("http://" + url[len("etcd://"):])
    if url.startswith("http://"):
        return HTTPStore(url)
    raise ValueError(f"config server URL must start with http:// or etcd://, got {url!r}")


def server_main(argv=None) -> int:
    """kungfu-config-server: the builtin config store as a standalone process."""
    import argparse
    import signal

    p = argparse.ArgumentParser(
        prog="kungfu-config-server",
        description="Serve an elastic kungfu job's config store over HTTP (what kungfu-run "
                    "-builtin-config-port hosts), for launchers given -config-server "
                    "http://HOST:PORT. Runs until interrupted.")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (127.0.0.1)")
    p.add_argument("--port", type=int, default=9100, help="port to listen on (9100)")
    args = p.parse_args(argv)
    try:
        server = ConfigServer(args.host, args.port).start()
    except OSError as e:
        p.exit(1, f"kungfu-config-server: cannot listen on {args.host}:{args.port}: {e}\n")
    print(f"kungfu-config-server: serving {server.url}", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    server.stop()
    return 0


__all__ = ["ClusterConfig", "Store", "StoreError", "StaleWriteError", "ConfigServer", "MemoryStore",
           "HTTPStore", "EtcdStore", "connect", "CONFIG_KEY"]
