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

Security: a ConfigServer given the job's token (kungfu-run passes KUNGFU_JOB_TOKEN) answers only
requests that carry it (`Authorization: Bearer <token>`, else 401); values are limited to
MAX_VALUE_BYTES (413), bodies must be exactly as long as announced, a request (headers and body)
must arrive within REQUEST_DEADLINE in all, however slowly it trickles in, a client address may
hold at most MAX_CONNECTIONS_PER_ADDRESS connections at once (more are refused at once, 503), and
configurations are parsed outside the store's lock. EtcdStore
supports etcd's user/password authentication (from a file only its owner can read, or the URL)
and an https:// gateway with a CA and a client
certificate; whatever etcd holds that cannot be parsed is a StoreError, never a crash.
"""
from __future__ import annotations

import base64
import collections
import hmac
import io
import json
import os
import re
import socket
import ssl
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Dict, List, Optional, Tuple

from kungfu import _env

CONFIG_KEY = "cluster/config"
READY_PREFIX = "cluster/ready/"
FAILED_PREFIX = "cluster/failed/"  # a launcher's word that a joiner died before the switch
SWITCHED_PREFIX = "cluster/switched/"  # rank 0's word that the workers switch to a version
DONE_KEY = "cluster/done"  # written when training has finished (the launchers may exit)
# Recovery from a failure in cluster version v (kungfu/elastic/_protocol.py, Elastic.recover):
ALIVE_PREFIX = "cluster/alive/"  # alive/<v>/<peer> = the survivor's last commit
DEAD_PREFIX = "cluster/dead/"  # dead/<peer> = the version its dead worker was started for
RECOVERED_PREFIX = "cluster/recovered/"  # recovered/<v> = the survivors' decision (first wins)
COOLDOWN_PREFIX = "cluster/cooldown/"  # cooldown/<host> = time.time() until which it gets no worker
# Changing the cluster from outside the job (request_cluster; docs/elastic.md):
JOB_KEY = "cluster/job"  # the job's slots, as the launchers were given them: {"hosts", "port_range"}
REQUEST_KEY = "cluster/request"  # {"version", "peers", "state": "pending" | "accepted" | "refused", "why"}
CLUSTER_PATH = "/config"  # KungFu's config-server path: GET the cluster, PUT a new one
REQUEST_TIMEOUT = 5.0  # seconds
MAX_VALUE_BYTES = 1 << 20  # a configuration of ~50k peers; the store holds nothing bigger
# The builtin server's limits on clients. A thread serves each connection: a client that sends
# one byte every few seconds would hold its thread for as long as it likes, and many such
# clients every thread. So a request (request line, headers and body) must arrive within
# REQUEST_DEADLINE in all, and one address may hold MAX_CONNECTIONS_PER_ADDRESS connections
# at once. A job's own requests are small and take milliseconds; a host's launcher and workers
# share one address, and a client refused while a burst of theirs is served (503) tries again
# (_request), so 16 leaves room for hosts with more workers than that.
REQUEST_DEADLINE = 10.0  # seconds
MAX_CONNECTIONS_PER_ADDRESS = 16
BUSY_RETRY = 0.05  # seconds before a client refused for its address's connections tries again
# A host as the runtime's PeerID parser takes it: a name or an IPv4 address (letters, digits,
# '-', '.', '_'), no spaces, no shell characters.
_HOST = re.compile(r"[A-Za-z0-9_.-]{1,253}")


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
            if len(text) > MAX_VALUE_BYTES:
                raise ValueError(f"{len(text)} bytes, more than {MAX_VALUE_BYTES}")
            d = json.loads(text)
            return ClusterConfig(d["version"], d["peers"])
        except (ValueError, KeyError, TypeError, RecursionError) as e:
            raise ValueError(f"malformed cluster configuration {text[:200]!r}: "
                             f"{type(e).__name__ if isinstance(e, RecursionError) else e}") from None


def check_config(c: ClusterConfig) -> None:
    if isinstance(c.version, bool) or not isinstance(c.version, int) or c.version < 0:
        raise ValueError(f"cluster version must be an integer >= 0, got {c.version!r}")
    if not c.peers:
        raise ValueError("a cluster configuration needs at least one peer")
    for p in c.peers:
        host, _, port = p.rpartition(":") if isinstance(p, str) else ("", "", "")
        if not _HOST.fullmatch(host) or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"peer {p!r} is not host:port (a host name or IPv4 address)")
    if len(set(c.peers)) != len(c.peers):
        raise ValueError(f"peers are listed twice in {list(c.peers)}")


def ready_key(version: int, peer: str) -> str:
    return f"{READY_PREFIX}{version}/{peer}"


def failed_key(version: int, peer: str) -> str:
    return f"{FAILED_PREFIX}{version}/{peer}"


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
        """The stored configuration and its revision ((None, 0) before the first). A value that
        is not a configuration (written around kungfu) is a StoreError."""
        value, rev = self.get(CONFIG_KEY)
        if value is None:
            return None, rev
        try:
            return ClusterConfig.from_json(value), rev
        except ValueError as e:
            raise StoreError(f"the store holds no valid configuration at {CONFIG_KEY}: {e}") from None

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

    def mark_switched(self, version: int) -> None:
        self.put(f"{SWITCHED_PREFIX}{version}", "1")

    def switched(self, version: int) -> bool:
        return self.get(f"{SWITCHED_PREFIX}{version}")[0] is not None

    def mark_failed(self, version: int, peer: str) -> None:
        self.put(failed_key(version, peer), "1")

    def failed_peers(self, version: int) -> List[str]:
        prefix = f"{FAILED_PREFIX}{version}/"
        return sorted(k[len(prefix):] for k in self.list(prefix))

    # -- recovery ---------------------------------------------------------------------------

    def mark_alive(self, version: int, peer: str, commit: int) -> None:
        self.put(f"{ALIVE_PREFIX}{version}/{peer}", str(int(commit)))

    def alive_peers(self, version: int) -> Dict[str, int]:
        """{peer: its last commit} of the survivors of a failure in `version`."""
        prefix = f"{ALIVE_PREFIX}{version}/"
        return {k[len(prefix):]: _int(v) for k, v in self.list(prefix).items()}

    def mark_dead(self, peer: str, started_for: int) -> None:
        """A launcher's word that its worker for `peer`, started for that cluster version, died;
        -1 when it starts a new worker there (the mark is about the old one)."""
        self.put(f"{DEAD_PREFIX}{peer}", str(int(started_for)))

    def dead_peers(self) -> Dict[str, int]:
        """{peer: the cluster version its dead worker was started for}."""
        marks = {k[len(DEAD_PREFIX):]: _int(v) for k, v in self.list(DEAD_PREFIX).items()}
        return {p: v for p, v in marks.items() if v >= 0}

    def decide_recovery(self, version: int, decision: str) -> str:
        """Stores the survivors' decision for a failure in `version` unless one is stored;
        returns the stored one (the first writer's)."""
        key = f"{RECOVERED_PREFIX}{version}"
        try:
            self.compare_and_swap(key, decision, 0)
            return decision
        except StaleWriteError:
            value, _ = self.get(key)
            if value is None:
                raise StoreError(f"{key}: written and gone") from None
            return value

    def recovery(self, version: int) -> Optional[str]:
        return self.get(f"{RECOVERED_PREFIX}{version}")[0]

    def cool_down(self, host: str, until: float) -> None:
        """A launcher's word that `host` gets no new worker before `until` (time.time())."""
        self.put(f"{COOLDOWN_PREFIX}{host}", repr(float(until)))

    def cooling_hosts(self, now: float) -> Dict[str, float]:
        """{host: until} of the hosts that get no new worker at time `now` (time.time())."""
        out = {}
        for k, v in self.list(COOLDOWN_PREFIX).items():
            try:
                until = float(v)
            except ValueError:
                continue
            if until > now:
                out[k[len(COOLDOWN_PREFIX):]] = until
        return out

    def recoveries(self) -> int:
        """How many failures the job has recovered from (or is recovering from)."""
        return len(self.list(RECOVERED_PREFIX))

    # -- a cluster asked for from outside the job ------------------------------------------

    def describe_job(self, hosts: str, port_range: str) -> None:
        """A launcher's word of the job's slots (its -H and -port-range; every launcher of a
        job has the same), against which request_cluster checks a request."""
        self.put(JOB_KEY, json.dumps({"hosts": hosts, "port_range": port_range}))

    def request_cluster(self, peers, version: Optional[int] = None) -> ClusterConfig:
        """Asks the job to change to these peers, as version `version` (default: the next one),
        with kf.resize's checks: 1 to (the job's slots) workers, each a slot of the job's hosts,
        the first (rank 0, whose state joiners take) a current worker, a version that is the
        stored one + 1, no other request pending. Rank 0 of the job takes the request at a step
        boundary (kf.Hook) or in kungfu.python.resize() (a custom loop) and resizes through the
        usual protocol. Raises RequestRefused (its `status`: 400 bad request, 409 conflict with
        the job's state) naming the problem; nothing is stored then."""
        from kungfu._hosts import UsageError, parse_hosts, parse_port_range, plan_workers

        try:
            new = ClusterConfig(0 if version is None else version, peers)
        except ValueError as e:
            raise RequestRefused(400, str(e)) from None
        job, _ = self.get(JOB_KEY)
        stored, _ = self.config()
        if job is None or stored is None:
            raise RequestRefused(409, "the job has not started: its launchers have not "
                                      "described its slots yet")
        try:
            job = json.loads(job)
            hosts = parse_hosts(job["hosts"])
            slots = [w.spec for w in plan_workers(sum(h.slots for h in hosts), hosts,
                                                  parse_port_range(job["port_range"]))]
        except (ValueError, KeyError, TypeError, UsageError) as e:
            raise StoreError(f"the store holds no valid job description at {JOB_KEY}: {e}") from None
        expected = stored.version + 1
        if version is None:
            new = ClusterConfig(expected, new.peers)
        elif new.version != expected:
            raise RequestRefused(409, f"version {new.version} is not the next one: the stored "
                                      f"cluster is version {stored.version} (expected {expected})")
        if len(new.peers) > len(slots):
            raise RequestRefused(400, f"cannot resize to {len(new.peers)} workers: the job has 1 "
                                      f"to {len(slots)} slots (kungfu-run -H {job['hosts']})")
        unknown = [p for p in new.peers if p not in slots]
        if unknown:
            raise RequestRefused(400, f"{', '.join(unknown)} {'is' if len(unknown) == 1 else 'are'}"
                                      f" not a slot of this job (kungfu-run -H {job['hosts']} "
                                      f"-port-range {job['port_range']}: {', '.join(slots)})")
        if new.peers[0] not in stored.peers:
            raise RequestRefused(400, f"the first worker (rank 0) must be a current one, whose "
                                      f"state the new workers take: {new.peers[0]} is not in "
                                      f"version {stored.version} ({', '.join(stored.peers)})")
        if new.peers == stored.peers:
            raise RequestRefused(400, f"version {stored.version} has these workers already")
        text, rev = self.get(REQUEST_KEY)
        if text is not None:
            old = _json_object(text, REQUEST_KEY)
            if old.get("state") == "pending" and old.get("version", -1) >= expected:
                raise RequestRefused(409, f"a request for version {old['version']} is pending "
                                          "(the job takes it at its next step boundary)")
        value = dict(json.loads(new.to_json()), state="pending")
        try:
            self.compare_and_swap(REQUEST_KEY, json.dumps(value), rev)
        except StaleWriteError:
            raise RequestRefused(409, "another request was stored at the same time") from None
        return new

    def cluster_request(self) -> Optional[dict]:
        """The last request (request_cluster) with its state, or None."""
        text, _ = self.get(REQUEST_KEY)
        return None if text is None else _json_object(text, REQUEST_KEY)

    def settle_request(self, version: int, state: str, why: str = "") -> None:
        """Rank 0: says what became of the request for `version` ("accepted" or "refused")."""
        text, rev = self.get(REQUEST_KEY)
        if text is None:
            return
        got = _json_object(text, REQUEST_KEY)
        if got.get("version") != version or got.get("state") != "pending":
            return
        got.update(state=state, why=why)
        try:
            self.compare_and_swap(REQUEST_KEY, json.dumps(got), rev)
        except StaleWriteError:
            pass  # a new request replaced it


class RequestRefused(StoreError):
    """A cluster asked for from outside the job that kf.resize's checks refuse (request_cluster);
    `status` is the HTTP code the builtin server answers with."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def _json_object(text: str, key: str) -> dict:
    try:
        got = json.loads(text)
    except ValueError:
        got = None
    if not isinstance(got, dict):
        raise StoreError(f"the store holds no JSON object at {key}: {text[:200]!r}")
    return got


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise StoreError(f"the store holds {text!r} where a number belongs") from None


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


def _check_config_write(old: Optional[str], new: str) -> None:
    _check_version(old, ClusterConfig.from_json(new))  # ValueError: malformed


def _check_version(old: Optional[str], cfg: ClusterConfig) -> None:
    want = 0 if old is None else json.loads(old)["version"] + 1
    if cfg.version != want:
        raise ValueError(f"cluster version {cfg.version} cannot follow "
                         f"{'nothing' if old is None else want - 1}: expected {want}")


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
        store = self.store
        expected = f"Bearer {token}".encode() if token else None

        class Handler(BaseHTTPRequestHandler):
            timeout = request_deadline  # replies too: a client that does not read is dropped

            def setup(self):
                super().setup()
                # One request per connection (HTTP/1.0): its deadline counts from the accept.
                self.rfile = io.BufferedReader(_DeadlineReader(self.connection, request_deadline))

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
                    return self._reply(200, {"kvs": store.list(prefix)})
                value, rev = store.get(key)
                if value is None:
                    return self._reply(404, {"error": f"no key {key}", "revision": 0})
                return self._reply(200, {"value": value, "revision": rev})

            def _get_cluster(self):
                try:
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
                    new = store.request_cluster(peers, version)
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
                text = self.headers.get("Content-Length")
                if text is None or not text.strip().isdigit():
                    self.close_connection = True
                    return self._reply(411, {"error": "a PUT needs a Content-Length"})
                length = int(text)
                if length > MAX_VALUE_BYTES:
                    self.close_connection = True
                    return self._reply(413, {"error": f"a value is at most {MAX_VALUE_BYTES} "
                                                      f"bytes, this one {length}"})
                try:
                    body = self.rfile.read(length)
                except OSError:  # the request's deadline passed: nothing is stored
                    self.close_connection = True
                    return
                if len(body) != length:  # the client went away mid-body: store nothing
                    self.close_connection = True
                    return self._reply(400, {"error": f"body of {len(body)} bytes, "
                                                      f"{length} announced"})
                if cluster:
                    return self._put_cluster(body, q)
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

        class Server(ThreadingHTTPServer):
            request_queue_size = 128  # 20 concurrent writers saw resets with the default 5
            daemon_threads = True

            def __init__(self, *args):
                self.held = collections.Counter()  # client address -> connections being served
                self.held_lock = threading.Lock()
                super().__init__(*args)

            def verify_request(self, request, client_address):
                """Refuses a connection beyond max_per_address of its address, at once (this
                runs on the accepting thread: it must not wait)."""
                address = client_address[0]
                with self.held_lock:
                    if self.held[address] < max_per_address:
                        self.held[address] += 1
                        return True
                body = json.dumps({"error": f"{address} holds {max_per_address} connections "
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

        self._server = Server((host, port), Handler)
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
             timeout: float = REQUEST_TIMEOUT, headers: Optional[Dict[str, str]] = None,
             context: Optional[ssl.SSLContext] = None) -> Tuple[int, dict]:
    req = urllib.request.Request(url, data=body, method=method)
    if body is not None:
        req.add_header("Content-Type", "application/json")
    for k, v in (headers or {}).items():
        req.add_header(k, v)
    # A reset before any reply (a listen queue that overflowed) is retried once when repeating
    # the request cannot do harm: reads, compare-and-swaps (a second try of one that was in
    # fact applied fails as stale, which the caller handles like any lost race), and the
    # builtin server's plain puts (the same value again).
    again = (method == "GET" or "revision=" in url or "/v3/kv/range" in url
             or (method == "PUT" and "/v1/kv/" in url))
    resets = 0
    # A connection refused for its address's count (503 from the builtin server) did nothing:
    # tried again, with growing pauses, until the request's deadline.
    until, pause = time.monotonic() + timeout, BUSY_RETRY
    while True:
        try:
            with urllib.request.urlopen(req, timeout=timeout, context=context) as r:
                return r.status, json.loads(r.read() or b"{}")
        except urllib.error.HTTPError as e:
            try:
                payload = json.loads(e.read() or b"{}")
            except ValueError:
                payload = {}
            if e.code == 503 and time.monotonic() + pause < until:
                time.sleep(pause)
                pause *= 2
                continue
            return e.code, payload
        except ConnectionResetError as e:
            if again and resets == 0:
                resets += 1
                continue
            raise StoreError(f"cannot reach the config store at {url}: {e}") from None
        except (urllib.error.URLError, OSError, ValueError) as e:
            raise StoreError(f"cannot reach the config store at {url}: {e}") from None


class HTTPStore(Store):
    """Client of ConfigServer. `token`: the job's token (default: KUNGFU_JOB_TOKEN)."""

    def __init__(self, url: str, token: Optional[str] = None):
        self.url = url.rstrip("/")
        if token is None:
            token = _env.JOB_TOKEN.get()
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}

    def _kv(self, key: str, query: str = "") -> str:
        return f"{self.url}/v1/kv/{urllib.parse.quote(key, safe='')}{query}"

    def _call(self, method: str, url: str, body: Optional[bytes] = None) -> Tuple[int, dict]:
        code, reply = _request(method, url, body, headers=self._headers)
        if code == 401:
            raise StoreError(f"the config store at {self.url} refused this client: "
                             f"{reply.get('error', 'unauthorized')}")
        return code, reply

    def get(self, key):
        code, body = self._call("GET", self._kv(key))
        if code == 404:
            return None, 0
        if code != 200:
            raise StoreError(f"GET {key}: {code} {body.get('error')}")
        return body["value"], int(body["revision"])

    def _put(self, key, value, query):
        code, body = self._call("PUT", self._kv(key, query), value.encode())
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
        code, body = self._call("GET", f"{self.url}/v1/kv?prefix={urllib.parse.quote(prefix)}")
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
    mod_revision; a write to the config key is checked here before the transaction.

    user/password: etcd's authentication (a token from /v3/auth/authenticate, renewed when etcd
    says it expired). An https:// URL uses TLS; `cacert` verifies the server, `cert`/`key` are a
    client certificate."""

    def __init__(self, url: str, prefix: str = "kungfu/", user: Optional[str] = None,
                 password: Optional[str] = None, cacert: Optional[str] = None,
                 cert: Optional[str] = None, key: Optional[str] = None):
        self.url = url.rstrip("/")
        self.prefix = prefix
        self._user, self._password = user, password
        self._auth: Optional[str] = None
        self._context = None
        if self.url.startswith("https://"):
            self._context = ssl.create_default_context(cafile=cacert)
            if cert:
                self._context.load_cert_chain(cert, key)

    def _authenticate(self) -> None:
        code, reply = _request("POST", self.url + "/v3/auth/authenticate",
                               json.dumps({"name": self._user, "password": self._password}).encode(),
                               context=self._context)
        if code != 200 or "token" not in reply:
            raise StoreError(f"etcd refused user {self._user!r}: {code} {reply.get('message', reply)}")
        self._auth = reply["token"]

    def _post(self, path: str, body: dict) -> dict:
        for attempt in range(2):
            if self._user is not None and self._auth is None:
                self._authenticate()
            headers = {"Authorization": self._auth} if self._auth else {}
            code, reply = _request("POST", self.url + path, json.dumps(body).encode(),
                                   headers=headers, context=self._context)
            expired = code != 200 and "token" in str(reply.get("message", reply.get("error", "")))
            if expired and self._user is not None and attempt == 0:
                self._auth = None  # expired or revoked: authenticate again, once
                continue
            if code != 200:
                raise StoreError(f"etcd {path}: {code} {reply}")
            return reply
        raise AssertionError("unreachable")

    def get(self, key):
        r = self._post("/v3/kv/range", {"key": _b64(self.prefix + key)})
        kvs = r.get("kvs") or []
        if not kvs:
            return None, 0
        try:
            return _unb64(kvs[0].get("value", "")), int(kvs[0]["mod_revision"])
        except (ValueError, KeyError, TypeError) as e:
            raise StoreError(f"etcd holds an unreadable value at {self.prefix + key}: {e}") from None

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


def read_credentials(path: str) -> Tuple[str, str]:
    """(user, password) from a file holding USER:PASSWORD (one line), which only its owner may
    read or write: a password is kept out of URLs and command lines, where every local user can
    read it (ps), and a file others can read would expose it the same way. ValueError if not."""
    text = _env.read_secret_file(path, "the etcd credentials file")
    user, sep, password = text.partition(":")
    if not sep or not user or not password or "\n" in text:
        raise ValueError(f"the etcd credentials file {path!r} must hold USER:PASSWORD on one "
                         "line")
    return user, password


def url_password(url: str) -> Optional[Tuple[str, str]]:
    """(user, password) when an etcd:// or etcds:// URL carries a password, else None."""
    scheme = next((s for s in ("etcd://", "etcds://") if url.startswith(s)), None)
    if scheme is None:
        return None
    parts = urllib.parse.urlsplit("x://" + url[len(scheme):])
    if not parts.username or parts.password is None:
        return None
    return urllib.parse.unquote(parts.username), urllib.parse.unquote(parts.password)


