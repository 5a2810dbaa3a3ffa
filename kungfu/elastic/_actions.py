"""The actions a policy takes: checked at once on the calling worker, recorded in the open
decision round (kungfu/elastic/_round.py), applied at the same step on every worker.

Outside a decision round, `set_tree` and `set_strategy` are collectives that every worker calls
with the same argument (kungfu/_strategy.py); batch size and learning rate need a trainer (they
change what it drives). kf.resize outside a round is a collective too (resize_now in
kungfu/elastic/_protocol.py).
"""
from __future__ import annotations

import math
import numbers
import warnings
from typing import List, Sequence

from kungfu import _peer, _strategy
from kungfu.elastic import _round
from kungfu.elastic._protocol import context, resize_now


def set_tree(fathers: Sequence[int]) -> None:
    """Reduce along this tree from now on: fathers[i] is rank i's parent, fathers[root] == root
    (one root; a forest is rejected). A malformed tree is a ValueError and changes nothing.

    In a policy hook the tree is checked at once, on the calling worker. Outside, this is a
    collective: the runtime agrees first and checks after, so a tree that is malformed on some
    workers only, or trees that differ, fail on every worker rather than leaving some waiting."""
    if _round.current() is None:
        _strategy.set_tree_now(fathers)
    else:
        _round.record("strategy", {"tree": _strategy.check_tree(fathers)})


def set_strategy(name: str) -> None:
    """Use this named strategy (RING, STAR, BINARY_TREE_STAR, AUTO, ...) from now on."""
    if _round.current() is None:
        _strategy.set_strategy_now(name)
    else:
        _strategy.strategy_code(name)
        _round.record("strategy", {"name": name.upper()})


def check_batch_size(b) -> int:
    if isinstance(b, bool) or not isinstance(b, numbers.Integral) or b < 1:
        raise ValueError(f"batch size must be a positive integer, got {b!r}")
    return int(b)


def check_learning_rate(lr) -> float:
    if isinstance(lr, bool) or not isinstance(lr, numbers.Real) or not (
            math.isfinite(float(lr)) and float(lr) >= 0):
        raise ValueError(f"learning rate must be a finite number >= 0, got {lr!r}")
    return float(lr)


def _needs_trainer(what: str):
    raise RuntimeError(f"{what} is applied by kf.Hook: call it from a policy hook that a "
                       "kf.Hook runs (model.fit(callbacks=[kf.Hook(policy)]) or the Hook's "
                       "methods in a custom loop)")


def set_batch_size(b: int) -> None:
    """This worker's (local) batch size from the next step on; the global batch is the sum over
    the workers (b * size when every worker uses b)."""
    b = check_batch_size(b)
    if not _round.record("batch_size", b):
        _needs_trainer("kf.set_batch_size")


def check_batch_sizes(sizes, cluster_size=None, global_batch_size=None) -> List[int]:
    """sizes as a list of ints, or ValueError naming what is wrong: one positive batch size
    per worker (`cluster_size` of them), summing to `global_batch_size` (what is trained with
    now; None: not checked)."""
    if isinstance(sizes, (str, bytes)) or not hasattr(sizes, "__len__"):
        raise ValueError(f"batch sizes must be a list with one size per worker, got {sizes!r}")
    sizes = [check_batch_size(b) for b in sizes]
    n, total = cluster_size, global_batch_size
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
    r = _round.current()
    if r is None:
        check_batch_sizes(sizes)
        _needs_trainer("kf.set_batch_sizes")
    state = r.trainer.state
    _round.record("batch_sizes", check_batch_sizes(sizes, state.cluster_size,
                                                   state.global_batch_size))


def set_learning_rate(lr: float) -> None:
    """The optimizer's learning rate from the next step on."""
    lr = check_learning_rate(lr)
    if not _round.record("learning_rate", lr):
        _needs_trainer("kf.set_learning_rate")


def resize(n: int, leave: Sequence[int] = ()) -> bool:
    """Asks for a cluster of n workers. Returns whether the cluster changes (False: n is the
    current size already and no worker leaves). Bad sizes raise ResizeError (a ValueError) at
    once. `leave`: ranks that leave; new workers take their places (with n = size, the
    workers in `leave` are replaced: the new ones join before those leave).

    From a policy hook run by kf.Hook, the decision is agreed, then applied once the new
    workers are ready, without stopping training. In a program with no kf.Hook (a custom
    loop), it is a collective: every worker calls it with the same n at the same point, and it
    returns once the cluster has changed (or the resize was given up: False); see resize_now.

    In a policy hook, a size the job cannot have (more workers than its slots, or any other
    size in a job that is not elastic) is refused: a warning says why, it returns False and
    training goes on, so a policy that probes for more workers never ends the job."""
    ctx = context()
    if _round.current() is not None and isinstance(n, int) and not isinstance(n, bool) \
            and n >= 1 and ctx.unavailable(n):
        warnings.warn(f"kungfu: kf.resize({n}) refused: {ctx.unavailable(n)}; training goes on "
                      f"with {_peer.identity().size} workers")
        return False
    n = ctx.check_size(n)
    gone = ctx.check_leave(leave)
    if _round.current() is None:
        if ctx.driver is not None:
            raise RuntimeError("kf.resize while kf.Hook trains is applied by the Hook: call it "
                               "from a policy hook (kf.BasePolicy)")
        return resize_now(n, leave=leave)
    if n == _peer.identity().size and not gone and ctx.pending is None:
        return False
    _round.record("resize", {"size": n, "leave": gone} if gone else n)
    return True
