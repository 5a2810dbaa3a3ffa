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

One module per part: `_base` (keys, errors, `ClusterConfig` and the `Store` interface), `_server`
(the builtin server), `_http` (its client), `_etcd`; `connect` picks the backend of a URL.
"""
from __future__ import annotations

import urllib.parse
from typing import Optional

from kungfu import _env
# The names of kungfu.store, wherever they are defined.
from kungfu.store._base import (  # noqa: F401
    ALIVE_PREFIX,
    CONFIG_KEY,
    COOLDOWN_PREFIX,
    DEAD_PREFIX,
    DONE_KEY,
    FAILED_PREFIX,
    JOB_KEY,
    MAX_VALUE_BYTES,
    NO_RECOVERY_KEY,
    READY_PREFIX,
    RECOVERED_PREFIX,
    REQUEST_KEY,
    SWITCHED_PREFIX,
    ClusterConfig,
    RequestRefused,
    StaleWriteError,
    Store,
    StoreError,
    check_config,
    failed_key,
    ready_key,
)
from kungfu.store._etcd import EtcdStore, read_credentials, shown_url, url_password  # noqa: F401
from kungfu.store._http import BUSY_RETRY, REQUEST_TIMEOUT, HTTPStore  # noqa: F401
from kungfu.store._server import (  # noqa: F401
    CLUSTER_PATH,
    MAX_CONNECTIONS_PER_ADDRESS,
    REQUEST_DEADLINE,
    ConfigServer,
    MemoryStore,
    kungfu_cluster,
    parse_cluster_request,
    server_main,
)


def _server_root(url: str) -> str:
    """The builtin server's root from a -config-server URL: KungFu's launch line names its
    cluster path (http://HOST:PORT/config), which serves GET/PUT of the cluster, not the
    key-value API under the root: that path is dropped."""
    parts = urllib.parse.urlsplit(url)
    path = parts.path.rstrip("/")
    if path.endswith(CLUSTER_PATH):
        path = path[: -len(CLUSTER_PATH)]
    return urllib.parse.urlunsplit((parts.scheme, parts.netloc, path, "", ""))


def connect(url: str, token: Optional[str] = None, credentials: Optional[str] = None) -> Store:
    """A Store for http://host:port or KungFu's http://host:port/config (the builtin server;
    `token` defaults to KUNGFU_JOB_TOKEN), etcd://[user:password@]host:port or etcds://...
    (etcd's gateway over TLS; the CA and client certificate come from KUNGFU_ETCD_CACERT,
    KUNGFU_ETCD_CERT, KUNGFU_ETCD_KEY). etcd's user and password: from the file `credentials`
    (default KUNGFU_ETCD_CREDENTIALS; see read_credentials), or from the URL; not both."""
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
        return HTTPStore(_server_root(url), token)
    raise ValueError(f"config server URL must start with http://, etcd:// or etcds://, got {url!r}")


__all__ = ["ClusterConfig", "Store", "StoreError", "StaleWriteError", "RequestRefused",
           "ConfigServer", "MemoryStore",
           "HTTPStore", "EtcdStore", "connect", "CONFIG_KEY", "MAX_VALUE_BYTES"]
