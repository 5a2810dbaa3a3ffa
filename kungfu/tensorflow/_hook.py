"""`kf.Hook`: runs adaptation policies in `model.fit` (as a Keras callback) or in a custom loop.

    model.fit(data.dataset(), callbacks=[kf.Hook(MyPolicy(), data=data)])

    hook = kf.Hook(MyPolicy(), optimizer=opt, data=data)       # a custom loop
    step = hook.guard(train_step)              # survives a lost peer in an elastic job
    hook.before_train()
    for epoch in range(E):
        hook.before_epoch()
        for x, y, w in data.epoch_batches():   # or any loop; state.local_batch_size is the size
            hook.before_step(); loss = step(x, y, w); hook.after_step({"loss": loss})
        hook.after_epoch()
    hook.after_train()

Decisions recorded by the policies are agreed and applied by the Hook's decision round
(kungfu/elastic/_round.py; the Hook is its trainer and applies batch size and learning rate) on
every worker at the end of before_train, of every after_step, of after_epoch and of
after_train, so a decision takes effect from the next step; one taken in before_epoch or
before_step takes effect after that step. Per step:
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

The Hook is a kungfu._loop.Loop: the loop's hooks, the decision round, resize, recovery and
the commits are the Loop's (kungfu/_loop.py, over kungfu/elastic), with TensorFlow's variables
bound by kungfu/tensorflow/_variables.py; this module adds what model.fit needs.

Recovery (an elastic job with kungfu's data: model.fit, or a custom loop's step wrapped by
`guard`): the Hook commits the training state in memory at every step boundary (after the
step's decisions were applied) and at every epoch end:
the variables it syncs to joiners (model, optimizer, monitor; their current tensors, which
TensorFlow copies on the next write), its own state, the policies' state and the data position.
It wraps Keras's train function: when a collective fails because a peer died or hangs (in the
step, or in the Hook's own agreement), the survivors agree on who is left and on the commit to
roll back to (Membership.recover), restore it, redo the commits this worker had made since
(at most one), and redo the failed step on the same samples, now split among the survivors.
Keras sees one step.

With `checkpoint="path"`, rank 0 also writes the commit to that file (every `checkpoint_every`
steps and at each epoch's end, atomically; its folder is created if missing), and training that
starts with the file there resumes from it, at any cluster size (docs/elastic.md, "The loss of
the whole job"). `checkpoint_key` (default KUNGFU_CHECKPOINT_KEY) signs the file with an HMAC:
a file not signed with it is refused. A model without keras.Input is built from a sample of
kf.ElasticData before the checkpoint is loaded; kungfu's data takes the checkpoint's position
and per-worker batch size (the resume's line says which).
"""
from __future__ import annotations

import warnings
from typing import Optional, Union

import keras

from kungfu import _peer, elastic as _elastic
from kungfu._loop import Loop
from kungfu.policy import BasePolicy
from kungfu.tensorflow import _internals
from kungfu.tensorflow._monitor import monitor_logs, monitor_metrics
from kungfu.tensorflow._schedule import learning_rate
from kungfu.tensorflow._variables import KerasVariables
from kungfu.tensorflow.callbacks import (RECOVERABLE, CallbackStates, RankZeroOutput,
                                         combine_while_training, let_hooks_arrange_callbacks)
from kungfu.tensorflow.initializer import broadcast_variables, model_built, prepare_fit


def _samples_counted(model) -> float:
    """The samples Keras's loss tracker counted in this epoch (0 without one)."""
    tracker = getattr(model, "_loss_tracker", None)
    count = getattr(tracker, "count", None)
    return 0.0 if count is None else float(keras.ops.convert_to_numpy(count))


def _batch_of(data) -> int:
    """The number of samples in a batch as Keras counts them for its loss tracker: the rows of
    the first input. Read from the data, not from the tracker: a train_step written as Keras's
    guide writes it counts one per step (`update_state(loss)`)."""
    first = next(t for t in keras.tree.flatten(data) if t is not None)
    return int(first.shape[0])


