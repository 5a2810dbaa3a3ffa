"""`NumpyVariables`: a kungfu.elastic binding of plain numpy arrays, for the tests that drive the
membership machine (tests/unit/test_membership.py), the Loop (tests/integration/elastic_numpy.py)
and the checkpoint (tests/integration/test_checkpoint.py) without a framework: arrays written in
place, lent to joiners peer-to-peer."""
from __future__ import annotations

from kungfu import _collective
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
        for name, v in zip(names, variables):
            _collective.save(name, v)

    def borrow(self, variables, names):
        for name, v in zip(names, variables):
            v[...] = _collective.request(0, name, like=v)

    def unlend(self, names):
        for name in names:
            _collective.drop(name)
