"""kungfu/tensorflow/_internals.py, the one door to TensorFlow's and Keras's private internals:
each internal it relies on still exists with the signature it uses, and each patch still has
the effect it exists for. A failure names the internal that changed (a process alone is a
cluster of one; no peers)."""
from __future__ import annotations

import importlib.util
import inspect

import numpy as np
import pytest

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.skipif(importlib.util.find_spec("tensorflow") is None,
                       reason="TensorFlow is not installed"),
]


@pytest.fixture(scope="module")
def tfk():
    import keras
    import tensorflow as tf

    from kungfu.tensorflow import _internals

    return _internals, tf, keras


def _params(fn) -> list:
    return list(inspect.signature(fn).parameters)


def test_frameworks_are_the_checked_versions(tfk):
    internals, tf, keras = tfk
    assert internals.unchecked_versions() == [], (
        f"TensorFlow/Keras not among those kungfu/tensorflow/_internals.py was checked against "
        f"({internals.CHECKED}): check every piece of it, then add the version")


def test_tensorflow_internals_exist(tfk):
    from tensorflow.python.framework import auto_control_deps as acd
    from tensorflow.python.ops import control_flow_util
    from tensorflow.python.ops.control_flow_v2_func_graphs import ControlFlowFuncGraph

    assert callable(acd.op_is_stateful), "tensorflow.python auto_control_deps.op_is_stateful"
    assert _params(acd.op_is_stateful) == ["op"], "auto_control_deps.op_is_stateful(op)"
    assert isinstance(ControlFlowFuncGraph, type), (
        "control_flow_v2_func_graphs.ControlFlowFuncGraph")
    assert _params(control_flow_util.GraphOrParentsInXlaContext) == ["graph"], (
        "control_flow_util.GraphOrParentsInXlaContext(graph)")


def test_keras_internals_exist(tfk):
    internals, tf, keras = tfk
    from keras.src import api_export
    from keras.src.saving import object_registration
    from keras.src.trainers.epoch_iterator import EpochIterator
    from keras.src.trainers.trainer import Trainer
    from keras.src.utils import io_utils

    assert callable(api_export.get_name_from_symbol), "keras.src.api_export.get_name_from_symbol"
    assert isinstance(api_export.REGISTERED_OBJS_TO_NAMES, dict), (
        "api_export.REGISTERED_OBJS_TO_NAMES")
    assert isinstance(object_registration.GLOBAL_CUSTOM_NAMES, dict), (
        "keras.src.saving.object_registration.GLOBAL_CUSTOM_NAMES")
    assert _params(EpochIterator.catch_stop_iteration) == ["self"], (
        "EpochIterator.catch_stop_iteration(self)")
    assert _params(Trainer._get_metrics_result_or_logs) == ["self", "logs"], (
        "Trainer._get_metrics_result_or_logs(self, logs)")
    assert _params(keras.callbacks.CallbackList.set_model) == ["self", "model"], (
        "CallbackList.set_model(self, model)")
    for name in ("is_interactive_logging_enabled", "enable_interactive_logging",
                 "disable_interactive_logging"):
        assert callable(getattr(io_utils, name, None)), f"keras.src.utils.io_utils.{name}"
    for cls in (keras.callbacks.EarlyStopping, keras.callbacks.ReduceLROnPlateau,
                keras.callbacks.ModelCheckpoint):
        assert _params(cls._set_monitor_op) == ["self"], f"{cls.__name__}._set_monitor_op(self)"
    bar = keras.callbacks.ProgbarLogger()
    assert hasattr(bar, "target") and hasattr(bar, "progbar"), "ProgbarLogger.target/.progbar"
    opt = keras.optimizers.Optimizer
    assert _params(opt._get_variable_index) == ["self", "variable"], (
        "Optimizer._get_variable_index(self, variable)")
    assert _params(keras.layers.BatchNormalization._moments) == ["self", "inputs", "mask"], (
        "BatchNormalization._moments(self, inputs, mask)")
    assert internals.loss_scale_compatible(), (
        f"LossScaleOptimizer lacks one of {internals.LOSS_SCALE_NEEDED}")
    assert _params(keras.optimizers.LossScaleOptimizer._common_apply)[:3] == [
        "self", "grads", "trainable_variables"], "LossScaleOptimizer._common_apply"


