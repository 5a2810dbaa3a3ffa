"""kungfu's GPU backends with real processes, over the test double of NCCL and the CUDA runtime
(tests/gpu_double: a shared library with the same entry points, computing across processes on
host memory), loaded through KUNGFU_NCCL_LIBRARY and KUNGFU_CUDART_LIBRARY as a real NCCL would
be. Without the backend the device collectives fail (the TCP backend serves host memory only),
and a fault injected into the double reaches every rank, so these tests see the backend itself.
scripts/gpu_check.sh runs the real thing on a GPU machine."""
import glob
import os
import subprocess
import sys

import numpy as np
import pytest

import _w_gpu
from conftest import REPO_ROOT


@pytest.fixture(scope="module")
def double(tmp_path_factory):
    """The double's library, built here (no CUDA toolkit involved)."""
    out = str(tmp_path_factory.mktemp("gpu-double") / "libkungfu_gpu_double.so")
    sources = sorted(glob.glob(os.path.join(REPO_ROOT, "tests", "gpu_double", "*.cc")))
    subprocess.run(["g++", "-std=c++17", "-O1", "-shared", "-fPIC", "-pthread", "-o", out,
                    "-I", os.path.join(REPO_ROOT, "srcs", "go-free-runtime", "src"), *sources,
                    "-lrt"], check=True)
    return out


def _env(double, path, **extra):
    env = {"KUNGFU_NCCL_LIBRARY": double, "KUNGFU_CUDART_LIBRARY": double, "KUNGFU_GPU": path}
    env.update({k: str(v) for k, v in extra.items()})
    return env


@pytest.mark.parametrize("np_", [2, 3, 4])
@pytest.mark.parametrize("path", ["nccl", "staging"])
def test_device_collectives_are_exact(spawn, double, path, np_):
    # 70,000 floats: past the double's 64 KiB slot and, with 64 KiB staging chunks, several chunks.
    count = 70000
    got = spawn(np_, _w_gpu.collectives, count,
                env=_env(double, path, KUNGFU_GPU_CHUNK_BYTES=64 << 10))
    k = np.arange(count)
    for r, out in enumerate(got):
        assert out["path"] == path
        np.testing.assert_array_equal(out["sum"], (k * sum(range(1, np_ + 1))).astype(np.float32))
        np.testing.assert_array_equal(out["max"], k)  # max over ranks of k - r
        np.testing.assert_array_equal(out["broadcast"], np.full(count, np_ - 1.0))
        if path == "nccl":
            np.testing.assert_array_equal(out["allgather"], np.repeat(np.arange(np_), 3))
            blocks = sum(np.arange(np_ * 4, dtype=np.float32) + q for q in range(np_))
            np.testing.assert_array_equal(out["reducescatter"], blocks[4 * r:4 * r + 4])
            want = np.array([100 * q + 2 * r + j for q in range(np_) for j in range(2)])
            np.testing.assert_array_equal(out["alltoall"], want)


def test_a_killed_rank_fails_the_others_with_a_peer_error(spawn, double):
    run = spawn.run(3, _w_gpu.allreduce_twice, 60.0,
                    env=_env(double, "nccl", DIE_AFTER_FIRST=1), timeout=60)
    assert run.outcomes[1].returncode == 3
    for r in (0, 2):
        o = run.outcomes[r]
        assert o.ok, o.describe()
        kind, message, _, _ = o.value
        # The transport saw the peer go and the communicator was aborted: not the 60 s deadline.
        assert kind != "OpTimeoutError" and "deadline" not in message, message
        assert kind in ("PeerFailedError", "UnavailableError"), (kind, message)


def test_a_stalled_rank_ends_at_the_deadline_on_every_rank(spawn, double):
    # Rank 1 stalls in its second op (the double would wait 120 s); the op ends at the op
    # deadline (KUNGFU_OP_TIMEOUT, no per-call timeout) on every rank: the first rank whose
    # deadline passes aborts its communicator, which the double reports to a rank still waiting
    # as a remote error (as NCCL reports a peer that closed its connections). Rank 1 stays a
    # while after, so no rank's outcome is rank 1's exit.
    env = _env(double, "nccl", KUNGFU_GPU_DOUBLE_STALL_RANK=1, KUNGFU_GPU_DOUBLE_AFTER_OPS=1,
               KUNGFU_OP_TIMEOUT="3s", LINGER_RANK=1, LINGER_S=6)
    got = spawn(2, _w_gpu.allreduce_twice, None, env=env, timeout=60)
    messages = [message for _, message, _, _ in got]
    for kind, message, _, which in got:
        assert which == "second" and "allreduce" in message, message
        assert "ran past its deadline" in message or "remote process exited" in message, message
    assert any("ran past its deadline" in m for m in messages), messages


