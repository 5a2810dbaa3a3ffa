"""Worker bodies for test_failures.py (run inside spawned workers; no pytest import).

Bodies catch the errors they provoke and return what they saw (exception class, message, time
taken); the tests judge it, so that a missing or wrong error is reported as such.
"""
from __future__ import annotations

import os
import signal
import socket
import struct
import threading
import time

import numpy as np

import kungfu as kf


def _peers():
    return os.environ["KUNGFU_INIT_PEERS"].split(",")


def _outcome(fn):
    """(error class name or None, message, seconds, is-ConnectionError/ValueError/TimeoutError)."""
    t0 = time.monotonic()
    try:
        value = fn()
        return {"error": None, "value": value, "seconds": time.monotonic() - t0}
    except Exception as e:  # noqa: BLE001 - the test judges it
        return {"error": type(e).__name__, "message": str(e), "seconds": time.monotonic() - t0,
                "mro": [c.__name__ for c in type(e).__mro__]}


# -- (a) a peer dies ---------------------------------------------------------------------------

LINGER = 2.5

def peer_dies(victim: int, mode: str, strategy: str, count: int):
    """`victim` dies while the others are in (or waiting on) an allreduce named "doomed".

    mode "waiting": the victim never calls the op, and kills itself (SIGKILL) 0.5 s after the
    warm-up; "in-op": everyone, the victim included, loops over big allreduces and the victim is
    killed by a timer 0.5 s in; "exit": the victim returns normally (its exit handler says
    goodbye) while the others wait.
    Survivors return what the failing op raised, when, and what a later op raises.
    """
    r, n = kf.rank(), kf.size()
    kf.init()
    warm = kf.allreduce(np.ones(8, np.float32), name="warm-up", strategy=strategy)
    assert np.array_equal(warm, np.full(8, n, np.float32)), warm
    kf.barrier(name="start")
    t_start = time.time()
    if r == victim:
        if mode == "exit":
            time.sleep(0.5)
            return {"victim": True}
        timer = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGKILL))
        timer.start()
        if mode == "waiting":
            time.sleep(60)
    x = np.ones(count, np.float32)
    steps = 0

    def loop():
        nonlocal steps
        deadline = time.monotonic() + 40
        while time.monotonic() < deadline:
            kf.allreduce(x, name="doomed", strategy=strategy)
            steps += 1
        return "no error within 40 s"

    first = _outcome(loop)
    first["after_death"] = time.time() - (t_start + 0.5)
    first["steps"] = steps
    if r == victim:
        return {"victim": True, "first": first}  # the timer did not fire (a test failure)
    # Stay alive a while, so that no survivor learns of the failure from another survivor's exit.
    time.sleep(LINGER)
    # Later operations fail at once too, whatever their name.
    later = _outcome(lambda: kf.allreduce(np.ones(3, np.int32), name="later", strategy=strategy))
    later_bc = _outcome(lambda: kf.broadcast(np.ones(3, np.int32), root=0, name="later-bc"))
    return {"victim": False, "first": first, "later": later, "later_bc": later_bc,
            "dead": _peers()[victim]}


# -- (b) peers disagree on an operation --------------------------------------------------------