def test_unordered_collectives_have_no_control_edges(tfk):
    """Two allreduces of a tf.function: without the patch TensorFlow chains them (a control
    edge from the first to the second); with it neither waits for the other. In a loop they
    stay ordered."""
    internals, tf, keras = tfk
    from tensorflow.python.framework import auto_control_deps as acd

    from kungfu.tensorflow import ops
    from kungfu.tensorflow._oplib import UNORDERED_OPS

    assert getattr(acd.op_is_stateful, "_kungfu", False), "auto_control_deps.op_is_stateful"
    spec = tf.TensorSpec([2], tf.float32)
    graph = tf.function(lambda a, b: (ops.all_reduce(a, name="x/a"), ops.all_reduce(b, name="x/b"))
                        ).get_concrete_function(spec, spec).graph
    reduces = [op for op in graph.get_operations() if op.type == "KungfuAllReduce"]
    assert len(reduces) == 2 and "KungfuAllReduce" in UNORDERED_OPS
    for op in reduces:
        edges = {c.name for c in op.control_inputs} & {r.name for r in reduces}
        assert not edges, f"auto_control_deps ordered the collectives: {edges}"
    assert not any(acd.op_is_stateful(op) for op in reduces)

    in_loop = []

    def body(i, x):
        y = ops.all_reduce(x, name="x/loop")
        in_loop.append(acd.op_is_stateful(y.op))
        return i + 1, y

    tf.function(lambda x: tf.while_loop(lambda i, _: i < 2, body, [0, x])
                ).get_concrete_function(spec)
    assert in_loop == [True], "control_v2 ControlFlowFuncGraph: in a loop the op keeps its order"


def test_in_xla_context(tfk):
    internals, tf, keras = tfk
    seen = []

    def f(x):
        seen.append(internals.in_xla_context())
        return x + 1

    tf.function(f).get_concrete_function(tf.TensorSpec([], tf.float32))
    tf.function(f, jit_compile=True).get_concrete_function(tf.TensorSpec([], tf.float32))
    assert seen == [False, True], "control_flow_util.GraphOrParentsInXlaContext"
    assert internals.in_xla_context() is False  # eagerly


def test_serialize_like(tfk):
    internals, tf, keras = tfk
    base = keras.optimizers.SGD
    dynamic = type("SGD", (base,), {"__module__": base.__module__})
    internals.serialize_like(dynamic, base)
    got = keras.saving.serialize_keras_object(dynamic(0.1))
    want = keras.saving.serialize_keras_object(base(0.1))
    assert (got["module"], got["class_name"]) == (want["module"], want["class_name"]), got


