"""`HTTPStore`, the builtin server's client, and `_request`, the one HTTP call every client
makes (etcd's too): a deadline, and retries only where repeating cannot do harm."""
from __future__ import annotations

import json
import ssl
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Dict, Optional, Tuple

from kungfu import _env
from kungfu.store._base import StaleWriteError, Store, StoreError

REQUEST_TIMEOUT = 5.0  # seconds
BUSY_RETRY = 0.05  # seconds before a client refused for its address's connections tries again


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