def _mismatch_cases(n: int, r: int):
    odd = r == n - 1  # only the last rank differs
    a = np.arange

    return [
        ("allreduce-size-10-vs-11", lambda: kf.allreduce(
            a(11 if odd else 10, dtype=np.int32), name="mm/1")),
        ("allreduce-size-1000-vs-999-ring", lambda: kf.allreduce(
            a(999 if odd else 1000, dtype=np.float32), name="mm/2", strategy="RING")),
        ("allreduce-size-0-vs-1-star", lambda: kf.allreduce(
            a(1 if odd else 0, dtype=np.float64), name="mm/3", strategy="STAR")),
        ("allreduce-size-100000-vs-100001-tree", lambda: kf.allreduce(
            a(100001 if odd else 100000, dtype=np.float32), name="mm/4", strategy="TREE")),
        ("allreduce-dtype-int32-vs-float32", lambda: kf.allreduce(
            a(16, dtype=np.float32 if odd else np.int32), name="mm/5")),
        ("allreduce-dtype-float16-vs-bfloat16", lambda: kf.allreduce(
            np.ones(16, dtype=_bf16() if odd else np.float16), name="mm/6",
            strategy="BINARY_TREE_STAR")),
        ("allreduce-dtype-int64-vs-uint64-clique", lambda: kf.allreduce(
            a(5, dtype=np.uint64 if odd else np.int64), name="mm/7", strategy="CLIQUE")),
        ("broadcast-size", lambda: kf.broadcast(a(7 if odd else 8, dtype=np.int8), root=0,
                                                name="mm/8")),
        ("reduce-size", lambda: kf.reduce(a(7 if odd else 8, dtype=np.int16), root=0,
                                          name="mm/9")),
        ("allgather-dtype", lambda: kf.allgather(
            a(4, dtype=np.uint16 if odd else np.int16), name="mm/10")),
        ("gather-dtype", lambda: kf.gather(
            a(4, dtype=np.float32 if odd else np.int32), root=0, name="mm/11")),
        ("allreduce-avg-dtype-float16-vs-float32", lambda: kf.allreduce(
            np.ones(16, dtype=np.float32 if odd else np.float16), op="avg", name="mm/12")),
    ]


def _bf16():
    import ml_dtypes
    return ml_dtypes.bfloat16