def test_a_rank_that_never_joins_the_communicator_ends_at_the_deadline(spawn, double):
    # ncclCommInitRank has no deadline of its own: rank 1 got the unique id and never joins.
    # Rank 0 must not wait for the double's 120 s: the first op's deadline ends the join.
    env = _env(double, "nccl", KUNGFU_GPU_DOUBLE_STALL_INIT_RANK=1, KUNGFU_OP_TIMEOUT="3s",
               LINGER_RANK=1, LINGER_S=6)
    got = spawn(2, _w_gpu.allreduce_twice, None, env=env, timeout=60)
    for kind, message, _, which in got:
        assert which == "first", (kind, message)
        assert "joining the NCCL communicator ran past its deadline" in message, message


def test_a_new_cluster_gets_a_new_communicator(spawn, double):
    got = spawn(3, _w_gpu.shrink_and_reduce, env=_env(double, "nccl"))
    assert [g[0] for g in got] == [6.0, 6.0, 6.0]
    assert [g[1] for g in got] == [3.0, 3.0, None]  # 1 + 2 on the survivors; rank 2 left


def test_without_nccl_a_device_collective_says_why(spawn):
    got = spawn(2, _w_gpu.without_gpu,
                env={"KUNGFU_NCCL_LIBRARY": "/nonexistent/libnccl.so.2", "KUNGFU_GPU": "auto"})
    for kind, message, status in got:
        assert kind == "InvalidArgumentError"
        assert "no GPU backend" in message and "/nonexistent/libnccl.so.2" in message, message
        assert status.startswith("NCCL: not available")


HIERARCHICAL_WORKER = """
import sys
import numpy as np
from kungfu import _device, _peer

r, n = _peer.get().rank, _peer.get().size
out = {}
for count in (1, 5, 70000):
    for dtype in (np.float32, np.int64):
        x = (np.arange(count) % 1000 + r + 1).astype(dtype)
        y = np.full(count, -1, dtype=dtype)
        _device.allreduce_async(x.ctypes.data, y.ctypes.data, count=count, dtype=dtype,
                                keep=(x, y)).wait()
        out[f"sum-{count}-{np.dtype(dtype).name}"] = y
z = (np.arange(1000) * (r + 1) % 997).astype(np.float64)
_device.allreduce_async(z.ctypes.data, z.ctypes.data, count=z.size, dtype=np.float64, op="max",
                        keep=z).wait()  # in place
out["max"] = z
b = np.full(3, float(r))
_device.broadcast_async(b.ctypes.data, b.ctypes.data, count=3, dtype=np.float64, root=n - 1,
                        keep=b).wait()  # the session-wide communicator, beside the hosts' ones
out["broadcast"] = b
np.savez(sys.argv[1] + f"/rank{r}.npz", **out)
"""


@pytest.mark.timeout(180)
@pytest.mark.parametrize("workers", [(2, 2), (1, 3)], ids=["2+2", "1+3"])
def test_the_allreduce_across_hosts_is_hierarchical(double, tmp_path, workers):
    """Two network namespaces as hosts: the device allreduce runs NCCL inside each host (the
    double's trace shows reduces and broadcasts on communicators of one host's ranks, never an
    allreduce of every rank), the TCP ring across hosts; the results are exact on every rank,
    uneven hosts included."""
    from test_multihost import netns_hosts, run_on_both  # one definition of the hosts

    script = tmp_path / "worker.py"
    script.write_text(HIERARCHICAL_WORKER)
    trace = tmp_path / "trace.txt"
    np_ = sum(workers)
    with netns_hosts(2) as hosts:
        spec = ",".join(f"{ip}:{w}" for ip, w in zip(hosts.ip, workers))
        results = run_on_both(
            hosts,
            [["-np", str(np_), "-H", spec, "-self", ip, "-timeout", "90s", sys.executable, str(script),
              str(tmp_path)] for ip in hosts.ip],
            timeout=120,
            env={**_env(double, "nccl"), "KUNGFU_GPU_DOUBLE_TRACE": str(trace)})
    for rc, out, err in results:
        assert rc == 0, f"exit {rc}\nstdout:\n{out}\nstderr:\n{err}"
    got = [np.load(tmp_path / f"rank{r}.npz") for r in range(np_)]
    for count in (1, 5, 70000):
        k = np.arange(count) % 1000
        want = sum(k + q + 1 for q in range(np_))
        for dtype in ("float32", "int64"):
            for r in range(np_):
                np.testing.assert_array_equal(got[r][f"sum-{count}-{dtype}"], want.astype(dtype))
    want_max = np.max([np.arange(1000) * (q + 1) % 997 for q in range(np_)], axis=0)
    for r in range(np_):
        np.testing.assert_array_equal(got[r]["max"], want_max)
        np.testing.assert_array_equal(got[r]["broadcast"], np.full(3, np_ - 1.0))
    ops = [line.split() for line in trace.read_text().splitlines()]
    host_sizes = {str(w) for w in workers}
    assert not [o for o in ops if o[0] == "allreduce"], "an allreduce of NCCL ran: not hierarchical"
    reduces = [o for o in ops if o[0] == "reduce"]
    assert reduces and all(o[-1] in host_sizes for o in reduces), reduces
    # The one broadcast of every rank's communicator is the test's own; the others spread
    # segments inside a host.
    assert sorted(o[-1] for o in ops if o[0] == "broadcast" and o[-1] == str(np_)) == \
        [str(np_)] * np_
