"""Adasum: adaptive summation of the workers' gradients (Maleki et al., "Scaling Distributed
Training with Adaptive Summation", MLSys 2021; Horovod's op=hvd.Adasum).

Two gradients a and b combine as

    adasum(a, b) = (1 - a.b / (2 |a|^2)) a + (1 - a.b / (2 |b|^2)) b

which is a + b when they are orthogonal and a (= b) when they are equal: the sum where the
workers' gradients bring new directions, the average where they agree. A coefficient whose
norm is zero (|a| below the smallest normal double) is 1, as a zero gradient adds nothing.

The workers' gradients combine in a binary tree over the ranks: at level d = 1, 2, 4, ... the
block of ranks [r0, r0 + d) (r0 a multiple of 2d) combines with the block [r0 + d, r0 + 2d) that
follows it, where that block has any rank. Each rank of the second block exchanges its block's
value with the rank d below it, in an allgather of a process set of the two; both compute the
same combination (lower block first, in float64), so after level d every rank of a complete
block holds its block's value. For a power-of-two size every rank ends with the whole tree's
value (Horovod's tree; Horovod's Adasum takes power-of-two sizes only). For other sizes a rank
whose partner block is empty keeps a partial value, so rank 0's value, which is always whole,
is broadcast at the end.

A list of tensors (a model's gradients) is combined per tensor (each its own dot product and
norms, as Horovod does per layer) in one exchange per level. The cost per level is one exchange
of the whole gradient between two workers: log2(n) exchanges where an allreduce's ring moves
about twice the gradient in all.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Union

import numpy as np

from kungfu import _collective, _peer
from kungfu._process_set import ProcessSet
from kungfu.errors import InvalidArgumentError

_TINY = np.finfo(np.float64).tiny  # a squared norm below this counts as zero


def _coefficient(dot: float, normsq: float) -> float:
    return 1.0 - dot / (2.0 * normsq) if normsq >= _TINY else 1.0


def combine(a: Sequence[np.ndarray], b: Sequence[np.ndarray]) -> List[np.ndarray]:
    """adasum(a[i], b[i]) for each tensor i, in float64 (symmetric in a and b, to the last bit:
    the two workers of an exchange compute the same value)."""
    out = []
    for x, y in zip(a, b):
        x, y = x.astype(np.float64).ravel(), y.astype(np.float64).ravel()
        dot = float(x @ y)
        out.append(_coefficient(dot, float(x @ x)) * x + _coefficient(dot, float(y @ y)) * y)
    return out


def _check(tensors: List[np.ndarray]) -> None:
    for t in tensors:
        if t.dtype.kind != "f":
            raise InvalidArgumentError(
                f"adasum takes floating-point tensors (gradients), got {t.dtype.name}")


def adasum(x: Union[np.ndarray, Sequence[np.ndarray]], name: Optional[str] = None,
           timeout: Optional[float] = None) -> Union[np.ndarray, List[np.ndarray]]:
    """The Adasum of every worker's x (an array, or a list of arrays combined per array), on
    every worker, in x's dtypes and shapes. Every worker passes the same shapes and dtypes;
    `name` names the exchanges (default "adasum"); `timeout` is each exchange's deadline."""
    single = isinstance(x, np.ndarray) or np.isscalar(x)
    tensors = [np.asarray(t) for t in ([x] if single else x)]
    _check(tensors)
    peer = _peer.get()
    n, me, name = peer.size, peer.rank, name or "adasum"
    value = [t.astype(np.float64).ravel() for t in tensors]
    sizes = [v.size for v in value]
    d = 1
    while d < n:
        partner = me - d if me % (2 * d) >= d else me + d
        if partner < n:
            both = _collective.allgather(np.concatenate(value) if value else np.zeros(0),
                                         name=f"{name}/{d}", timeout=timeout,
                                         process_set=ProcessSet([me, partner]))
            low, high = np.split(both, 2)
            value = combine(np.split(low, np.cumsum(sizes)[:-1]),
                            np.split(high, np.cumsum(sizes)[:-1]))
        d *= 2
    if n & (n - 1):  # not a power of two: rank 0's value is the whole tree's
        flat = _collective.broadcast(np.concatenate(value) if value else np.zeros(0), 0,
                                     name=f"{name}/result", timeout=timeout)
        value = np.split(flat, np.cumsum(sizes)[:-1])
    out = [v.reshape(t.shape).astype(t.dtype) for v, t in zip(value, tensors)]
    return out[0] if single else out
