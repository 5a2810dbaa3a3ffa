"""The store's interface and its data: keys, the cluster configuration, errors, and `Store`,
whose cluster, recovery and request methods every backend shares (they need only get,
compare_and_swap, put and list)."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from kungfu._hosts import UsageError, parse_hosts, parse_port_range, plan_workers

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
NO_RECOVERY_KEY = "cluster/no-recovery"  # rank 0's word that training cannot recover, and why
# Changing the cluster from outside the job (request_cluster; docs/elastic.md):
JOB_KEY = "cluster/job"  # the job's slots, as the launchers were given them: {"hosts", "port_range"}
REQUEST_KEY = "cluster/request"  # {"version", "peers", "state": "pending" | "accepted" | "refused", "why"}
CLUSTER_PATH = "/config"  # KungFu's config-server path: GET the cluster, PUT a new one
MAX_VALUE_BYTES = 1 << 20  # a configuration of ~50k peers; the store holds nothing bigger
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

    def mark_no_recovery(self, why: str) -> None:
        """Rank 0's word, as training starts, that it cannot recover from a lost worker (and
        why): a launcher then says that a failure ends the job."""
        self.put(NO_RECOVERY_KEY, why)

    def no_recovery(self) -> Optional[str]:
        """Why training cannot recover from a lost worker; None: it did not say so."""
        return self.get(NO_RECOVERY_KEY)[0] or None

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


def _check_config_write(old: Optional[str], new: str) -> None:
    _check_version(old, ClusterConfig.from_json(new))  # ValueError: malformed


def _check_version(old: Optional[str], cfg: ClusterConfig) -> None:
    want = 0 if old is None else json.loads(old)["version"] + 1
    if cfg.version != want:
        raise ValueError(f"cluster version {cfg.version} cannot follow "
                         f"{'nothing' if old is None else want - 1}: expected {want}")
