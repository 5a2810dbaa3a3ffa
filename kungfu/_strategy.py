"""The runtime's default strategy: names, trees, installing one, and what each has carried.

Installing is a collective (`install`): the runtime agrees on the proposal first and checks it
after, so a tree that is malformed on some workers only, or proposals that differ, fail on every
worker. Inside a decision round the public setters (kungfu/elastic/_actions.py) record instead,
and the round installs the agreed winner.
"""
from __future__ import annotations

import math
import numbers
from typing import Dict, List, Optional, Sequence

from kungfu import _native, _peer
from kungfu._collective import Handle


def strategy_code(name: str) -> int:
    """The runtime's code of a strategy name; TypeError or ValueError naming the problem."""
    if not isinstance(name, str):
        raise TypeError(f"strategy must be a name such as 'RING', got {type(name).__name__}")
    try:
        return _native.strategy_code(name)
    except ValueError as e:
        raise ValueError(str(e)) from None


def tree_ints(fathers: Sequence[int]) -> List[int]:
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
    tree = tree_ints(fathers)
    n = _peer.identity().size if size is None else size
    code, message = _native.lib().validate_tree(tree, n)
    if code != 0:
        raise ValueError(f"malformed tree {tree}: {message}")
    return tree


def install(kind: int, tree: List[int], name: str) -> None:
    """Every worker: makes (kind, tree) the default strategy (a collective; see the module doc)."""
    native = _peer.get().set_strategy(kind, tree, name, -1)
    Handle(native, lambda: None).wait()


def set_tree_now(fathers: Sequence[int]) -> None:
    """set_tree as a collective of every worker (outside a decision round)."""
    try:
        tree = tree_ints(fathers)
    except (TypeError, ValueError):
        # Still take part (with a proposal no one else makes), so the others fail too.
        try:
            install(strategy_code("TREE"), [-1], "kungfu::set-tree")
        except ValueError:
            pass
        raise
    install(strategy_code("TREE"), tree, "kungfu::set-tree")


def set_strategy_now(name: str) -> None:
    """set_strategy as a collective of every worker (outside a decision round)."""
    try:
        code = strategy_code(name)
    except (TypeError, ValueError):
        try:  # take part, as set_tree_now does, so the others fail too
            install(-1, [], "kungfu::set-strategy")
        except ValueError:
            pass
        raise
    install(code, [], "kungfu::set-strategy")


def apply(decision: dict) -> None:
    """Installs an agreed decision: {"tree": fathers} or {"name": strategy name}."""
    if "tree" in decision:
        install(strategy_code("TREE"), list(decision["tree"]), "kungfu::set-tree")
    else:
        install(strategy_code(decision["name"]), [], "kungfu::set-strategy")


def current_strategy() -> dict:
    """{"name": ...} or {"tree": [...]}: the default strategy in force."""
    kind, tree = _peer.get().default_strategy()
    return {"tree": list(tree)} if tree else {"name": _native.lib().strategy_name(kind)}


def strategy_stats() -> Dict[str, dict]:
    """Allreduce traffic per strategy so far (operations that used the default strategy):
    {name: {"ops", "bytes", "seconds", "bytes_per_s"}} for strategies that ran at least once."""
    out = {}
    for name, ops, nbytes, seconds in _peer.get().strategy_counters():
        if ops:
            out[name] = {"ops": ops, "bytes": nbytes, "seconds": seconds,
                         "bytes_per_s": nbytes / seconds if seconds > 0 else math.inf}
    return out
