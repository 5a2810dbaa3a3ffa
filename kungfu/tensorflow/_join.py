"""Uneven data in model.fit: kf.JoinCallback (Horovod's hvd.join and PyTorch's Join, for Keras).

    model.fit(dataset_of_any_length, epochs=E,
              callbacks=[kf.BroadcastGlobalVariablesCallback(), kf.JoinCallback()])

Each epoch is a Join block (kungfu/_join.py):
1. At the epoch's start the block opens; the train function, traced afresh in the first epoch
   (on_train_begin makes Keras build it again), describes each of its allreduces to the workers
   that have joined every time it runs (ops/_collectives.py, _joining).
2. A worker whose data runs out leaves Keras's loop of steps (each epoch where its data ends:
   Keras would keep the first epoch's count of a dataset of unknown length). The first thing
   Keras does then is read the epoch's metrics (before validation and every callback's
   on_epoch_end), and there it joins: it runs, with zeros, the allreduces the others still
   describe, until every worker has joined. The average divides by the whole cluster's size
   (a joined worker counts as zeros), as Horovod's does.
3. Every worker then takes the weights and the optimizer's state of the rank that joined last
   (the one that trained the most steps), as PyTorch's Join with DDP ends with its model, so
   that the next epoch starts from one model; `last_joined` lists that rank per epoch.
4. Validation, the metrics combined over the workers (MetricAverageCallback) and the other
   callbacks then run on every worker together.

kf.Hook's per-step agreement cannot run while a worker has joined: with a Hook, use its data
(kf.ElasticData), which gives every worker the same number of steps.
"""
from __future__ import annotations

from typing import List, Optional

import keras

from kungfu._join import Join
from kungfu.tensorflow import _internals, callbacks as _callbacks
from kungfu.tensorflow.initializer import _optimizer_variables, broadcast_variables, prepare_fit


_fitting = 0  # model.fit calls under way with a JoinCallback


def _ends_epochs(dataset) -> bool:
    return _fitting > 0


class JoinCallback(keras.callbacks.Callback):
    """model.fit on data whose number of batches differs between the workers (a tf.data
    dataset of unknown length, shards of different sizes): each epoch ends on every worker when
    all of them have run out of data, the workers that ran out first contributing zeros to the
    others' steps; every worker then takes the model of the rank that joined last.

    timeout: the deadline of each wait while joined (None: KUNGFU_OP_TIMEOUT).
    last_joined: per epoch, the rank whose model every worker took."""

    def __init__(self, timeout: Optional[float] = None):
        super().__init__()
        self.timeout = timeout
        self.last_joined: List[int] = []
        self._block: Optional[Join] = None
        _callbacks.let_hooks_arrange_callbacks()

    def kungfu_arrange(self, callbacks: list) -> None:
        from kungfu.tensorflow._hook import Hook

        if any(isinstance(c, Hook) for c in callbacks):
            raise ValueError(
                "kf.JoinCallback cannot run beside kf.Hook: the Hook agrees on every step with "
                "every worker, which a worker that has run out of data no longer takes; give "
                "the Hook kf.ElasticData instead (every worker gets the same number of steps)")

    def set_model(self, model) -> None:
        super().set_model(model)
        model.kungfu_uneven = True  # prepare_fit: the steps per epoch may differ

    def on_train_begin(self, logs=None):
        global _fitting
        prepare_fit(self.model)
        # Each epoch ends where this worker's data does (Keras would keep the first one's count).
        _internals.let_data_end_epochs(_ends_epochs)
        _fitting += 1
        _callbacks.install_epoch_end(self.model)
        # A function traced before the first block describes nothing: trace it inside one (a
        # function traced in a block describes only inside one: a later fit keeps it).
        model = self.model
        if model.train_function is None or model.train_function is not getattr(
                model, "kungfu_join_function", None):
            model.kungfu_join_function = model.make_train_function(force=True)

    def on_epoch_begin(self, epoch, logs=None):
        self._close()  # a block left open by a fit that raised
        self._block = Join(self.timeout).__enter__()
        self.model.kungfu_steps_ended = self._steps_ended

    def _steps_ended(self) -> None:
        """Step 2 and 3 of the module's doc: join, then take the last joiner's model."""
        block, self._block = self._block, None
        self.model.kungfu_steps_ended = None
        if block is None:
            return
        block.__exit__(None, None, None)
        last = block.last_joined
        self.last_joined.append(last)
        variables = list(self.model.weights) + _optimizer_variables(self.model)
        broadcast_variables(variables, root=last, name="kungfu/join/last-model")

    def _close(self) -> None:
        block, self._block = self._block, None
        if block is not None:
            block.__exit__(RuntimeError, None, None)  # leaves the block without joining
        if self.model is not None:
            self.model.kungfu_steps_ended = None

    def on_epoch_end(self, epoch, logs=None):
        self._steps_ended()  # done already where Keras read the epoch's metrics

    def on_train_end(self, logs=None):
        global _fitting
        self._close()
        self.model.kungfu_uneven = False
        _fitting = max(0, _fitting - 1)


__all__ = ["JoinCallback"]
