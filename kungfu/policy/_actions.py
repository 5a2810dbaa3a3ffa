"""Actions a policy takes, applied at the same step on every worker.

Inside a policy hook run by `kf.Hook` (a "decision round"), an action is checked at once (bad
input raises ValueError in the caller, on whichever worker called it) and recorded. At the end of
the round the Hook runs `agree()`:

1. every worker contributes its recorded decisions (JSON) to one allgather;
2. for each kind of action, the decision of the lowest rank that took one wins (so a decision
   taken on one worker only is applied everywhere, and two conflicting ones resolve the same way
   on every worker);
3. every worker applies the winners in a fixed order: strategy or tree, batch size, per-worker
   batch sizes, learning rate.

Outside a decision round, `set_tree` and `set_strategy` are collectives that every worker calls
with the same argument; batch size and learning rate need a Hook (they change what it drives).
"""
from __future__ import annotations

import json
import math
import numbers
from typing import Dict, List, Optional, Sequence

import numpy as np

from kungfu import _peer

# Decision kinds in the order they are applied ("resize" and "elastic": kungfu/elastic/_protocol.py).
KINDS = ("strategy", "batch_size", "batch_sizes", "learning_rate", "resize", "elastic")

_round: Optional[Dict[str, object]] = None  # decisions of the current round, if one is open


def open_round() -> None:
    global _round
    _round = {}


def close_round() -> Dict[str, object]:
    global _round
    decisions, _round = _round or {}, None
    return decisions


def in_round() -> bool:
    return _round is not None


def recorded(kind: str) -> bool:
    """Whether the open round holds a decision of this kind."""
    return _round is not None and kind in _round


def _record(kind: str, value) -> bool:
    if _round is None:
        return False
    _round[kind] = value
    return True


def agree(decisions: Dict[str, object], name: str, report: Optional[dict] = None):
    """(winners, reports): the winning decision of each kind (the lowest deciding rank's), and
    every worker's `report` in rank order (what it measured, e.g. its compute time), the same
    on every worker. The reports ride on the round's one allgather."""
    import kungfu as kf

    if kf.size() == 1:
        return dict(decisions), [report]
    mine = json.dumps({"decisions": decisions, "report": report}, sort_keys=True).encode()
    mine = np.frombuffer(mine, dtype=np.uint8)
    lengths = kf.allgather(np.array([mine.size], dtype=np.int64), name=f"{name}/lengths")
    payload = kf.allgather(mine, name=f"{name}/decisions")
    winners: Dict[str, object] = {}
    reports = []
    offset = 0
    for length in lengths.tolist():
        theirs = json.loads(payload[offset:offset + length].tobytes().decode())
        offset += length
        reports.append(theirs["report"])
        for kind, value in theirs["decisions"].items():
            winners.setdefault(kind, value)
    return winners, reports


# -- strategy and tree ---------------------------------------------------------------------------

def _strategy_code(name: str) -> int:
    from kungfu import _kungfu

    if not isinstance(name, str):
        raise TypeError(f"strategy must be a name such as 'RING', got {type(name).__name__}")
    try:
        return _kungfu.parse_strategy(name)
    except ValueError as e:
        raise ValueError(str(e)) from None


def _tree_ints(fathers: Sequence[int]) -> List[int]:
    if isinstance(fathers, (str, bytes)) or not hasattr(fathers, "__len__"):
        raise TypeError(f"a tree is a father array (a list of ranks), got {type(fathers).__name__}")
    tree = []
    for f in fathers:
        if isinstance(f, bool) or not isinstance(f, numbers.Integral):
            raise ValueError(f"tree: fathers must be integers, got {f!r}")
        tree.append(int(f))
    return tree


def check_tree(fathers: Sequence[int], size: Optional[int] = None) -> List[int]:
    """fathers as a list of ints, or ValueError naming what is wrong with it."""
    from kungfu import _kungfu
    import kungfu as kf

    tree = _tree_ints(fathers)
    n = kf.size() if size is None else size
    code, message = _kungfu.validate_tree(tree, n)
    if code != 0:
        raise ValueError(f"malformed tree {tree}: {message}")
    return tree


def _install(kind: int, tree: List[int], name: str) -> None:
    from kungfu._collective import Handle

    native = _peer.get().set_strategy(kind, tree, name, -1)
    Handle(native, lambda: None).wait()


def set_tree(fathers: Sequence[int]) -> None:
    """Reduce along this tree from now on: fathers[i] is rank i's parent, fathers[root] == root
    (one root; a forest is rejected). A malformed tree is a ValueError and changes nothing.

    In a policy hook the tree is checked at once, on the calling worker. Outside, this is a
    collective: the runtime agrees first and checks after, so a tree that is malformed on some
    workers only, or trees that differ, fail on every worker rather than leaving some waiting."""
    if in_round():
        _record("strategy", {"tree": check_tree(fathers)})
        return
    try:
        tree = _tree_ints(fathers)
    except (TypeError, ValueError):
        # Still take part (with a proposal no one else makes), so the others fail too.
        try:
            _install(_strategy_code("TREE"), [-1], "kungfu::set-tree")
        except ValueError:
            pass
        raise
    _install(_strategy_code("TREE"), tree, "kungfu::set-tree")


