"""The public API in one process (rank 0 of a cluster of size 1), errors, and import hygiene."""
import os
import subprocess
import sys
import threading

import ml_dtypes
import numpy as np
import pytest

import kungfu as kf
import kungfu.python as kp
from kungfu import errors

pytestmark = pytest.mark.timeout(60)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STRATEGIES = ["STAR", "RING", "TREE", "BINARY_TREE", "BINARY_TREE_STAR",
              "MULTI_BINARY_TREE_STAR", "CLIQUE", "DIRECT", "HIERARCHICAL", "MULTI_STAR",
              "AUTO"]
DTYPES = [np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64,
          np.float16, ml_dtypes.bfloat16, np.float32, np.float64]


@pytest.fixture(autouse=True)
def _alone(monkeypatch):
    # This process must be a cluster of one whatever the calling shell exports.
    for k in list(os.environ):
        if k.startswith("KUNGFU_"):
            monkeypatch.delenv(k)


def _python(code: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUNGFU_")}
    env["PYTHONPATH"] = os.pathsep.join([REPO_ROOT] + [p for p in [env.get("PYTHONPATH")] if p])
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=30)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_import_does_not_pull_in_frameworks():
    out = _python(
        "import sys, numpy as np, kungfu, kungfu.python\n"
        "kungfu.allreduce(np.ones(3)); kungfu.barrier()\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in "
        "('tensorflow', 'keras', 'torch', 'jax', 'kungfu.tensorflow'))\n"
        "bad += [m for m in sys.modules if m.startswith('kungfu.tensorflow')]\n"
        "print('BAD', bad)\n")
    assert "BAD []" in out, out


def test_import_is_cheap_and_starts_nothing():
    out = _python(
        "import threading, kungfu\n"
        "from kungfu import _peer\n"
        "print(_peer.started(), threading.active_count())\n")
    assert out.split() == ["False", "1"], out


# -- errors ------------------------------------------------------------------------------------

@pytest.mark.parametrize("code,cls,builtin", [
    (1, errors.InvalidArgumentError, ValueError),
    (2, errors.OpTimeoutError, TimeoutError),
    (3, errors.PeerFailedError, ConnectionError),
    (4, errors.InternalError, RuntimeError),
    (5, errors.CancelledError, RuntimeError),
])
def test_raise_for_status(code, cls, builtin):
    with pytest.raises(cls) as e:
        errors.raise_for_status((code, f"message {code}"))
    assert type(e.value) is cls
    assert isinstance(e.value, builtin) and isinstance(e.value, errors.KungFuError)
    assert str(e.value) == f"message {code}"


def test_raise_for_status_ok_and_unknown():
    assert errors.raise_for_status((0, "")) is None
    assert errors.raise_for_status((0, "ignored")) is None
    with pytest.raises(errors.InternalError, match="strange"):
        errors.raise_for_status((99, "strange"))


def test_error_classes_are_distinct():
    classes = [errors.InvalidArgumentError, errors.OpTimeoutError, errors.PeerFailedError,
               errors.InternalError, errors.CancelledError]
    for a in classes:
        for b in classes:
            assert (a is b) == issubclass(a, b)
    assert not issubclass(errors.OpTimeoutError, ValueError)
    assert not issubclass(errors.PeerFailedError, TimeoutError)


# -- a cluster of one --------------------------------------------------------------------------

def test_identity_alone():
    assert (kf.rank(), kf.size(), kf.local_rank(), kf.local_size()) == (0, 1, 0, 1)
    kf.init()
    kf.init()  # idempotent
    assert (kf.rank(), kf.size(), kf.local_rank(), kf.local_size()) == (0, 1, 0, 1)


def test_compat_module_alone():
    assert (kp.current_rank(), kp.current_cluster_size(), kp.current_local_rank(),
            kp.current_local_size(), kp.detached()) == (0, 1, 0, 1, False)
    assert kp.run_barrier() is None
    assert kp.all_reduce_int_max(-17) == -17 and type(kp.all_reduce_int_max(3)) is int


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape", [(0,), (1,), (7,), (3, 5, 7), (0, 4)],
                         ids=lambda s: "x".join(map(str, s)))
