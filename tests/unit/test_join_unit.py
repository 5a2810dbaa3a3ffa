"""kungfu._join's bookkeeping without processes: which described uses a joined worker serves
(each once, in the order of its name's uses, none it issued itself) and what it contributes."""
from __future__ import annotations

import numpy as np
import pytest

from kungfu import _join
from kungfu.errors import InvalidArgumentError


@pytest.fixture
def served(monkeypatch):
    calls = []
    monkeypatch.setattr(_join, "_serve", lambda d, me, joined, timeout: calls.append(
        (d["n"], d["i"], sorted(joined))))
    return calls


def _desc(name, i, kind="allreduce"):
    return {"k": kind, "n": name, "i": i}


def test_each_use_served_once_in_order(served):
    scope = _join._Scope(None)
    scope.uses = {"g": 2}  # this worker issued uses 0 and 1 of "g" before it joined
    server = _join._Server(scope, me=0)
    # a round: two workers at different uses of "g", one of them already issued here
    server.take([_desc("g", 3), _desc("g", 1), _desc("g", 2), _desc("h", 0)], {0})
    server.take([_desc("g", 3), _desc("g", 4)], {0, 2})  # 3 again (another worker): once
    # per name in the order of its uses (the runtime numbers each name's uses; names among
    # themselves may go in any order: a served collective is issued asynchronously)
    assert [c for c in served if c[0] == "g"] == [("g", 2, [0]), ("g", 3, [0]), ("g", 4, [0, 2])]
    assert [c for c in served if c[0] == "h"] == [("h", 0, [0])]
    assert scope.uses == {"g": 5, "h": 1}
    server.finish()


def test_a_use_that_never_comes_in_order_is_an_error(served):
    scope = _join._Scope(None)
    server = _join._Server(scope, me=1)
    server.take([_desc("g", 1)], {1})  # use 0 was never described
    assert served == []
    with pytest.raises(InvalidArgumentError, match="never came in order"):
        server.finish()


def test_unnamed_uses_are_counted_per_kind(served):
    scope = _join._Scope(None)
    server = _join._Server(scope, me=0)
    server.take([_desc("", 0, "allreduce"), _desc("", 0, "allgather")], {0})
    assert len(served) == 2


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int8, np.int64, np.uint16,
                                   np.bool_])
def test_what_a_joined_worker_contributes_changes_nothing(dtype):
    rng = np.random.default_rng(0)
    x = rng.integers(-50, 50, 6).astype(dtype)
    for op, fn in (("sum", np.add), ("prod", np.multiply), ("min", np.minimum),
                   ("max", np.maximum)):
        e = np.full(6, _join.identity(op, np.dtype(dtype)), dtype)
        np.testing.assert_array_equal(fn(x, e).astype(dtype), x)
    assert _join.identity("avg", np.dtype(dtype)) == 0


def test_join_outside_a_block_is_refused():
    with pytest.raises(InvalidArgumentError, match="inside `with Join"):
        _join.join()
