"""Wrapping a user's torch optimizer: an instance of a subclass of its own class (so that
isinstance(opt, torch.optim.SGD) and LR schedulers keep working) sharing its param_groups and
state, with a KungFu mixin in front of it in the MRO."""
from __future__ import annotations

import itertools
from typing import Iterable, List, Optional, Tuple

import torch

from kungfu import _peer
from kungfu.torch.ops import agree_on

# Each wrapped optimizer names its collectives with its own number: workers that build their
# optimizers in the same order give them the same numbers.
_numbers = itertools.count()


def named_params(optimizer: torch.optim.Optimizer,
                 named_parameters: Optional[Iterable[Tuple[str, torch.Tensor]]]
                 ) -> List[Tuple[str, torch.Tensor]]:
    """The optimizer's parameters in its param_groups' order, named by named_parameters (which
    must name each of them, each name once, as Horovod requires: a list of another model's or
    of a part of the model is a mistake) or by their place (`group{g}.{i}`) without it."""
    names: dict = {}
    owners: dict = {}
    for n, p in (named_parameters or ()):
        n = str(n)
        if owners.setdefault(n, id(p)) != id(p):
            raise ValueError(f"named_parameters names two parameters {n!r}: give each its own "
                             "name (a prefix per model, say)")
        names.setdefault(id(p), n)
    out = []
    for g, group in enumerate(optimizer.param_groups):
        for i, p in enumerate(group["params"]):
            out.append((names.get(id(p), f"group{g}.{i}"), p))
    if named_parameters is not None:
        unnamed = [name for (name, p) in out if id(p) not in names]
        if unnamed:
            raise ValueError(
                f"named_parameters does not name {len(unnamed)} of the optimizer's parameters "
                f"({', '.join(unnamed[:5])}{', ...' if len(unnamed) > 5 else ''}): pass "
                "model.named_parameters() of the model whose parameters the optimizer holds")
    return out


def wrap(mixin: type, optimizer, named_parameters, what: str, **options):
    """An optimizer of class (mixin, type(optimizer)) sharing optimizer's state, set up by
    mixin._kungfu_init(params, prefix, **options) after every worker agreed on the parameters'
    names, shapes and dtypes (a collective: every worker must wrap its optimizer; a worker
    joining an elastic job does not take part, kungfu.torch.ElasticTrainer checks it)."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"{what} wraps a torch.optim.Optimizer, got {type(optimizer).__name__}")
    params = named_params(optimizer, named_parameters)
    prefix = f"kungfu.torch.{mixin.__name__.strip('_')}{next(_numbers)}"
    if not _peer.joining():  # a joiner's are compared with rank 0's when it joins
        agree_on(params, what, prefix, process_set=options.get("process_set"))
    cls = type(type(optimizer).__name__, (mixin, type(optimizer)), {"__module__": __name__})
    wrapped = cls.__new__(cls)
    wrapped.__dict__.update(optimizer.__dict__)  # the same param_groups, state and hooks
    wrapped._kungfu_init(params, prefix, **options)
    return wrapped