def mismatch():
    """Each case: the last rank disagrees on size or dtype; then a matching op must still work."""
    r, n = kf.rank(), kf.size()
    kf.init()
    out = []
    for i, (label, fn) in enumerate(_mismatch_cases(n, r)):
        o = _outcome(fn)
        o["case"] = label
        o["op"] = f"mm/{i + 1}"  # the cases are named mm/1, mm/2, ... in order
        after = _outcome(lambda: kf.allreduce(np.full(3, r + 1, np.int64), name=f"mm/after/{i}",
                                              timeout=20))
        if after["error"] is None:
            ok = np.array_equal(after["value"], np.full(3, n * (n + 1) // 2))
            after = {"error": None, "ok": bool(ok), "value": after["value"].tolist()}
        o["after"] = after
        o.pop("value", None)
        out.append(o)
    return out


# -- (c) invalid arguments ---------------------------------------------------------------------

def invalid_arguments():
    """Every rank makes the same bad call; each must raise ValueError at once."""
    r, n = kf.rank(), kf.size()
    kf.init()
    x = np.arange(6, dtype=np.float32)
    cases = [
        ("unknown-strategy", ("strategy", "NO_SUCH_STRATEGY"),
         lambda: kf.allreduce(x, strategy="NO_SUCH_STRATEGY")),
        ("unknown-strategy-broadcast", ("strategy", "SPIRAL"),
         lambda: kf.broadcast(x, strategy="SPIRAL")),
        ("negative-root-broadcast", ("root", "-1"), lambda: kf.broadcast(x, root=-1)),
        ("root-equals-size-broadcast", ("root", str(n)), lambda: kf.broadcast(x, root=n)),
        ("root-too-large-reduce", ("root", str(n + 5)), lambda: kf.reduce(x, root=n + 5)),
        ("negative-root-gather", ("root", "-3"), lambda: kf.gather(x, root=-3)),
        ("unknown-op", ("mean",), lambda: kf.allreduce(x, op="mean")),
        ("unknown-op-reduce", ("avg",), lambda: kf.reduce(x, op="avg")),
        ("complex64", ("complex64",), lambda: kf.allreduce(np.ones(3, np.complex64))),
        ("complex128-broadcast", ("complex128",), lambda: kf.broadcast(np.ones(3, complex))),
        ("object", ("object",), lambda: kf.allreduce(np.array([1, "a"], dtype=object))),
        ("str-array-allgather", ("str",), lambda: kf.allgather(np.array(["ab", "c"]))),
        ("bool-sum", ("bool", "sum"), lambda: kf.allreduce(np.ones(3, bool))),
        ("bool-avg", ("bool", "avg"), lambda: kf.allreduce(np.ones(3, bool), op="avg")),
        ("bool-prod", ("bool", "prod"), lambda: kf.allreduce(np.ones(3, bool), op="prod")),
        ("list-input", ("list",), lambda: kf.allreduce([1, 2, 3])),
        ("str-input", ("str",), lambda: kf.allreduce("abc")),
        ("zero-timeout", ("timeout",), lambda: kf.allreduce(x, timeout=0)),
        ("negative-timeout", ("timeout",), lambda: kf.barrier(timeout=-1)),
    ]
    out = []
    for i, (label, words, fn) in enumerate(cases):
        o = _outcome(fn)
        o["case"] = label
        o["words"] = words
        after = _outcome(lambda: kf.allreduce(np.int64(r + 1), name=f"inv/after/{i}", timeout=20))
        o["after_ok"] = after["error"] is None and after["value"] == n * (n + 1) // 2
        o["after"] = after.get("message")
        o.pop("value", None)
        out.append(o)
    return out


def init_only():
    kf.init()
    return kf.allreduce(np.int32(1))


# -- (d) deadlines -----------------------------------------------------------------------------

def lonely_op(per_op_timeout):
    """Rank 0 runs an op that no one else joins; then both run a matching op."""
    r, n = kf.rank(), kf.size()
    kf.init()
    kf.barrier()
    res = {}
    if r == 0:
        res["lonely"] = _outcome(lambda: kf.allreduce(np.ones(4, np.float32), name="never",
                                                      timeout=per_op_timeout))
        res["lonely_bc"] = _outcome(lambda: kf.broadcast(np.ones(4, np.float32), name="never-bc",
                                                         root=1, timeout=per_op_timeout))
        res["lonely_barrier"] = _outcome(lambda: kf.barrier(name="never-barrier",
                                                            timeout=per_op_timeout))
    else:
        time.sleep(3.5)  # rank 0's three lonely ops time out meanwhile
    after = kf.allreduce(np.full(2, r + 1, np.int32), name="after-timeout", timeout=20)
    res["after"] = after.tolist()
    return res


# -- (e) strangers -----------------------------------------------------------------------------

MAGIC = 0x3155464B
PROTO = 3  # net.h kProto
# magic, proto, type, dtype, version, seq, tag, total_count, payload_len, name_len, flags, sig,
# digest (net.h Frame)
_FRAME = struct.Struct("<IHBBQQQQQIIQQ")
assert _FRAME.size == 72


def _hello(src: str, dst: str, version: int = 0, proto: int = PROTO, name_len=None) -> bytes:
    """Step 1 of the handshake as a real dialer sends it: the name and a 32-byte nonce."""
    name = f"{src}>{dst}".encode()
    nonce = os.urandom(32)
    return _FRAME.pack(MAGIC, proto, 1, 0, version, 0, 0, 0, len(nonce),
                       len(name) if name_len is None else name_len, 0, 0, 0) + name + nonce


def _probe(target: str, payload: bytes, unix: bool = False, wait: float = 6.0):
    """Connects to target, sends payload, and reads until the other side closes.

    Returns ("closed", reply bytes, seconds) when the worker closed the stream, or
    ("open", ...) if it still held it after `wait` seconds.
    """
    host, port = target.rsplit(":", 1)
    if unix:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect("\0kungfu-" + target)
    else:
        s = socket.create_connection((host, int(port)), timeout=5)
    t0 = time.monotonic()
    s.settimeout(wait)
    reply = b""
    try:
        if payload:
            s.sendall(payload)
        while True:
            chunk = s.recv(4096)
            if not chunk:
                return ("closed", reply, time.monotonic() - t0)
            reply += chunk
    except ConnectionResetError:
        return ("closed", reply, time.monotonic() - t0)
    except socket.timeout:
        return ("open", reply, time.monotonic() - t0)
    finally:
        s.close()


def _reply_code(reply: bytes):
    """The status code of the last handshake reply in `reply` (0: accepted so far), or None."""
    code = None
    while len(reply) >= _FRAME.size:
        f = _FRAME.unpack(reply[:_FRAME.size])
        if f[0] != MAGIC or f[2] != 2:
            return None
        code = f[10]  # flags: the status code of the verdict
        reply = reply[_FRAME.size + f[9] + f[8]:]
    return code


def _bogus_proof() -> bytes:
    """Step 3 from a dialer that does not know the job token."""
    proof = os.urandom(32)
    return _FRAME.pack(MAGIC, PROTO, 10, 0, 0, 0, 0, 0, len(proof), 0, 0, 0, 0) + proof


def strangers():
    """Every rank probes its right neighbour with bogus connections, between collectives."""
    r, n = kf.rank(), kf.size()
    peers = _peers()
    me, target = peers[r], peers[(r + 1) % n]
    left = peers[(r - 1) % n]
    garbage = np.random.default_rng(r).integers(0, 256, 300, dtype=np.uint8).tobytes()

    # While this worker connects to its peers, a thread keeps sending garbage to the neighbour.
    stop = threading.Event()
    hammered = [0]

    def hammer():
        while not stop.is_set():
            try:
                _probe(target, garbage, wait=2)
                hammered[0] += 1
            except OSError:
                time.sleep(0.01)  # not listening yet

    th = threading.Thread(target=hammer, daemon=True)
    th.start()
    kf.init()
    first = kf.allreduce(np.int32(r), name="during-hammer", timeout=30)
    stop.set()
    th.join()

    probes = [
        ("garbage-300-bytes", garbage, False),
        ("garbage-short-then-silent", b"GET / HTTP/1.0\r\n", False),
        ("connect-and-close", b"", False),
        ("hello-from-stranger", _hello("10.1.2.3:4000", target), False),
        ("hello-impersonating-a-peer", _hello(left if n > 2 else me, target) + _bogus_proof(), False),
        ("hello-to-wrong-destination", _hello(me, "127.0.0.1:1"), False),
        ("hello-wrong-cluster-version", _hello(me, target, version=7), False),
        ("hello-wrong-protocol", _hello(me, target, proto=99), False),
        ("hello-huge-name", _hello(me, target, name_len=1 << 30), False),
        ("hello-without-separator", _FRAME.pack(MAGIC, PROTO, 1, 0, 0, 0, 0, 0, 0, 5, 0, 0, 0) + b"abcde",
         False),
        ("garbage-unix-socket", garbage, True),
        ("hello-from-stranger-unix", _hello("10.1.2.3:4000", target), True),
    ]
    out = {"first": int(first), "hammered": hammered[0], "probes": [], "target": target}
    for i, (label, payload, unix) in enumerate(probes):
        try:
            state, reply, secs = _probe(target, payload, unix=unix)
            res = {"case": label, "state": state, "seconds": secs,
                   "code": _reply_code(reply), "reply_len": len(reply)}
        except OSError as e:
            res = {"case": label, "state": f"connect failed: {e}"}
        got = kf.allreduce(np.arange(5, dtype=np.int64) + r, name=f"after-probe/{i}", timeout=30)
        res["after_ok"] = bool(np.array_equal(got, np.arange(5) * n + n * (n - 1) // 2))
        out["probes"].append(res)
    return out


# -- a peer that comes up late -----------------------------------------------------------------

def late_peer(delay: float):
    """The last rank starts its peer `delay` seconds after the others; all then allreduce."""
    if os.environ["KUNGFU_SELF_SPEC"] == _peers()[-1]:
        time.sleep(delay)
    return kf.allreduce(np.ones(3, np.float32)).tolist()
