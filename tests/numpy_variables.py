"""A `kungfu.elastic.Variables` binding of plain numpy arrays, for tests of the membership machine
and the checkpoint without a framework (tests/unit/test_membership.py, and the workers of
tests/integration/test_checkpoint.py)."""
from __future__ import annotations

from kungfu.elastic import Variables


class NumpyVariables(Variables):
    """Variables as numpy arrays, written in place."""

    def __init__(self, arrays):
        self.values = arrays

    def synced(self):
        return list(self.values)

    def snapshot(self, variables):
        return [v.copy() for v in variables]

    def restore(self, variables, snapshot):
        for v, s in zip(variables, snapshot):
            v[...] = s

    def arrays(self, snapshot):
        return list(snapshot)

    def load(self, variables, arrays):
        self.restore(variables, arrays)

    def describe(self, variables):
        return [(f"v{i}", v.shape, v.dtype.name) for i, v in enumerate(variables)]

    def lend(self, variables, names):
        raise AssertionError("no peers here")

    borrow = lend

    def unlend(self, names):
        raise AssertionError("no peers here")