def test_allreduce_alone_returns_the_input(dtype, shape):
    x = (np.arange(int(np.prod(shape))) % 11 - 3).reshape(shape).astype(dtype)
    if np.dtype(dtype).kind == "u":
        x = (np.arange(int(np.prod(shape))) % 11).reshape(shape).astype(dtype)
    keep = x.copy()
    for op in ("sum", "avg", "min", "max", "prod"):
        for strategy in (None, "RING", "STAR"):
            got = kf.allreduce(x, op=op, strategy=strategy)
            assert isinstance(got, np.ndarray) and got is not x
            assert got.dtype == np.dtype(dtype) and got.shape == shape, (op, got.dtype, got.shape)
            np.testing.assert_array_equal(got.astype(np.float64), x.astype(np.float64))
    np.testing.assert_array_equal(x, keep)


@pytest.mark.parametrize("strategy", STRATEGIES + ["ring", "Binary_Tree_Star"])
def test_every_strategy_name_is_accepted(strategy):
    x = np.arange(5, dtype=np.int32)
    np.testing.assert_array_equal(kf.allreduce(x, strategy=strategy), x)
    np.testing.assert_array_equal(kf.broadcast(x, strategy=strategy), x)
    np.testing.assert_array_equal(kf.reduce(x, strategy=strategy), x)


def test_allreduce_out_alone():
    x = np.arange(10, dtype=np.int32)
    same = kf.allreduce(x, out=x)
    assert same is x and x.tolist() == list(range(10))
    dst = np.zeros_like(x)
    got = kf.allreduce(x, op="avg", out=dst)
    assert got is dst and dst.tolist() == list(range(10))
    for bad in (np.zeros(9, np.int32), np.zeros(10, np.int64), np.zeros(20, np.int32)[::2],
                [0] * 10):
        with pytest.raises(errors.InvalidArgumentError, match="out"):
            kf.allreduce(x, out=bad)
    ro = np.zeros_like(x)
    ro.flags.writeable = False
    with pytest.raises(errors.InvalidArgumentError, match="out"):
        kf.allreduce(x, out=ro)


@pytest.mark.parametrize("pool", ["default", "0"])
def test_result_pool_setting(pool):
    """KUNGFU_RESULT_POOL_BYTES: large results without out= come from the native pool (their
    memory owned by it, reused once freed) unless 0 turns it off (plain np.empty)."""
    code = ("import os, numpy as np, kungfu\n"
            + ("" if pool == "default" else f"os.environ['KUNGFU_RESULT_POOL_BYTES'] = '{pool}'\n")
            + "from kungfu import _native\n"
            "x = np.ones(1 << 19, np.float32)\n"
            "a = kungfu.allreduce(x); ptr = a.__array_interface__['data'][0]\n"
            "print(a.base is None, a.sum() == x.size); del a\n"
            "b = kungfu.allreduce(x)\n"
            "print(b.__array_interface__['data'][0] == ptr, _native.lib().result_pool_held())\n")
    first, second = _python(code).splitlines()
    if pool == "0":
        assert first == "True True"
    else:
        assert first == "False True" and second == "True (0, 0)", (first, second)


def test_bool_min_max_alone():
    x = np.array([True, False, True])
    for op in ("min", "max"):
        got = kf.allreduce(x, op=op)
        assert got.dtype == np.bool_ and got.tolist() == [True, False, True]


@pytest.mark.parametrize("value,op,expected", [
    (3, "sum", 3), (-4, "max", -4), (7, "avg", 7), (2.5, "sum", 2.5), (2.5, "avg", 2.5),
    (True, "max", True), (False, "min", False), (2 ** 62, "sum", 2 ** 62),
])
def test_python_scalars_keep_their_type(value, op, expected):
    got = kf.allreduce(value, op=op)
    assert type(got) is type(value) and got == expected
    got = kf.broadcast(value)
    assert type(got) is type(value) and got == value


@pytest.mark.parametrize("dtype", DTYPES + [np.bool_], ids=lambda d: np.dtype(d).name)
def test_numpy_scalars_keep_their_type(dtype):
    t = np.dtype(dtype).type
    x = t(1)
    op = "max" if dtype is np.bool_ else "sum"
    for got in (kf.allreduce(x, op=op), kf.broadcast(x), kf.reduce(x, op=op)):
        assert type(got) is t and got == x, (type(got), got)


