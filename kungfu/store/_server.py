"""The builtin config store: `MemoryStore` served over HTTP by `ConfigServer` (kungfu-run
-builtin-config-port, or `kungfu-config-server`: `server_main`).

`_Server` accepts connections and bounds them per address; `_Handler` answers one request each
(the key-value API and KungFu's /config); `ConfigServer` puts them together and runs them on a
thread."""
from __future__ import annotations

import argparse
import collections
import hmac
import io
import json
import signal
import socket
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Dict, List, Optional, Tuple

from kungfu import _env
from kungfu.store._base import (
    CONFIG_KEY,
    MAX_VALUE_BYTES,
    ClusterConfig,
    RequestRefused,
    StaleWriteError,
    Store,
    StoreError,
    _check_version,
)

CLUSTER_PATH = "/config"  # KungFu's config-server path: GET the cluster, PUT a new one
# The builtin server's limits on clients. A thread serves each connection: a client that sends
# one byte every few seconds would hold its thread for as long as it likes, and many such
# clients every thread. So a request (request line, headers and body) must arrive within
# REQUEST_DEADLINE in all, and one address may hold MAX_CONNECTIONS_PER_ADDRESS connections
# at once. A job's own requests are small and take milliseconds; a host's launcher and workers
# share one address, and a client refused while a burst of theirs is served (503) tries again
# (_request), so 16 leaves room for hosts with more workers than that.
REQUEST_DEADLINE = 10.0  # seconds
MAX_CONNECTIONS_PER_ADDRESS = 16


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
        if key == CONFIG_KEY:
            # Parsed outside the lock (a large value must not stall other clients); checked
            # against the stored config after, under it.
            new = ClusterConfig.from_json(value)
        with self._lock:
            current = self._data.get(key, (None, 0))[1]
            if current != revision:
                raise StaleWriteError(f"{key}: revision {current}, not {revision}")
            if key == CONFIG_KEY:
                _check_version(self._data.get(key, (None, 0))[0], new)
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


def _ipv4_int(host: str):
    """KungFu's IPv4 field: a dotted IPv4 address as its integer, another host name as it is."""
    parts = host.split(".")
    if len(parts) == 4 and all(p.isdigit() and int(p) < 256 for p in parts):
        return int.from_bytes(bytes(int(p) for p in parts), "big")
    return host


def kungfu_cluster(cfg: ClusterConfig) -> dict:
    """The configuration in KungFu's config-server JSON (Version added)."""
    workers = []
    for p in cfg.peers:
        host, _, port = p.rpartition(":")
        workers.append({"IPv4": _ipv4_int(host), "Port": int(port)})
    return {"Version": cfg.version, "Workers": workers}


def parse_cluster_request(body: bytes, query: Dict[str, List[str]]):
    """(peers, version or None) from a PUT of a cluster: KungFu's JSON ({"Runners": [...],
    "Workers": [{"IPv4": 2130706433, "Port": 10000}, ...]}; Runners are not used: kungfu's
    launchers are the job's -H hosts) or kungfu's ({"peers": ["127.0.0.1:10000", ...]});
    the version from ?version=, "Version" or "version" (optional). ValueError if malformed."""
    try:
        got = json.loads(body.decode())
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise ValueError(f"the body is not JSON: {type(e).__name__}: {e}") from None
    if not isinstance(got, dict):
        raise ValueError("the body must be a JSON object with Workers (KungFu's) or peers")
    if "Workers" in got:
        workers = got["Workers"]
        if not isinstance(workers, list):
            raise ValueError("Workers must be a list of {\"IPv4\": ..., \"Port\": ...}")
        peers = []
        for w in workers:
            if not isinstance(w, dict) or "IPv4" not in w or "Port" not in w:
                raise ValueError(f"a worker must be {{\"IPv4\": ..., \"Port\": ...}}, got {w!r}")
            ip, port = w["IPv4"], w["Port"]
            if isinstance(ip, int) and not isinstance(ip, bool) and 0 <= ip < 1 << 32:
                ip = ".".join(str(b) for b in ip.to_bytes(4, "big"))
            if not isinstance(ip, str) or isinstance(port, bool) or not isinstance(port, int):
                raise ValueError(f"a worker's IPv4 is an integer (or a host name) and its Port "
                                 f"an integer, got {w!r}")
            peers.append(f"{ip}:{port}")
    elif "peers" in got:
        peers = got["peers"]
        if not isinstance(peers, list) or not all(isinstance(p, str) for p in peers):
            raise ValueError("peers must be a list of \"host:port\" strings")
    else:
        raise ValueError("the body has neither Workers (KungFu's cluster) nor peers")
    version = query.get("version", [None])[0]
    if version is None:
        version = got.get("Version", got.get("version"))
    if version is not None:
        try:
            if isinstance(version, bool):
                raise ValueError
            version = int(version)
        except (TypeError, ValueError):
            raise ValueError(f"the version must be an integer, got {version!r}") from None
    return peers, version


