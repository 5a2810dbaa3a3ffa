"""The base of adaptation policies (see kungfu/policy/__init__.py)."""
from __future__ import annotations

import copy
from typing import Any, Dict

import numpy as np

from kungfu.elastic import TrainingState


class BasePolicy:
    """Base of adaptation policies: override the hooks you need (each receives the
    TrainingState). Policy state lives in the instance; `state_dict()` / `load_state_dict()`
    (by default: the instance's attributes) make it part of what a worker syncs."""

    def before_train(self, state: TrainingState) -> None:
        pass

    def before_epoch(self, state: TrainingState) -> None:
        pass

    def before_step(self, state: TrainingState) -> None:
        pass

    def after_step(self, state: TrainingState) -> None:
        pass

    def after_epoch(self, state: TrainingState) -> None:
        pass

    def after_train(self, state: TrainingState) -> None:
        pass

    def state_dict(self) -> Dict[str, Any]:
        """The policy's state: by default a copy of its attributes that hold plain data
        (numbers, strings, None, numpy arrays, and lists, tuples and dicts of them); attributes
        that refer to other objects (a model, a file) are the worker's own and are left out."""
        return {k: copy.deepcopy(v) for k, v in self.__dict__.items() if _plain(v)}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(copy.deepcopy(state))


def _plain(v) -> bool:
    if v is None or isinstance(v, (bool, int, float, str, bytes, np.ndarray, np.generic)):
        return True
    if isinstance(v, (list, tuple, set, frozenset)):
        return all(_plain(x) for x in v)
    if isinstance(v, dict):
        return all(_plain(k) and _plain(x) for k, x in v.items())
    return False