def _steps_per_epoch(keras, tf, lengths, mark: bool):
    """Steps of each epoch model.fit runs over a dataset whose epochs have `lengths` batches."""
    epochs = iter(lengths)

    def batches():
        for _ in range(next(epochs)):
            yield np.ones((2, 1), "float32"), np.zeros((2, 1), "float32")

    spec = (tf.TensorSpec((None, 1), tf.float32),) * 2
    ds = tf.data.Dataset.from_generator(batches, output_signature=spec)
    if mark:
        ds._kungfu_elastic = True
    steps = []

    class Count(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            steps.append(0)

        def on_train_batch_end(self, batch, logs=None):
            steps[-1] += 1

    model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
    model.compile(keras.optimizers.SGD(0.01), "mse")
    model.fit(ds, epochs=len(lengths), verbose=0, callbacks=[Count()])
    return steps


def test_data_ends_epochs(tfk):
    internals, tf, keras = tfk
    assert internals.let_data_end_epochs(lambda ds: getattr(ds, "_kungfu_elastic", False))
    assert _steps_per_epoch(keras, tf, [3, 5], mark=True) == [3, 5], (
        "EpochIterator.catch_stop_iteration / data_adapter._dataset")
    # Keras's own behaviour, kept for other datasets: the first epoch's length sticks.
    assert _steps_per_epoch(keras, tf, [3, 5], mark=False) != [3, 5]


def test_hooks_arrange_callbacks_before_set_model(tfk):
    internals, tf, keras = tfk
    internals.let_hooks_arrange_callbacks()
    order = []

    class Arranger(keras.callbacks.Callback):
        def kungfu_arrange(self, callbacks):
            order.append(("arrange", [type(c).__name__ for c in callbacks]))

    class Other(keras.callbacks.Callback):
        def set_model(self, model):
            order.append(("set_model", None))
            super().set_model(model)

    model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
    keras.callbacks.CallbackList([Arranger(), Other()], model=model)
    assert order[0] == ("arrange", ["Arranger", "Other"]), order
    assert ("set_model", None) in order[1:], order


def test_epoch_metrics_wrapped(tfk):
    internals, tf, keras = tfk
    model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
    model.compile(keras.optimizers.SGD(0.01), "mse")
    internals.wrap_epoch_metrics(model, lambda read: lambda logs: {**read(logs), "wrapped": 7})
    internals.wrap_epoch_metrics(model, lambda read: lambda logs: {})  # once per model
    x, y = np.ones((4, 1), "float32"), np.zeros((4, 1), "float32")
    seen = []
    cb = keras.callbacks.LambdaCallback(on_epoch_end=lambda e, logs: seen.append(dict(logs)))
    model.fit(x, y, epochs=1, verbose=0, callbacks=[cb])
    assert seen[0].get("wrapped") == 7, f"Trainer._get_metrics_result_or_logs: {seen}"
    assert model.evaluate(x, y, verbose=0, return_dict=True).get("wrapped") == 7


def test_interactive_logging(tfk):
    internals, tf, keras = tfk
    before = internals.interactive_logging()
    try:
        internals.set_interactive_logging(False)
        assert keras.config.is_interactive_logging_enabled() is False, "io_utils"
        assert internals.interactive_logging() is False
        internals.set_interactive_logging(True)
        assert keras.config.is_interactive_logging_enabled() is True, "io_utils"
    finally:
        internals.set_interactive_logging(before)


def test_monitor_op_set_up(tfk):
    internals, tf, keras = tfk
    cb = keras.callbacks.EarlyStopping(monitor="val_loss", min_delta=0.1)
    assert not internals.monitor_op_chosen(cb), "EarlyStopping chooses monitor_op lazily"
    internals.choose_monitor_op(cb)
    assert internals.monitor_op_chosen(cb)
    assert cb.min_delta == -0.1, "EarlyStopping._set_monitor_op turns min_delta for a loss"
    assert internals.monitor_op_chosen(keras.callbacks.Callback())


def test_initial_epoch_and_progress_total(tfk):
    internals, tf, keras = tfk
    model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
    model.compile(keras.optimizers.SGD(0.01), "mse")
    epochs, bars = [], []

    class Start(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            internals.set_initial_epoch(self.model, 2)

        def on_epoch_begin(self, epoch, logs=None):
            epochs.append(epoch)

        def on_train_batch_end(self, batch, logs=None):
            internals.set_progress_total(bar, 9)
            bars.append((bar.target, getattr(bar.progbar, "target", None)))

    bar = keras.callbacks.ProgbarLogger()
    model.fit(np.ones((4, 1), "float32"), np.zeros((4, 1), "float32"), batch_size=2, epochs=4,
              verbose=0, callbacks=[Start(), bar])
    assert epochs == [2, 3], f"model._initial_epoch read after on_train_begin: {epochs}"
    assert bars and all(b == (9, 9) for b in bars), bars
    internals.set_initial_epoch(model, None)
    epochs.clear()
    model.fit(np.ones((2, 1), "float32"), np.zeros((2, 1), "float32"), epochs=1, verbose=0)


def test_optimizer_internals(tfk):
    internals, tf, keras = tfk
    a, b = tf.Variable([1.0]), tf.Variable([2.0, 3.0])
    opt = keras.optimizers.SGD(0.5, momentum=0.9)
    opt.build([a, b])
    assert internals.trainable_variables(opt) == [a, b]
    assert internals.variable_index(opt, b) == 1
    counter = internals.iterations_variable(opt)
    opt.apply([tf.constant([1.0]), tf.constant([1.0, 1.0])], [a, b])
    assert int(counter.numpy()) == 1 and counter is opt.iterations


def test_batch_normalization_moments(tfk):
    internals, tf, keras = tfk
    got = []

    class Fixed(internals.BatchNormalizationMoments):
        def moments(self, inputs, mask, axes):
            got.append(axes)
            return tf.zeros([inputs.shape[-1]]), tf.ones([inputs.shape[-1]])

    layer = Fixed(epsilon=0.0)
    x = tf.constant([[1.0, 5.0], [3.0, 9.0]])
    out = layer(x, training=True)
    assert got == [[0]], f"BatchNormalization._moments / _reduction_axes: {got}"
    np.testing.assert_allclose(out.numpy(), x.numpy())  # mean 0, variance 1: unchanged


def test_no_private_internals_outside_the_adapter():
    """Only kungfu/tensorflow/_internals.py imports keras.src or tensorflow.python, or names
    the Keras internals it wraps."""
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parents[2] / "kungfu"
    pattern = re.compile(r"keras\.src|tensorflow\.python|\._initial_epoch"
                         r"|_get_metrics_result_or_logs|_set_monitor_op|_common_apply"
                         r"|_reduction_axes|\._iterations\b"
                         r"|\._trainable_variables|_get_variable_index|catch_stop_iteration")
    found = [f"{p.relative_to(root.parent)}:{n}: {line.strip()}"
             for p in sorted(root.rglob("*.py")) if p.name != "_internals.py"
             for n, line in enumerate(p.read_text().splitlines(), 1)
             if pattern.search(line) and not line.lstrip().startswith("#")]
    assert found == [], "\n".join(found)
