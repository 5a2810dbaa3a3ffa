"""`EtcdStore`: etcd v3 through its JSON gateway, with etcd's user/password authentication and
TLS; and how a password is kept out of command lines and messages."""
from __future__ import annotations

import base64
import json
import ssl
import urllib.parse
from typing import Optional, Tuple

from kungfu import _env
from kungfu.store._base import CONFIG_KEY, StaleWriteError, Store, StoreError, _check_config_write
from kungfu.store._http import _request

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
