"""KungFu's `kungfu.tensorflow.policy` names, mapped onto kungfu's policies.

    from kungfu.tensorflow.policy import BasePolicy, PolicyHook

    class ScheduledResize(BasePolicy):
        def after_step(self):                 # KungFu's hooks take no argument; kungfu's take
            ...                               # the TrainingState: both are called

    model.fit(..., callbacks=[PolicyHook([ScheduledResize()], epoch_size, epoch_num, batch)])

- `BasePolicy` is kf.BasePolicy (hooks before_train, before_epoch, before_step, after_step,
  after_epoch, after_train; written with or without the state argument).
- `PolicyHook(policies, epoch_size=None, epoch_num=None, init_batch_size=None, **options)` is
  kf.Hook(*policies, **options): a Keras callback that runs the policies at the same step on
  every worker and applies their actions (kf.resize, kf.set_tree, kf.set_batch_size, ...).
  KungFu's hook needed the epoch size, epoch count and batch size to count progress; model.fit
  and kf.ElasticData (options data=) know them here, so those three are checked and otherwise
  unused.
"""
from __future__ import annotations

import numbers
from typing import Optional, Sequence

from kungfu.policy import BasePolicy, TrainingState
from kungfu.tensorflow._hook import Hook


def _positive(what: str, value) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Integral)
                              or value < 1):
        raise ValueError(f"PolicyHook: {what} must be a positive integer or None, got {value!r}")


class PolicyHook(Hook):
    """KungFu's PolicyHook: kf.Hook running `policies` (a list of BasePolicy)."""

    def __init__(self, policies: Sequence[BasePolicy], epoch_size: Optional[int] = None,
                 epoch_num: Optional[int] = None, init_batch_size: Optional[int] = None,
                 **options):
        if isinstance(policies, BasePolicy) or not hasattr(policies, "__iter__"):
            raise TypeError("PolicyHook takes a list of policies, got "
                            f"{type(policies).__name__}")
        _positive("epoch_size", epoch_size)
        _positive("epoch_num", epoch_num)
        _positive("init_batch_size", init_batch_size)
        super().__init__(*policies, **options)


__all__ = ["BasePolicy", "PolicyHook", "TrainingState"]