def test_rooted_and_gathering_ops_alone():
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    np.testing.assert_array_equal(kf.broadcast(x, root=0), x)
    np.testing.assert_array_equal(kf.reduce(x, op="prod", root=0), x)
    g = kf.allgather(x)
    assert g.shape == (3, 4) and g.dtype == np.float32
    np.testing.assert_array_equal(g, x)
    np.testing.assert_array_equal(kf.gather(x, root=0), x)
    s = kf.allgather(np.int16(5))
    assert s.shape == (1,) and s.dtype == np.int16 and s[0] == 5
    e = kf.allgather(np.zeros((0, 3), np.uint8))
    assert e.shape == (0, 3) and e.dtype == np.uint8
    assert kf.barrier() is None
    assert kf.barrier(name="named", timeout=5) is None


@pytest.mark.parametrize("value", [np.arange(4), 3, 2.5, "text", b"bytes", b"", np.float16(1)])
def test_consensus_alone_is_true(value):
    got = kf.consensus(value)
    assert got is True


def test_async_handles_alone():
    x = np.arange(6, dtype=np.int64)
    h = kf.allreduce_async(x, name="alone")
    calls = []
    fired = threading.Event()

    def cb(handle):
        calls.append(handle)
        fired.set()

    h.add_done_callback(cb)
    np.testing.assert_array_equal(h.wait(), x)
    assert h.done()
    assert fired.wait(5)
    np.testing.assert_array_equal(h.wait(timeout=1), x)  # waiting again returns the same
    assert calls == [h]
    handles = [kf.broadcast_async(x), kf.allgather_async(x), kf.gather_async(x),
               kf.reduce_async(x), kf.consensus_async(b"z")]
    results = [hh.wait() for hh in handles]
    for r in results[:4]:
        np.testing.assert_array_equal(r, x)
    assert results[4] is True


@pytest.mark.parametrize("call,words", [
    (lambda: kf.allreduce(np.ones(2), op="mean"), ["mean"]),
    (lambda: kf.reduce(np.ones(2), op="avg"), ["avg"]),
    (lambda: kf.allreduce(np.ones(2), strategy="SPIRAL"), ["SPIRAL"]),
    (lambda: kf.broadcast(np.ones(2), root=1), ["root"]),
    (lambda: kf.broadcast(np.ones(2), root=-1), ["root"]),
    (lambda: kf.reduce(np.ones(2), root=3), ["root"]),
    (lambda: kf.gather(np.ones(2), root=1), ["root"]),
    (lambda: kf.allreduce(np.ones(2, np.complex64)), ["complex64"]),
    (lambda: kf.allgather(np.array([None, 1])), ["object"]),
    (lambda: kf.allreduce(np.ones(2, bool)), ["bool"]),
    (lambda: kf.allreduce(np.ones(2, bool), op="avg"), ["bool"]),
    (lambda: kf.allreduce([1.0, 2.0]), ["list"]),
    (lambda: kf.allreduce(None), ["NoneType"]),
    (lambda: kf.allreduce(np.ones(2), timeout=0), ["timeout"]),
    (lambda: kf.allreduce(np.ones(2), timeout=-3), ["timeout"]),
], ids=["op-mean", "reduce-avg", "strategy", "root-1", "root-neg", "reduce-root", "gather-root",
        "complex64", "object", "bool-sum", "bool-avg", "list", "none", "timeout-0",
        "timeout-neg"])
def test_bad_arguments_alone(call, words):
    with pytest.raises(errors.InvalidArgumentError) as e:
        call()
    assert isinstance(e.value, ValueError)
    for w in words:
        assert w in str(e.value), str(e.value)
    # The runtime is still usable.
    assert kf.allreduce(4) == 4


def test_public_names():
    for name in kf.__all__:
        assert hasattr(kf, name), name
    for name in kp.__all__:
        assert callable(getattr(kp, name)), name
    assert isinstance(kf.__version__, str)


def test_every_runtime_status_has_its_exception():
    from kungfu import _kungfu, errors

    codes = _kungfu.status_codes()
    assert set(codes.values()) == set(errors._BY_NAME), codes
    for code, name in codes.items():
        with pytest.raises(errors._BY_NAME[name]):
            errors.raise_for_status((code, "x"))
    assert codes[7] == "RESOURCE_EXHAUSTED" and issubclass(errors.ResourceExhaustedError, MemoryError)
