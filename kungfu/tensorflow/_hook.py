"""`kf.Hook`: runs adaptation policies in `model.fit` (as a Keras callback) or in a custom loop.

    model.fit(data.dataset(), callbacks=[kf.Hook(MyPolicy(), data=data)])

    hook = kf.Hook(MyPolicy(), optimizer=opt, data=data)       # a custom loop
    hook.before_train()
    for epoch in range(E):
        hook.before_epoch()
        for x, y, w in data.epoch_batches():   # or any loop; state.local_batch_size is the size
            hook.before_step(); loss = train_step(x, y, w); hook.after_step({"loss": loss})
        hook.after_epoch()
    hook.after_train()

Decisions recorded by the policies (kungfu/policy/_actions.py) are agreed and applied on every
worker at the end of before_train, of every after_step, of after_epoch and of after_train, so a
decision takes effect from the next step; one taken in before_epoch or before_step takes effect
after that step. Per step:
1. before the step the policies' `before_step` run; in model.fit the data (if given) is then
   released to make this step's batch (tf.data reads ahead; this keeps it from making a batch
   before the decisions that shape it were applied);
2. after the step the training state is updated (step, samples, step time, throughput, the
   monitored `gns` / `grad_variance`, which also go into Keras's logs), `after_step` runs, and
   the decisions are agreed and applied.

Over a dataset of unknown length Keras calls on_train_batch_begin once more at the end of each
epoch, so `before_step` runs once more there without a step following.

Every worker runs the same hooks at the same steps, so policies may call collectives
(`kf.allreduce(kf.grad_noise_scale(), "avg")`) in them.
"""
from __future__ import annotations

import time
from typing import Optional, Sequence

import keras

from kungfu.policy import HOOKS, BasePolicy, TrainingState, _actions
from kungfu.tensorflow import _monitor


def monitor_logs(optimizer) -> dict:
    """{log key: latest estimate} of the optimizer's gradient monitor ({} without one)."""
    monitor: Optional[_monitor.GradientMonitor] = getattr(optimizer, "kungfu_monitor", None)
    if monitor is None:
        return {}
    return {_monitor.LOG_KEYS[m]: monitor.value(m) for m in monitor.monitors}


