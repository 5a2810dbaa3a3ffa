"""`kf.Hook`: the Keras callback that connects `model.fit` to kungfu.

It adds the latest monitored estimates of the model's distributed optimizer to Keras's logs, as
`gns` and `grad_variance`, after every batch and epoch, so the progress bar, History and
TensorBoard show them.
"""
from __future__ import annotations

from typing import Optional

import keras

from kungfu.tensorflow import _monitor


def monitor_logs(optimizer) -> dict:
    """{log key: latest estimate} of the optimizer's gradient monitor ({} without one)."""
    monitor: Optional[_monitor.GradientMonitor] = getattr(optimizer, "kungfu_monitor", None)
    if monitor is None:
        return {}
    return {_monitor.LOG_KEYS[m]: monitor.value(m) for m in monitor.monitors}


class Hook(keras.callbacks.Callback):
    """A Keras callback for `model.fit`: `model.fit(..., callbacks=[kf.Hook()])`."""

    def _add_monitor_logs(self, logs):
        if logs is not None and self.model is not None:
            logs.update(monitor_logs(self.model.optimizer))

    def on_train_batch_end(self, batch, logs=None):
        self._add_monitor_logs(logs)

    def on_epoch_end(self, epoch, logs=None):
        self._add_monitor_logs(logs)