def shown_url(url: str) -> str:
    """`url` with a password in it replaced by ***, for messages."""
    if url_password(url) is None:
        return url
    scheme, _, rest = url.partition("://")
    userinfo, _, hostpart = rest.rpartition("@")
    return f"{scheme}://{userinfo.partition(':')[0]}:***@{hostpart}"


def connect(url: str, token: Optional[str] = None, credentials: Optional[str] = None) -> Store:
    """A Store for http://host:port (the builtin server; `token` defaults to KUNGFU_JOB_TOKEN),
    etcd://[user:password@]host:port or etcds://... (etcd's gateway over TLS; the CA and client
    certificate come from KUNGFU_ETCD_CACERT, KUNGFU_ETCD_CERT, KUNGFU_ETCD_KEY). etcd's user
    and password: from the file `credentials` (default KUNGFU_ETCD_CREDENTIALS; see
    read_credentials), or from the URL; not both."""
    for scheme, web in (("etcd://", "http://"), ("etcds://", "https://")):
        if url.startswith(scheme):
            parts = urllib.parse.urlsplit("x://" + url[len(scheme):])
            user = urllib.parse.unquote(parts.username) if parts.username else None
            password = urllib.parse.unquote(parts.password or "") if user else None
            credentials = credentials or _env.ETCD_CREDENTIALS.get()
            if credentials:
                if user is not None:
                    raise ValueError(f"etcd credentials given twice: in the URL "
                                     f"{shown_url(url)} and in the file {credentials!r}")
                user, password = read_credentials(credentials)
            netloc = parts.hostname + (f":{parts.port}" if parts.port else "")
            return EtcdStore(web + netloc, user=user, password=password,
                             cacert=_env.ETCD_CACERT.get(), cert=_env.ETCD_CERT.get(),
                             key=_env.ETCD_KEY.get())
    if url.startswith("http://"):
        return HTTPStore(url, token)
    raise ValueError(f"config server URL must start with http://, etcd:// or etcds://, got {url!r}")


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
    print(f"kungfu-config-server: serving {server.url}", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    server.stop()
    return 0


__all__ = ["ClusterConfig", "Store", "StoreError", "StaleWriteError", "RequestRefused",
           "ConfigServer", "MemoryStore",
           "HTTPStore", "EtcdStore", "connect", "CONFIG_KEY", "MAX_VALUE_BYTES"]