def _numbers(logs) -> dict:
    """Keras's logs of a step as numbers where they are numbers ({} for what a custom loop's
    step returned). A custom train_step's logs may nest (the compiled metrics' entry is a dict of
    them) or hold what is no number: those are kept as they are, a dict's numbers converted."""
    if not isinstance(logs, dict):
        return {}
    out = {}
    for k, v in logs.items():
        if isinstance(v, dict):
            out[k] = _numbers(v)
            continue
        try:
            out[k] = float(keras.ops.convert_to_numpy(v))
        except (TypeError, ValueError):
            out[k] = v
    return out


class Hook(Loop, keras.callbacks.Callback):
    """Runs policies (kf.BasePolicy) and applies their actions consistently on every worker;
    adds the monitored estimates and the cluster's numbers (`cluster_logs`: cluster_size,
    global_batch_size, step_time, samples_per_sec, allreduce_bytes_per_sec) to Keras's logs,
    where TensorBoard finds them. `data`: a kungfu.tensorflow.data.ElasticData
    (needed for kf.set_batch_size in model.fit); `optimizer`: for custom loops (in model.fit the
    model's optimizer is used)."""

    recoverable = RECOVERABLE
    face = "kf.Hook"

    def __init__(self, *policies: BasePolicy, data=None, optimizer=None, name: str = "kungfu/hook",
                 exit_on_detach: bool = True, checkpoint: Optional[str] = None,
                 checkpoint_every: int = 100, rank_zero_output: bool = True,
                 cluster_logs: bool = True, checkpoint_key: Union[str, bytes, None] = None):
        keras.callbacks.Callback.__init__(self)
        Loop.__init__(self, *policies, data=data, optimizer=optimizer, name=name,
                      exit_on_detach=exit_on_detach, checkpoint=checkpoint,
                      checkpoint_every=checkpoint_every, cluster_logs=cluster_logs,
                      checkpoint_key=checkpoint_key)
        self._build_error = ""  # why a model without keras.Input could not be built to resume
        self.rehearsed = False  # a joiner in model.fit: ran its step before reporting ready
        self._progbars: list = []  # Keras's progress bars in model.fit (kungfu_arrange)
        self._states = CallbackStates()  # the other callbacks' counters, for joiners
        self.shared_state, self.load_shared_state = self._states.read, self._states.load
        self.rank_zero_output = rank_zero_output  # model.fit: output on rank 0 (callbacks.py)
        self._output: Optional[RankZeroOutput] = None
        let_hooks_arrange_callbacks()  # kungfu_arrange sees each fit's callbacks first

    # -- what the Loop asks of TensorFlow (kungfu/_loop.py) -------------------------------------

    def _binding(self) -> KerasVariables:
        return KerasVariables(self)

    def _learning_rate(self, bits: int = 64) -> Optional[float]:
        return learning_rate(self.optimizer, bits)

    def _set_learning_rate(self, lr: float) -> None:
        opt = self.optimizer
        try:
            opt.learning_rate = lr
        except (TypeError, ValueError) as e:
            raise RuntimeError(f"cannot set the learning rate of {type(opt).__name__} "
                               f"(a schedule?): {e}") from e

    def _monitor_logs(self) -> dict:
        return monitor_logs(self.optimizer)

    def _monitor_metrics(self) -> dict:
        return monitor_metrics(self.optimizer)

    def _step_logs(self, out) -> dict:
        return _numbers(out)

    def _step_again(self):
        """In model.fit on a dataset of that one batch (Keras's iterator is left where it is);
        in a custom loop on that batch, moving the position past it."""
        if self.model is None:
            return super()._step_again()
        return self._train_fn(iter(self.data.step_dataset()))

    @property
    def optimizer(self):
        if self._optimizer is not None:
            return self._optimizer
        model = getattr(self, "model", None)
        return None if model is None else model.optimizer

    def _training_ends_here(self) -> bool:
        """At a step's end: whether it was the last (fit stops, or the last epoch ran out)."""
        model, s = getattr(self, "model", None), self.state
        steps = (getattr(self, "params", None) or {}).get("steps")
        return (model is not None and model.stop_training) or (
            None not in (self.epochs_total, steps)
            and s.epoch + 1 >= self.epochs_total and s.step_in_epoch >= steps)

    def set_batch_size(self, b: int) -> None:
        if self.data is None and getattr(self, "model", None) is not None:
            raise RuntimeError("kf.set_batch_size needs kungfu's data in training: pass "
                               "data=kf.ElasticData(...) to kf.Hook and train on data.dataset()")
        super().set_batch_size(b)

    def _why_no_recovery(self) -> Optional[str]:
        if self.data is None and getattr(self, "model", None) is not None:
            return ("kf.Hook recovers only with data=kf.ElasticData(...), on which the survivors "
                    "train a failed step again, split among them: pass it to kf.Hook and train "
                    "on data.dataset()")
        return super()._why_no_recovery()

    def check_resize(self, n: int, leave) -> None:
        if (self.model is not None and self.data is None
                and n > _peer.identity().size - len(leave)
                and _elastic.context().pending is None):
            raise RuntimeError("growing the cluster in model.fit needs kungfu's data: pass "
                               "data=kf.ElasticData(...) to kf.Hook (joiners continue from its "
                               "sample offset)")

    def on_detached(self) -> None:
        super().on_detached()
        if getattr(self, "model", None) is not None:
            self.model.stop_training = True

    def _join(self) -> None:
        if self.data is None and getattr(self, "model", None) is not None:
            raise RuntimeError("a worker joining an elastic job continues from the others' "
                               "sample offset: pass data=kf.ElasticData(...) to kf.Hook")
        super()._join()

    def _rehearse(self) -> None:
        """A joiner in model.fit, before it reports ready: runs one training step alone (a
        cluster of one, on a batch of weight 0), so that tracing the step function and its
        first run happen while the others keep training, not in the pause after the switch.
        What the step changed is then replaced by rank 0's state (Membership._sync)."""
        fn = getattr(getattr(self, "model", None), "train_function", None)
        if fn is None or self.data is None:
            return
        try:
            with _peer.solo():
                fn(iter(self.data.rehearsal_dataset()))
            self.rehearsed = True
        except Exception as e:  # noqa: BLE001 - the real first step then traces; say why
            warnings.warn(f"kungfu: this joiner could not rehearse its training step ({e}); "
                          "it is traced after the switch instead")

    def _build_to_resume(self) -> None:
        """model.fit of a model that Keras builds on its first batch (no keras.Input): its
        variables must exist before a checkpoint is loaded into them, so it is built now, called
        on one sample of kungfu's data (the optimizer is built when its variables are listed)."""
        model = getattr(self, "model", None)
        if model is None or model_built(model) or self.data is None:
            return
        try:
            model(self.data.sample()[0], training=False)
        except Exception as e:  # noqa: BLE001 - resume then says what to do, with this
            self._build_error = f"; calling it on one sample of the data failed: {e}"

    def _unbuilt(self) -> str:
        model = getattr(self, "model", None)
        if model is not None and not model_built(model):
            return ("Keras builds this model's variables on its first batch (a model without "
                    "keras.Input), after the checkpoint must be loaded: build it before "
                    "model.fit (begin it with keras.Input(shape), or call model.build(shape)), or "
                    "give kf.Hook data=kf.ElasticData(...), from which it is built"
                    + self._build_error)
        if model is None:
            return ("a custom loop's optimizer creates its variables in its first step: build "
                    "the model and then the optimizer (optimizer.build(model.trainable_variables)) "
                    "before hook.before_train()")
        return ""

    def _resume(self) -> bool:
        self._build_to_resume()
        if not super()._resume():
            return False
        if self.data is None and getattr(self, "model", None) is not None:
            # model.fit makes the batches of the script's batch size: measured at the first
            # step, not the checkpoint's.
            self.state.local_batch_size = self.state.global_batch_size = None
        if self.data is not None and self.data.attached:
            # model.fit: the data's epochs are counted from the checkpoint's position, whether
            # its epoch is continued or begun (else the first batch waits for a release of an
            # epoch the Hook never reaches).
            self.data.attach()
        return True

    def _continue_epochs(self) -> None:
        """model.fit counts its epochs from the state's (_internals.set_initial_epoch), so its
        "Epoch e/E" lines, its number of epochs and the epoch numbers the callbacks see are the
        job's. A custom loop's epochs given to before_epoch are shifted instead."""
        model = getattr(self, "model", None)
        if model is None:
            super()._continue_epochs()
        else:
            _internals.set_initial_epoch(model, self.state.epoch)

    def _count_steps(self, batch: int) -> None:
        """Keras's progress bar takes an epoch's number of steps of kungfu's data (its length
        unknown to Keras) from the first epoch and keeps it; an epoch has as many as its samples
        left make at the cluster's batch sizes (fewer in a resumed or joined epoch, others after
        a resize). The bar's total is set at each step: Keras's batch index plus the steps
        left."""
        d = self.data
        try:
            left = len(d) - d.offset
        except TypeError:  # a stream whose length is known after its first epoch
            return
        total = batch + -(-left // sum(d.sizes(self.state.cluster_size)))
        for bar in self._progbars:
            _internals.set_progress_total(bar, total)

    def _keras_train_function(self, fn, recover: bool):
        """Keras's train function as model.fit calls it under the Hook: it survives a lost peer
        (`recover`: see _recover), and its logs carry the monitored estimates (gns,
        grad_variance), so every callback sees them whatever its place in the list (the epoch's
        logs get them in kungfu/tensorflow/callbacks.py)."""
        inner = self._guard(fn) if recover else fn
        model = self.model

        def train_function(*args, **kwargs):
            monitor = getattr(self.optimizer, "kungfu_monitor", None)
            learn_monitor = monitor is not None and not monitor.batch_known
            if learn_monitor or self.state.local_batch_size is None:
                # This worker's batch size, which the noise scale and policies need.
                logs, batch = self._measured_step(inner, args, kwargs)
                if batch > 0:
                    if learn_monitor:
                        monitor.set_batch_size(batch)
                    if self.state.local_batch_size is None:
                        self.state.local_batch_size = int(batch)
                        self.refresh_sizes()
            else:
                logs = inner(*args, **kwargs)
            model.kungfu_trained = True  # the next epoch logs are a training epoch's
            extra = {**monitor_logs(self.optimizer), **self._cluster.step(self.state)}
            if extra and isinstance(logs, dict):
                logs = {**logs, **extra}
            return logs

        train_function.kungfu_guarded = fn
        return train_function

    def _measured_step(self, train_fn, args, kwargs):
        """Runs Keras's train function once; returns its logs and the batch it trained on. With
        one step per call (Keras's default) the batch is taken from the iterator here and the
        function trains on it (Keras's functions take a list of batches as well); with more,
        from the samples its loss tracker counted over the call's steps."""
        model = self.model
        spe = int(keras.ops.convert_to_numpy(getattr(model, "steps_per_execution", 1)))
        if spe == 1 and len(args) == 1 and not kwargs:
            data = next(args[0])
            return train_fn([data]), _batch_of(data)
        before = _samples_counted(model)
        logs = train_fn(*args, **kwargs)
        return logs, (_samples_counted(model) - before) / spe

    # -- the hooks, for custom loops (kungfu/_loop.py) ----------------------------------------

    def _start_equal(self) -> None:
        """model.fit: every worker starts from rank 0's model and optimizer state (a custom
        loop's Hook does not know the model: call kf.broadcast_variables there). A model built
        by its first step takes rank 0's state after that step."""
        model = getattr(self, "model", None)
        self._equal_after_step = False
        if _peer.identity().size == 1 or model is None:
            return
        if not model_built(model):  # it creates its variables in its first step: after that
            self._equal_after_step = True
            return
        broadcast_variables(self.membership.variables.synced(), name=f"{self._name}/start")

    def after_epoch(self, logs: Optional[dict] = None) -> None:
        super().after_epoch(logs)
        if (self.epochs_total is not None and self.state.epoch >= self.epochs_total
                and getattr(self, "model", None) is not None):
            self.model.stop_training = True  # the job's last epoch ended (a joiner's too)

    # -- Keras ----------------------------------------------------------------------------------

    def kungfu_arrange(self, callbacks: list) -> None:
        """Keras's callback list of a model.fit, before any callback's set_model: with
        rank_zero_output, the callbacks that write files write once (RankZeroOutput.arrange)."""
        self._progbars = [c for c in callbacks if isinstance(c, keras.callbacks.ProgbarLogger)]
        self._states.callbacks = [c for c in callbacks if c is not self]
        if self.rank_zero_output:
            RankZeroOutput.arrange(callbacks, f"{self._name}/writers")

    def on_train_begin(self, logs=None):
        spe = getattr(self.model, "steps_per_execution", 1)
        if self.data is not None and int(keras.ops.convert_to_numpy(spe)) != 1:
            raise ValueError("kf.Hook with kungfu data needs steps_per_execution=1")
        # Before the train function is wrapped below.
        prepare_fit(self.model, (self.params or {}).get("steps"))
        # Epoch metrics (validation too) over all workers while fit runs, so callbacks that
        # decide from them (EarlyStopping, ReduceLROnPlateau, ...) decide the same everywhere.
        combine_while_training(self.model, True)
        opt = self.optimizer
        self.model.kungfu_epoch_logs = lambda: {**monitor_logs(opt),
                                                **self._cluster.epoch(self.state)}
        if self.rank_zero_output and self._output is None:
            self._output = RankZeroOutput(self.model)
            self._output.start()
        self.epochs_total = (self.params or {}).get("epochs")
        fn = getattr(self.model, "train_function", None)
        if fn is not None:
            fn = getattr(fn, "kungfu_guarded", fn)  # a second fit: wrap Keras's own again
            recover = _elastic.context().enabled and self.data is not None
            self.model.train_function = self._keras_train_function(fn, recover)
            self.membership.recovering = recover
            # A peer lost while the epoch's metrics are combined (callbacks.py) recovers too.
            self.model.kungfu_recover = self._recover if recover else None
        if _peer.joining():
            self._rehearse()
            if self.data is not None:
                self.data.attach()  # before tf.data starts reading ahead
            self.before_train()  # connects and takes the others' state first
            if self.data is not None:
                self.data.attach()  # counts epochs from the position taken
            return
        if self.data is not None:
            self.data.attach()  # tf.data reads ahead: make each batch wait for its step
        self.before_train()  # a resume re-attaches the data at the checkpoint's position

    def on_epoch_begin(self, epoch, logs=None):
        self._states.apply()
        if self._output is not None:
            self._output.refresh()  # rank 0 may be another worker after a failure
        self.before_epoch(epoch)

    def on_train_batch_begin(self, batch, logs=None):
        self._states.apply()
        self.before_step(batch)
        if self.data is not None:
            self._count_steps(batch)

    def on_train_batch_end(self, batch, logs=None):
        self.after_step(logs)
        self._states.apply()  # rank 0's, taken at a switch here: before the epoch end, if any

    def on_epoch_end(self, epoch, logs=None):
        self.after_epoch(logs)

    def on_train_end(self, logs=None):
        try:
            self.after_train()
        finally:
            if self.data is not None:
                self.data.detach()
            if self._output is not None:
                self._output.stop()
                self._output = None
            combine_while_training(self.model, False)
            self.model.kungfu_recover = None
            # a later fit counts from its own initial_epoch
            _internals.set_initial_epoch(self.model, None)
        self._exit_if_detached()
