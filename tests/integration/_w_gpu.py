"""Worker bodies for test_gpu.py: kungfu's GPU backends over the test double of NCCL and the CUDA
runtime (tests/gpu_double), whose "device memory" is host memory, so numpy arrays stand in for
device buffers and the results can be read back."""
import os
import time

import numpy as np

from kungfu import _device, _gpu, _peer


def _ptr(a: np.ndarray) -> int:
    return a.ctypes.data


def _run(launch, *arrays, **kw):
    return launch(*[_ptr(a) for a in arrays], keep=arrays, **kw).wait()


def collectives(count: int):
    """Every device collective once; returns what each produced, and the path taken."""
    peer = _peer.get()
    r, n = peer.rank, peer.size
    path, _ = _gpu.backend_for(os.environ["KUNGFU_SELF_SPEC"], os.environ["KUNGFU_INIT_PEERS"].split(","))
    out = {"path": path}
    x = np.arange(count, dtype=np.float32) * (r + 1)
    y = np.full(count, -1, dtype=np.float32)
    _run(_device.allreduce_async, x, y, count=count, dtype=np.float32, op="sum")
    out["sum"] = y.copy()
    z = np.arange(count, dtype=np.int64) - r
    _run(_device.allreduce_async, z, z, count=count, dtype=np.int64, op="max")  # in place
    out["max"] = z.copy()
    b = np.full(count, float(r), dtype=np.float64)
    _run(_device.broadcast_async, b, b, count=count, dtype=np.float64, root=n - 1)
    out["broadcast"] = b.copy()
    if path == "nccl":
        g = np.empty(n * 3, dtype=np.int32)
        _run(_device.allgather_async, np.full(3, r, dtype=np.int32), g, count=3, dtype=np.int32)
        out["allgather"] = g
        rs = np.empty(4, dtype=np.float32)
        _run(_device.reducescatter_async, np.arange(n * 4, dtype=np.float32) + r, rs,
             recv_count=4, dtype=np.float32)
        out["reducescatter"] = rs
        a2a = np.empty(n * 2, dtype=np.int64)
        _run(_device.alltoall_async, np.arange(n * 2, dtype=np.int64) + 100 * r, a2a, count=2,
             dtype=np.int64)
        out["alltoall"] = a2a
    return out


def allreduce_twice(timeout):
    """Two allreduces (timeout None: the op deadline, KUNGFU_OP_TIMEOUT); the error of the first
    that fails (type name, message, seconds it took, which), or None. The rank named by
    LINGER_RANK stays LINGER_S seconds after its error, so that the others see their own
    outcome rather than its exit."""
    x = np.ones(1000, dtype=np.float32)
    rank = _peer.get().rank
    for which in ("first", "second"):
        if which == "second" and os.environ.get("DIE_AFTER_FIRST") == str(rank):
            os._exit(3)
        start = time.monotonic()
        try:
            _run(_device.allreduce_async, x, x, count=x.size, dtype=np.float32, timeout=timeout)
        except Exception as e:  # noqa: BLE001 - what the test looks at
            if os.environ.get("LINGER_RANK") == str(rank):
                time.sleep(float(os.environ["LINGER_S"]))
            return type(e).__name__, str(e), time.monotonic() - start, which
    return None


def shrink_and_reduce():
    """An allreduce at the starting size, then the cluster shrinks by one (a new session, so a
    new communicator) and the survivors allreduce again."""
    ident = _peer.identity_from_env()
    x = np.full(8, _peer.get().rank + 1.0, dtype=np.float32)
    _run(_device.allreduce_async, x, x, count=8, dtype=np.float32)
    first = float(x[0])
    peers = list(ident.peers)
    _peer.replace(ident.self_spec, peers[:-1], ident.version + 1)
    if _peer.detached():
        return first, None
    y = np.full(8, _peer.get().rank + 1.0, dtype=np.float32)
    _run(_device.allreduce_async, y, y, count=8, dtype=np.float32)
    return first, float(y[0])


def without_gpu():
    """What a worker without a GPU backend says when it is given device memory."""
    x = np.ones(4, dtype=np.float32)
    try:
        _run(_device.allreduce_async, x, x, count=4, dtype=np.float32)
    except Exception as e:  # noqa: BLE001
        return type(e).__name__, str(e), _gpu.show_nccl_version()
    return None