def set_strategy(name: str) -> None:
    """Use this named strategy (RING, STAR, BINARY_TREE_STAR, AUTO, ...) from now on."""
    if in_round():
        _strategy_code(name)
        _record("strategy", {"name": name.upper()})
        return
    try:
        code = _strategy_code(name)
    except (TypeError, ValueError):
        try:  # take part, as set_tree does, so the others fail too
            _install(-1, [], "kungfu::set-strategy")
        except ValueError:
            pass
        raise
    _install(code, [], "kungfu::set-strategy")


def apply_strategy(decision: dict) -> None:
    if "tree" in decision:
        _install(_strategy_code("TREE"), list(decision["tree"]), "kungfu::set-tree")
    else:
        _install(_strategy_code(decision["name"]), [], "kungfu::set-strategy")


def current_strategy() -> dict:
    """{"name": ...} or {"tree": [...]}: the default strategy in force."""
    from kungfu import _kungfu

    kind, tree = _peer.get().default_strategy()
    return {"tree": list(tree)} if tree else {"name": _kungfu.strategy_name(kind)}


def strategy_stats() -> Dict[str, dict]:
    """Allreduce traffic per strategy so far (operations that used the default strategy):
    {name: {"ops", "bytes", "seconds", "bytes_per_s"}} for strategies that ran at least once."""
    out = {}
    for name, ops, nbytes, seconds in _peer.get().strategy_counters():
        if ops:
            out[name] = {"ops": ops, "bytes": nbytes, "seconds": seconds,
                         "bytes_per_s": nbytes / seconds if seconds > 0 else math.inf}
    return out


# -- batch size and learning rate --------------------------------------------------------------

def check_batch_size(b) -> int:
    if isinstance(b, bool) or not isinstance(b, numbers.Integral) or b < 1:
        raise ValueError(f"batch size must be a positive integer, got {b!r}")
    return int(b)


def check_learning_rate(lr) -> float:
    if isinstance(lr, bool) or not isinstance(lr, numbers.Real) or not (
            math.isfinite(float(lr)) and float(lr) >= 0):
        raise ValueError(f"learning rate must be a finite number >= 0, got {lr!r}")
    return float(lr)


def _needs_hook(what: str):
    raise RuntimeError(f"{what} is applied by kf.Hook: call it from a policy hook that a "
                       "kf.Hook runs (model.fit(callbacks=[kf.Hook(policy)]) or the Hook's "
                       "methods in a custom loop)")


def set_batch_size(b: int) -> None:
    """This worker's (local) batch size from the next step on; the global batch is the sum over
    the workers (b * size when every worker uses b)."""
    b = check_batch_size(b)
    if not _record("batch_size", b):
        _needs_hook("kf.set_batch_size")


# What the Hook trains with now (set by kf.Hook as sizes change), to check a split against.
_training = {"global_batch_size": None, "cluster_size": None}


def note_training(global_batch_size: Optional[int], cluster_size: int) -> None:
    _training.update(global_batch_size=global_batch_size, cluster_size=cluster_size)


def check_batch_sizes(sizes) -> List[int]:
    """sizes as a list of ints, or ValueError naming what is wrong: one positive batch size
    per worker, summing to the global batch size trained with now."""
    if isinstance(sizes, (str, bytes)) or not hasattr(sizes, "__len__"):
        raise ValueError(f"batch sizes must be a list with one size per worker, got {sizes!r}")
    sizes = [check_batch_size(b) for b in sizes]
    n, total = _training["cluster_size"], _training["global_batch_size"]
    if n is not None and len(sizes) != n:
        raise ValueError(f"batch sizes: {len(sizes)} given, the cluster has {n} workers")
    if total is not None and sum(sizes) != total:
        raise ValueError(f"batch sizes {sizes} sum to {sum(sizes)}, not to the global batch "
                         f"size {total} (kf.set_batch_sizes splits it; kf.set_batch_size changes "
                         "it)")
    return sizes


def set_batch_sizes(sizes: Sequence[int]) -> None:
    """Splits the global batch unevenly from the next step on: worker r trains on sizes[r]
    samples of each step's slice (the global batch, the sum, stays). kf.ElasticData serves the
    parts; their sample weights keep the averaged gradient the mean over the whole slice. Bad
    sizes (wrong count, not positive, a different sum) raise ValueError and change nothing. A
    resize returns every worker to the common batch size."""
    sizes = check_batch_sizes(sizes)
    if not _record("batch_sizes", sizes):
        _needs_hook("kf.set_batch_sizes")


def set_learning_rate(lr: float) -> None:
    """The optimizer's learning rate from the next step on."""
    lr = check_learning_rate(lr)
    if not _record("learning_rate", lr):
        _needs_hook("kf.set_learning_rate")


def linear_scaled_lr(base_lr: float, base_batch: int, batch: int) -> float:
    """Linear scaling rule (Goyal et al.): lr grows in proportion to the global batch."""
    return check_learning_rate(base_lr) * check_batch_size(batch) / check_batch_size(base_batch)


def sqrt_scaled_lr(base_lr: float, base_batch: int, batch: int) -> float:
    """Square-root scaling rule: lr grows with the square root of the global batch."""
    return check_learning_rate(base_lr) * math.sqrt(
        check_batch_size(batch) / check_batch_size(base_batch))