class _DeadlineReader(io.RawIOBase):
    """A connection's reads, all before one deadline: each waits only for the time left, so a
    request that trickles in is cut off when the deadline passes, not when it falls silent."""

    def __init__(self, sock: socket.socket, seconds: float):
        self._sock = sock
        self._deadline = time.monotonic() + seconds
        self._seconds = seconds

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"the request did not arrive within {self._seconds:g}s")
        self._sock.settimeout(left)
        return self._sock.recv_into(buffer)


class _Handler(BaseHTTPRequestHandler):
    """Answers one request for a _Server: its store, token and request deadline are the
    server's (see ConfigServer)."""

    server: "_Server"

    def setup(self):
        deadline = self.server.request_deadline
        self.timeout = deadline  # replies too: a client that does not read is dropped
        super().setup()
        # One request per connection (HTTP/1.0): its deadline counts from the accept.
        self.rfile = io.BufferedReader(_DeadlineReader(self.connection, deadline))

    def log_message(self, *args):  # quiet
        pass

    def _reply(self, code: int, body: dict):
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _authorized(self) -> bool:
        expected = self.server.expected
        if expected is None:
            return True
        got = (self.headers.get("Authorization") or "").encode()
        if hmac.compare_digest(got, expected):
            return True
        self._reply(401, {"error": "the job token is missing or wrong (the builtin "
                                   "config store answers only its job: KUNGFU_JOB_TOKEN)"})
        return False

    def _key(self):
        url = urllib.parse.urlparse(self.path)
        q = urllib.parse.parse_qs(url.query)
        if url.path == "/v1/kv":
            return None, q
        if not url.path.startswith("/v1/kv/"):
            return False, q
        return urllib.parse.unquote(url.path[len("/v1/kv/"):]), q

    def do_GET(self):
        if not self._authorized():
            return
        if urllib.parse.urlparse(self.path).path == CLUSTER_PATH:
            return self._get_cluster()
        key, q = self._key()
        if key is False:
            return self._reply(404, {"error": f"no such path {self.path}"})
        if key is None:
            prefix = q.get("prefix", [""])[0]
            return self._reply(200, {"kvs": self.server.store.list(prefix)})
        value, rev = self.server.store.get(key)
        if value is None:
            return self._reply(404, {"error": f"no key {key}", "revision": 0})
        return self._reply(200, {"value": value, "revision": rev})

    def _get_cluster(self):
        try:
            store = self.server.store
            cfg, _ = store.config()
            request = store.cluster_request()
        except StoreError as e:
            return self._reply(500, {"error": str(e)})
        if cfg is None:
            return self._reply(404, {"error": "No Config Found."})
        return self._reply(200, dict(kungfu_cluster(cfg), Request=request))

    def _put_cluster(self, body: bytes, q):
        """KungFu's PUT /config: a new cluster for the job, checked as kf.resize checks
        a size (Store.request_cluster); rank 0 of the job applies it."""
        try:
            peers, version = parse_cluster_request(body, q)
            new = self.server.store.request_cluster(peers, version)
        except ValueError as e:
            return self._reply(400, {"error": str(e)})
        except RequestRefused as e:
            return self._reply(e.status, {"error": str(e)})
        except StoreError as e:
            return self._reply(500, {"error": str(e)})
        return self._reply(200, dict(kungfu_cluster(new), state="pending"))

    def do_PUT(self):
        if not self._authorized():
            return
        cluster = urllib.parse.urlparse(self.path).path == CLUSTER_PATH
        key, q = self._key()
        if not key and not cluster:
            return self._reply(404, {"error": f"no such path {self.path}"})
        body = self._read_body()
        if body is None:
            return None
        if cluster:
            return self._put_cluster(body, q)
        return self._put_key(key, body, q)

    def _read_body(self) -> Optional[bytes]:
        """A PUT's body, exactly as long as announced and at most MAX_VALUE_BYTES; None when it
        is not (answered, or the connection dropped: nothing is stored)."""
        text = self.headers.get("Content-Length")
        if text is None or not text.strip().isdigit():
            self.close_connection = True
            self._reply(411, {"error": "a PUT needs a Content-Length"})
            return None
        length = int(text)
        if length > MAX_VALUE_BYTES:
            self.close_connection = True
            self._reply(413, {"error": f"a value is at most {MAX_VALUE_BYTES} "
                                       f"bytes, this one {length}"})
            return None
        try:
            body = self.rfile.read(length)
        except OSError:  # the request's deadline passed: nothing is stored
            self.close_connection = True
            return None
        if len(body) != length:  # the client went away mid-body: store nothing
            self.close_connection = True
            self._reply(400, {"error": f"body of {len(body)} bytes, {length} announced"})
            return None
        return body

    def _put_key(self, key: str, body: bytes, q):
        """PUT /v1/kv/<key>: a compare-and-swap with ?revision=R, else a plain put."""
        store = self.server.store
        try:
            value = body.decode()
            if "revision" in q:
                rev = store.compare_and_swap(key, value, int(q["revision"][0]))
            else:
                rev = store.put(key, value)
        except StaleWriteError as e:
            return self._reply(409, {"error": str(e), "revision": store.get(key)[1]})
        except (ValueError, StoreError, UnicodeDecodeError, RecursionError) as e:
            return self._reply(400, {"error": str(e) or type(e).__name__})
        return self._reply(200, {"revision": rev})

    def do_DELETE(self):
        self._reply(501, {"error": "keys are never deleted"})


