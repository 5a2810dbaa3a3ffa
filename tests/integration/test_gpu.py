"""kungfu's GPU backends with real processes, over the test double of NCCL and the CUDA runtime
(tests/gpu_double: a shared library with the same entry points, computing across processes on
host memory), loaded through KUNGFU_NCCL_LIBRARY and KUNGFU_CUDART_LIBRARY as a real NCCL would
be. Without the backend the device collectives fail (the TCP backend serves host memory only),
and a fault injected into the double reaches every rank, so these tests see the backend itself.
scripts/gpu_check.sh runs the real thing on a GPU machine."""
import glob
import os
import subprocess

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
        kind, message, _ = o.value
        # The transport saw the peer go and the communicator was aborted: not the 60 s deadline.
        assert kind != "OpTimeoutError" and "deadline" not in message, message
        assert kind in ("PeerFailedError", "UnavailableError"), (kind, message)


def test_a_stalled_rank_ends_at_the_deadline_on_every_rank(spawn, double):
    # Once every rank has begun, an op ends at the op deadline (KUNGFU_OP_TIMEOUT), not the
    # per-call one (peer.h, C2); the double would wait 60 s.
    env = _env(double, "nccl", KUNGFU_GPU_DOUBLE_STALL_RANK=1, KUNGFU_GPU_DOUBLE_AFTER_OPS=1,
               KUNGFU_OP_TIMEOUT="3s")
    got = spawn(2, _w_gpu.allreduce_twice, 30.0, env=env, timeout=60)
    for kind, message, _ in got:
        assert "allreduce" in message, message
    assert "deadline" in got[0][1], got[0]


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
