"""The one door to the native module (kungfu/_kungfu*.so: the runtime's pybind11 binding).

Loaded on first use, so that `import kungfu` (and kungfu-run's flag parsing) cost nothing until a
worker needs the runtime. Everything else in the package reaches the binding through `lib()`
and the runtime's own tables through `table()`; the TensorFlow op library has its own door
(kungfu/tensorflow/_oplib.py).
"""
from __future__ import annotations

import functools
import importlib


@functools.lru_cache(maxsize=None)
def lib():
    """The loaded `kungfu._kungfu` module."""
    return importlib.import_module("kungfu._kungfu")


@functools.lru_cache(maxsize=None)
def table(which: str) -> dict:
    """One of the runtime's own tables (one source): "dtype_codes" (dtype name -> code),
    "reduce_ops" (op name -> code), "status_codes" (code -> status name)."""
    return getattr(lib(), which)()


def strategy_code(name: str) -> int:
    """The runtime's code of a strategy name (ValueError naming the known ones if unknown)."""
    return lib().parse_strategy(str(name))