class _Server(ThreadingHTTPServer):
    """Serves each connection on a thread of its own (_Handler), at most `max_per_address` at
    once per client address."""

    request_queue_size = 128  # 20 concurrent writers saw resets with the default 5
    daemon_threads = True

    def __init__(self, address: Tuple[str, int], store: MemoryStore, expected: Optional[bytes],
                 request_deadline: float, max_per_address: int):
        self.store = store
        self.expected = expected  # the Authorization header a request must carry (None: any)
        self.request_deadline = request_deadline
        self.max_per_address = max_per_address
        self.held = collections.Counter()  # client address -> connections being served
        self.held_lock = threading.Lock()
        super().__init__(address, _Handler)

    def verify_request(self, request, client_address):
        """Refuses a connection beyond max_per_address of its address, at once (this
        runs on the accepting thread: it must not wait)."""
        address = client_address[0]
        with self.held_lock:
            if self.held[address] < self.max_per_address:
                self.held[address] += 1
                return True
        body = json.dumps({"error": f"{address} holds {self.max_per_address} connections "
                                    "to the config store already"}).encode()
        try:
            request.setblocking(False)
            request.send(b"HTTP/1.0 503 Service Unavailable\r\nContent-Type: "
                         b"application/json\r\nContent-Length: %d\r\n\r\n%s"
                         % (len(body), body))
        except OSError:
            pass  # the refusal is the close that follows
        return False

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._release(client_address)

    def process_request(self, request, client_address):
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._release(client_address)  # no thread to release it
            raise

    def _release(self, client_address):
        with self.held_lock:
            self.held[client_address[0]] -= 1
            if self.held[client_address[0]] <= 0:
                del self.held[client_address[0]]


class ConfigServer:
    """An HTTP server over a MemoryStore: GET/PUT /v1/kv/<key>[?revision=R], GET /v1/kv?prefix=P,
    and KungFu's GET/PUT /config (the cluster in KungFu's JSON; a PUT asks the job to change to
    it: Store.request_cluster, refused with 400 or 409 naming the problem).

    PUT with ?revision=R is a compare-and-swap (409 when stale); 400 for a malformed write, 401
    without the token (when one is set), 411/413 for a missing or too large body, 503 at once
    for a connection beyond `max_per_address`. A request must arrive within `request_deadline`
    (headers and body together), else the connection is closed and nothing is stored."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, token: Optional[str] = None,
                 request_deadline: float = REQUEST_DEADLINE,
                 max_per_address: int = MAX_CONNECTIONS_PER_ADDRESS):
        self.store = MemoryStore()
        expected = f"Bearer {token}".encode() if token else None
        self._server = _Server((host, port), self.store, expected, request_deadline,
                               max_per_address)
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


def server_main(argv=None) -> int:
    """kungfu-config-server: the builtin config store as a standalone process."""
    p = argparse.ArgumentParser(
        prog="kungfu-config-server",
        description="Serve an elastic kungfu job's config store over HTTP (what kungfu-run "
                    "-builtin-config-port hosts), for launchers given -config-server "
                    "http://HOST:PORT. Runs until interrupted.")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (127.0.0.1)")
    p.add_argument("--port", type=int, default=9100, help="port to listen on (9100)")
    p.add_argument("--token-file", metavar="PATH",
                   help="answer only clients that send the secret in this file (the job's "
                        "KUNGFU_JOB_TOKEN; kungfu-run -job-token-file takes the same file). "
                        "Default: KUNGFU_JOB_TOKEN if set, else no token (anyone who can reach "
                        "the port may change the job)")
    args = p.parse_args(argv)
    try:
        token = _env.JOB_TOKEN.get()
        if args.token_file:
            token = _env.check_job_token(_env.read_secret_file(args.token_file, "--token-file"))
    except ValueError as e:
        p.exit(2, f"kungfu-config-server: {e}\n")
    try:
        server = ConfigServer(args.host, args.port, token=token).start()
    except OSError as e:
        p.exit(1, f"kungfu-config-server: cannot listen on {args.host}:{args.port}: {e}\n")
    # The handlers come first: whoever read the line may stop the server at once, and it then
    # stops as asked (exit 0), not by the signal's default action.
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    print(f"kungfu-config-server: serving {server.url}", flush=True)
    stop.wait()
    server.stop()
    return 0
