"""`LearningRateScheduleCallback`: Horovod's learning-rate schedule by epoch, for Keras 3.

    callbacks = [
        kf.LearningRateWarmupCallback(initial_lr=0.1 * kf.size(), warmup_epochs=5),
        kf.LearningRateScheduleCallback(initial_lr=0.1 * kf.size(), multiplier=1.0,
                                        start_epoch=5, end_epoch=30),
        kf.LearningRateScheduleCallback(initial_lr=0.1 * kf.size(), multiplier=1e-1,
                                        start_epoch=30, end_epoch=60),
    ]
"""
from __future__ import annotations

import numbers
from typing import Callable, Optional, Union

import keras
import numpy as np

from kungfu.elastic import check_learning_rate


def learning_rate(optimizer, bits: int = 64) -> Optional[float]:
    """The optimizer's learning rate now (a numpy float of `bits`: 32 prints as the variable
    holds it); None without an optimizer or with a schedule."""
    try:
        return getattr(np, f"float{bits}")(keras.ops.convert_to_numpy(optimizer.learning_rate))
    except Exception:  # noqa: BLE001 - None, a schedule, or no learning rate
        return None


def _check_epoch(value, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise ValueError(f"{what} must be an integer >= 0, got {value!r}")
    return int(value)


class LearningRateScheduleCallback(keras.callbacks.Callback):
    """Sets the learning rate to initial_lr * multiplier(epoch) while start_epoch <= epoch <
    end_epoch, as Horovod's callback of this name; outside that range it changes nothing (other
    callbacks, e.g. a warmup, or other schedules own those epochs).

    multiplier: a number m (exponential decay: the factor is m ** (epoch - start_epoch)) or a
        function of the epoch that returns the factor.
    staircase: True (default): the rate is set at the beginning of each epoch, from its number;
        False: before every batch, from the fractional epoch epoch + batch / steps_per_epoch.
    momentum_correction: True (default): when the rate changes from lr to lr', the momentum of
        an SGD with momentum is scaled by lr' / lr (Goyal et al.), so the step after the change
        moves as far as the new rate says. Horovod scales the momentum coefficient for that one
        batch; here the momentum buffers are scaled, which gives the same step and also holds in
        a compiled train step (Keras 3 reads SGD's coefficient as a constant when it traces).
    steps_per_epoch: batches per epoch, for staircase=False; None: Keras's count (an input of
        unknown length then changes the rate once per epoch).
    The rate depends only on the epoch and the batch: every worker sets the same.
    """

    def __init__(self, initial_lr: float, multiplier: Union[float, Callable[[float], float]],
                 start_epoch: int = 0, end_epoch: Optional[int] = None, staircase: bool = True,
                 momentum_correction: bool = True, steps_per_epoch: Optional[int] = None):
        super().__init__()
        self.initial_lr = check_learning_rate(initial_lr)
        if callable(multiplier):
            self.multiplier = multiplier
        elif isinstance(multiplier, numbers.Real) and not isinstance(multiplier, bool):
            self.multiplier = lambda epoch: float(multiplier) ** (epoch - self.start_epoch)
        else:
            raise TypeError(f"multiplier must be a number or a function of the epoch, "
                            f"got {type(multiplier).__name__}")
        self.start_epoch = _check_epoch(start_epoch, "start_epoch")
        self.end_epoch = None if end_epoch is None else _check_epoch(end_epoch, "end_epoch")
        if self.end_epoch is not None and self.end_epoch <= self.start_epoch:
            raise ValueError(f"end_epoch ({end_epoch}) must be after start_epoch ({start_epoch})")
        if steps_per_epoch is not None and (isinstance(steps_per_epoch, bool) or not isinstance(
                steps_per_epoch, numbers.Integral) or steps_per_epoch < 1):
            raise ValueError(f"steps_per_epoch must be a positive integer or None, "
                             f"got {steps_per_epoch!r}")
        self.staircase = bool(staircase)
        self.momentum_correction = bool(momentum_correction)
        self.steps_per_epoch = steps_per_epoch
        self._epoch = 0

    def rate(self, epoch: float) -> float:
        """The learning rate at (fractional) epoch `epoch`."""
        return self.initial_lr * float(self.multiplier(epoch))

    def _in_range(self) -> bool:
        return self._epoch >= self.start_epoch and (self.end_epoch is None
                                                    or self._epoch < self.end_epoch)

    def _set(self, epoch: float) -> None:
        optimizer = self.model.optimizer
        old = float(keras.ops.convert_to_numpy(optimizer.learning_rate))
        new = self.rate(epoch)
        optimizer.learning_rate = new
        # A LossScaleOptimizer (mixed precision) holds the SGD that has the momentum buffers.
        inner = getattr(optimizer, "inner_optimizer", optimizer)
        buffers = getattr(inner, "momentums", None)
        if self.momentum_correction and buffers and old > 0 and new != old:
            for m in buffers:
                m.assign(m * (new / old))

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch
        if self.staircase and self._in_range():
            self._set(epoch)

    def on_train_batch_begin(self, batch, logs=None):
        if self.staircase or not self._in_range():
            return
        steps = self.steps_per_epoch or (self.params or {}).get("steps")
        self._set(self._epoch + (batch / steps if steps else 0.0))
