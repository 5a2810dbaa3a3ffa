"""TensorFlow's binding of elastic membership (kungfu/elastic, `Variables`): which variables a
kf.Hook's training holds, and how they are captured, restored, lent and borrowed."""
from __future__ import annotations

from typing import List, Sequence

import numpy as np
import tensorflow as tf

from kungfu.elastic import Variables


class KerasVariables(Variables):
    """The variables of a kf.Hook: its model's weights and optimizer's (model.fit), or its
    optimizer's (a custom loop), and the gradient monitor's."""

    def __init__(self, hook):
        self.hook = hook

    def synced(self) -> list:
        from kungfu.tensorflow.initializer import _optimizer_variables

        hook = self.hook
        opt = hook.optimizer
        model = getattr(hook, "model", None)
        variables = []
        if model is not None:
            variables = list(model.weights) + _optimizer_variables(model)
        elif opt is not None:
            variables = list(opt.variables)
        monitor = getattr(opt, "kungfu_monitor", None)
        if monitor is not None:
            variables += [monitor.batch_size, monitor.stats, monitor.gns_state,
                          monitor.variance_state]
            variables += [monitor.values[m] for m in monitor.monitors]
        return variables

    def committed(self) -> list:
        """The synced variables, and in a custom loop (no Keras model) also those the optimizer
        trains (it knows them once it has applied a step)."""
        variables = self.synced()
        opt = self.hook.optimizer
        if getattr(self.hook, "model", None) is None and opt is not None:
            mine = {id(v) for v in variables}
            variables += [v for v in getattr(opt, "_trainable_variables", [])
                          if id(v) not in mine]
        return variables

    def snapshot(self, variables: list) -> list:
        # The current tensors: TensorFlow copies a variable's buffer on its next write.
        return [tf.identity(v) for v in variables]

    def restore(self, variables: list, snapshot: list) -> None:
        for v, t in zip(variables, snapshot):
            v.assign(t)

    def arrays(self, snapshot: list) -> List[np.ndarray]:
        return [t.numpy() for t in snapshot]

    def load(self, variables: list, arrays: Sequence[np.ndarray]) -> None:
        for v, a in zip(variables, arrays):
            v.assign(a)

    def describe(self, variables: list) -> list:
        return [(getattr(v, "path", None) or v.name, tuple(int(d) for d in v.shape),
                 tf.as_dtype(v.dtype).name) for v in variables]

    def lend(self, variables: list, names: List[str]) -> None:
        from kungfu.tensorflow import ops

        for name, v in zip(names, variables):  # lent, not copied
            ops.save_variable(tf.convert_to_tensor(v), name=name)

    def borrow(self, variables: list, names: List[str]) -> None:
        from kungfu.tensorflow import ops

        for name, v in zip(names, variables):
            v.assign(ops.request_variable(0, name=name, shape=v.shape, dtype=v.dtype))

    def unlend(self, names: List[str]) -> None:
        from kungfu import _collective

        for name in names:
            _collective.drop(name)