class Hook(keras.callbacks.Callback):
    """Runs policies (kf.BasePolicy) and applies their actions consistently on every worker;
    adds the monitored estimates to Keras's logs. `data`: a kungfu.tensorflow.data.ElasticData
    (needed for kf.set_batch_size in model.fit); `optimizer`: for custom loops (in model.fit the
    model's optimizer is used)."""

    def __init__(self, *policies: BasePolicy, data=None, optimizer=None, name: str = "kungfu/hook"):
        super().__init__()
        for p in policies:
            if not isinstance(p, BasePolicy):
                raise TypeError(f"kf.Hook takes kf.BasePolicy instances, got {type(p).__name__}")
        self.policies = list(policies)
        self.data = data
        self._optimizer = optimizer
        self._name = name
        self._rounds = 0
        self.state = TrainingState()
        self._step_start: Optional[float] = None

    # -- plumbing ---------------------------------------------------------------------------

    @property
    def optimizer(self):
        if self._optimizer is not None:
            return self._optimizer
        model = getattr(self, "model", None)
        return None if model is None else model.optimizer

    def _run(self, hook: str) -> None:
        assert hook in HOOKS
        if not _actions.in_round():
            _actions.open_round()
        for p in self.policies:
            getattr(p, hook)(self.state)

    def _agree_and_apply(self) -> None:
        decisions = _actions.close_round()
        self._rounds += 1
        winners = _actions.agree(decisions, f"{self._name}/{self._rounds}")
        _actions.open_round()
        for kind in _actions.KINDS:
            if kind in winners:
                getattr(self, "_apply_" + kind)(winners[kind])

    def _apply_strategy(self, decision) -> None:
        _actions.apply_strategy(decision)

    def _apply_batch_size(self, b: int) -> None:
        if self.data is not None:
            self.data.set_batch_size(b)
        elif getattr(self, "model", None) is not None:
            raise RuntimeError("kf.set_batch_size needs kungfu's data in training: pass "
                               "data=kf.ElasticData(...) to kf.Hook and train on data.dataset()")
        self.state.local_batch_size = b
        monitor = getattr(self.optimizer, "kungfu_monitor", None)
        if monitor is not None:
            monitor.set_batch_size(b)
        self._refresh_sizes()

    def _apply_learning_rate(self, lr: float) -> None:
        opt = self.optimizer
        if opt is None:
            raise RuntimeError("kf.set_learning_rate needs an optimizer: pass optimizer= to "
                               "kf.Hook in a custom loop")
        try:
            opt.learning_rate = lr
        except (TypeError, ValueError) as e:
            raise RuntimeError(f"cannot set the learning rate of {type(opt).__name__} "
                               f"(a schedule?): {e}") from e
        self.state.learning_rate = lr

    def _refresh_sizes(self) -> None:
        import kungfu as kf

        s = self.state
        s.rank, s.cluster_size = kf.rank(), kf.size()
        if self.data is not None:
            s.local_batch_size = self.data.batch_size
        if s.local_batch_size is not None:
            s.global_batch_size = s.local_batch_size * s.cluster_size
        opt = self.optimizer
        if opt is not None:
            try:
                s.learning_rate = float(keras.ops.convert_to_numpy(opt.learning_rate))
            except Exception:  # noqa: BLE001 - a schedule or no learning rate: leave it
                pass

    # -- the hooks, for custom loops ----------------------------------------------------------

    def before_train(self) -> None:
        self._epochs_begun = 0
        self._refresh_sizes()
        self._run("before_train")
        self._agree_and_apply()

    def before_epoch(self, epoch: Optional[int] = None) -> None:
        if epoch is not None:
            self.state.epoch = epoch
        self._epochs_begun += 1
        self.state.step_in_epoch = 0
        self._run("before_epoch")

    def before_step(self) -> None:
        self._run("before_step")
        if self.data is not None:
            self.data.release(self._epochs_begun - 1, self.state.step_in_epoch)
        self._step_start = time.perf_counter()

    def after_step(self, logs: Optional[dict] = None) -> None:
        s = self.state
        elapsed = time.perf_counter() - self._step_start if self._step_start else None
        samples = self.data.last_length if self.data is not None else (s.global_batch_size or 0)
        s.step += 1
        s.step_in_epoch += 1
        s.samples_seen += samples
        if elapsed:
            s.metrics["step_time"] = elapsed
            if samples:
                s.metrics["throughput"] = samples / elapsed
        estimates = monitor_logs(self.optimizer)
        s.metrics.update(estimates)
        if logs is not None:
            logs.update(estimates)
            s.logs = logs
        self._run("after_step")
        self._agree_and_apply()

    def after_epoch(self, logs: Optional[dict] = None) -> None:
        if logs is not None:
            logs.update(monitor_logs(self.optimizer))
            self.state.logs = logs
        self._run("after_epoch")
        self._agree_and_apply()
        self.state.epoch += 1

    def after_train(self) -> None:
        self._run("after_train")
        self._agree_and_apply()
        _actions.close_round()

    # -- Keras ----------------------------------------------------------------------------------

    _epochs_begun = 0

    def on_train_begin(self, logs=None):
        spe = getattr(self.model, "steps_per_execution", 1)
        if self.data is not None and int(keras.ops.convert_to_numpy(spe)) != 1:
            raise ValueError("kf.Hook with kungfu data needs steps_per_execution=1")
        if self.data is not None:
            self.data.attach()  # tf.data reads ahead: make each batch wait for its step
        self.before_train()

    def on_epoch_begin(self, epoch, logs=None):
        self.before_epoch(epoch)

    def on_train_batch_begin(self, batch, logs=None):
        self.before_step()

    def on_train_batch_end(self, batch, logs=None):
        self.after_step(logs)

    def on_epoch_end(self, epoch, logs=None):
        self.after_epoch(logs)

    def on_train_end(self, logs=None):
        try:
            self.after_train()
        finally:
            if self.data is not None:
                self.data.detach()
