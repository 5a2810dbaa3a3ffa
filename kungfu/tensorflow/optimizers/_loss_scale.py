"""Keras's LossScaleOptimizer around a kungfu optimizer: every worker skips the same steps.

The one place kungfu changes Keras's code. Checked against Keras 3.15 (TensorFlow backend).

With the mixed_float16 policy, `model.compile` wraps the optimizer it gets in LossScaleOptimizer
(keras/src/trainers/trainer.py, `compile`), so `kf.Optimizer(SGD)` becomes
LossScaleOptimizer(kf.Optimizer(SGD)). Its `apply` goes (through `_tf_apply`, under the default
distribution strategy) to `_common_apply(grads, trainable_variables)`, which:

1. `check_finite(grads)`: are this worker's scaled gradients finite;
2. if so, `_stateful_handle_finite_grads`: divides them by the loss scale and calls
   `inner_optimizer.apply`, where kungfu's collectives are, then maybe doubles the scale;
3. if not, `_stateful_handle_non_finite_grads`: halves the scale and skips the step.

A worker whose gradients overflow alone skips step 2 while the others wait in its collective
until the op deadline. `install()` replaces `_common_apply` with one that, when the inner
optimizer is kungfu's, lets it decide step 1 for every worker alike (`Optimizer._kf_loss_scaled`):
sync-sgd averages the gradients first and checks the averages (so a sum that overflows counts
too); the other algorithms agree on the workers' checks (one overflow skips the step
everywhere). Steps 2 and 3 stay Keras's own; any other inner optimizer keeps Keras's code.

kf.Optimizer(LossScaleOptimizer(SGD)) needs none of this: its apply averages the gradients before
LossScaleOptimizer's runs. tests/unit/test_horovod_names_unit.py fails when Keras changes under this.
"""
from __future__ import annotations

import warnings

import keras

CHECKED_KERAS = ("3.15",)
# What the replacement calls or replaces: without any of them, install() leaves Keras alone.
_NEEDED = ("_common_apply", "check_finite", "_stateful_handle_finite_grads",
           "_stateful_handle_non_finite_grads")


def compatible() -> bool:
    """Whether this Keras's LossScaleOptimizer has what the replacement relies on."""
    return all(callable(getattr(keras.optimizers.LossScaleOptimizer, m, None)) for m in _NEEDED)


def install() -> None:
    """Makes LossScaleOptimizer let a kungfu inner optimizer decide overflow. Idempotent."""
    cls = keras.optimizers.LossScaleOptimizer
    if getattr(cls._common_apply, "kungfu_agreed", False):
        return
    if not compatible():
        warnings.warn(
            f"kungfu: Keras {keras.__version__}'s LossScaleOptimizer is not the one kungfu knows "
            f"(checked: {', '.join(CHECKED_KERAS)}); LossScaleOptimizer(kf.Optimizer(...)), what "
            "compile makes under mixed_float16, may skip a step on one worker only: wrap the "
            "other way round, kf.Optimizer(keras.optimizers.LossScaleOptimizer(...))")
        return
    keras_apply = cls._common_apply

    def _common_apply(self, grads, trainable_variables=None):
        inner = self.inner_optimizer
        if not hasattr(inner, "_kf_loss_scaled"):
            return keras_apply(self, grads, trainable_variables)
        with inner._kf_loss_scaled(list(grads), self.check_finite,
                                   keras.ops.convert_to_tensor(self.dynamic_scale)) as (
                agreed, finite):
            keras.ops.cond(
                finite,
                lambda: self._stateful_handle_finite_grads(agreed, trainable_variables),
                self._stateful_handle_non_finite_grads)

    _common_apply.kungfu_agreed = True
    cls._common_apply = _common_apply
