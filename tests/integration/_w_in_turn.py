"""One spawn for several worker bodies: `spawn(n, _w_in_turn.in_turn, calls)` runs each body
one after the other in the same worker processes, so their TensorFlow start-up is paid once.
Each body builds its own model and kf.Hook. What one body leaves behind in the process (a Keras
dtype policy, the cluster's strategy) is the next one's starting point: each test module that
plans bodies in turn says why its order is safe."""
from __future__ import annotations

import importlib


def in_turn(calls):
    """[(the body as "module:qualname", its arguments)] -> the bodies' results, in order."""
    results = []
    for spec, args in calls:
        module, _, name = spec.partition(":")
        results.append(getattr(importlib.import_module(module), name)(*args))
    return results
