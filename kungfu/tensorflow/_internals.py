"""The one door to TensorFlow's and Keras's private internals.

Every use kungfu makes of a framework's private names (`keras.src...`, `tensorflow.python...`,
underscored attributes and methods) and every function it replaces process-wide is here, so
that a framework upgrade has one file to check. Checked against the versions in CHECKED;
tests/unit/test_internals.py asserts that each name used here still exists with the
signature relied on, and that each patch still has the effect it exists for: it fails naming
the internal that changed.

What each piece is for:

- `unorder_collectives`: TensorFlow's automatic control dependencies (`auto_control_deps.
  op_is_stateful`, replaced process-wide) leave kungfu's collectives outside loops and conds
  unordered, so a step's allreduces overlap (kungfu/tensorflow/_oplib.py says why);
- `in_xla_context`: kf.Optimizer refuses to run inside an XLA-compiled function
  (`control_flow_util.GraphOrParentsInXlaContext`);
- `serialize_like`: kf.Optimizer's dynamic subclasses serialize as the class they wrap
  (Keras's export and custom-object registries);
- `let_data_end_epochs`: Keras's `EpochIterator.catch_stop_iteration` (replaced process-wide)
  fixes an epoch's length from the first epoch; kungfu's elastic datasets end each epoch;
- `let_hooks_arrange_callbacks`: `CallbackList.set_model` (replaced process-wide) hands a
  kf.Hook the fit's callbacks before they are set up;
- `wrap_epoch_metrics`: a model's `_get_metrics_result_or_logs`, Keras's one place for "the
  metrics of an epoch", replaced on that model to combine the workers' metrics;
- `interactive_logging` / `set_interactive_logging`: Keras's progress output switch
  (`keras.src.utils.io_utils`);
- `monitor_op_chosen` / `choose_monitor_op`: the lazy set-up of Keras's monitoring callbacks
  (`_set_monitor_op`);
- `set_initial_epoch`: the epoch model.fit counts from (`model._initial_epoch`);
- `set_progress_total`: the steps of an epoch a ProgbarLogger shows (`target`, `progbar`);
- `iterations_variable`, `trainable_variables`, `variable_index`: a Keras optimizer's own
  counter, its variables and their slots' index (`_iterations`, `_trainable_variables`,
  `_get_variable_index`);
- `BatchNormalizationMoments`: keras.layers.BatchNormalization whose batch statistics a
  subclass computes (it overrides `_moments`, reading `_reduction_axes`);
- `agree_on_overflow`: LossScaleOptimizer's `_common_apply` (replaced process-wide) lets a
  kungfu inner optimizer decide overflow for every worker alike (see its doc).
"""
from __future__ import annotations

import contextlib
import warnings
from typing import Callable, Iterable, List

import keras
import tensorflow as tf

# The versions every piece below was checked against (major.minor).
CHECKED = {"tensorflow": ("2.21",), "keras": ("3.15",)}


def unchecked_versions() -> list:
    """The installed frameworks whose version is not in CHECKED, as "name version" strings."""
    installed = {"tensorflow": tf.__version__, "keras": keras.__version__}
    return [f"{name} {v}" for name, v in installed.items()
            if not v.startswith(tuple(p + "." for p in CHECKED[name]))]


# --- TensorFlow ---------------------------------------------------------------------------------

def unorder_collectives(op_types: Iterable[str]) -> bool:
    """Makes TensorFlow's automatic control dependencies leave ops of `op_types` unordered
    outside loops and conds (inside them the ops keep their order). Idempotent. False when this
    TensorFlow lacks what it needs (the ops then stay ordered: correct, slower)."""
    try:
        from tensorflow.python.framework import auto_control_deps as acd
        from tensorflow.python.ops.control_flow_v2_func_graphs import ControlFlowFuncGraph
    except ImportError:
        return False
    ordered = getattr(acd, "op_is_stateful", None)
    if ordered is None:
        return False
    if getattr(ordered, "_kungfu", False):
        return True
    types = frozenset(op_types)

    def in_control_flow(graph) -> bool:
        while graph is not None:
            if isinstance(graph, ControlFlowFuncGraph):
                return True
            graph = getattr(graph, "outer_graph", None)
        return False

    def op_is_stateful(op):
        if op.type in types and not in_control_flow(op.graph):
            return False
        return ordered(op)

    op_is_stateful._kungfu = True
    acd.op_is_stateful = op_is_stateful
    return True


def in_xla_context() -> bool:
    """Whether the function being traced is compiled with XLA."""
    try:
        from tensorflow.python.ops import control_flow_util
    except ImportError:  # pragma: no cover - private module moved
        return False
    if tf.executing_eagerly():
        return False
    return bool(control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph()))


# --- Keras: serialization, data, callbacks, models ----------------------------------------------

def serialize_like(dynamic: type, base: type) -> None:
    """Makes Keras serialize instances of `dynamic` exactly as instances of `base`."""
    try:
        from keras.src import api_export
        from keras.src.saving import object_registration
    except ImportError:  # pragma: no cover - Keras internals moved: names still match
        return
    public = api_export.get_name_from_symbol(base)
    if public is not None:
        api_export.REGISTERED_OBJS_TO_NAMES[dynamic] = public
    custom = object_registration.GLOBAL_CUSTOM_NAMES.get(base)
    if custom is not None:
        object_registration.GLOBAL_CUSTOM_NAMES[dynamic] = custom


# The datasets whose epochs end where their data does (let_data_end_epochs): one test each.
_data_ending: List[Callable[[object], bool]] = []


def let_data_end_epochs(ours: Callable[[object], bool]) -> bool:
    """Keras takes the number of steps of a dataset of unknown length from its first epoch and
    ends every later epoch after that many steps. For a dataset that `ours(dataset)` (or the
    test of an earlier call) accepts, Keras forgets the inferred count and lets the data end
    each epoch (without its "ran out of data" warning). Process-wide, once; False when Keras
    lacks what it needs."""
    try:
        from keras.src.trainers.epoch_iterator import EpochIterator
    except ImportError:  # pragma: no cover - Keras moved it; epochs then keep their length
        return False
    if ours not in _data_ending:
        _data_ending.append(ours)
    original = EpochIterator.catch_stop_iteration
    if getattr(original, "_kungfu", False):
        return True

    @contextlib.contextmanager
    def catch_stop_iteration(self):
        dataset = getattr(self.data_adapter, "_dataset", None)
        if not any(test(dataset) for test in _data_ending):
            with original(self):
                yield
            return
        try:
            yield
        except StopIteration:
            self._current_iterator = None
            self.data_adapter.on_epoch_end()

    catch_stop_iteration._kungfu = True
    EpochIterator.catch_stop_iteration = catch_stop_iteration
    return True


def let_hooks_arrange_callbacks() -> None:
    """Keras makes a CallbackList for each model.fit and calls every callback's set_model first
    (TensorBoard writes there already): a callback with a `kungfu_arrange` method gets the list
    before that, to arrange the others. Process-wide, once."""
    cls = keras.callbacks.CallbackList
    own = cls.set_model
    if getattr(own, "kungfu_arranges", False):
        return

    def set_model(self, model):
        if not getattr(self, "kungfu_arranged", False):
            self.kungfu_arranged = True
            for c in list(self.callbacks):
                arrange = getattr(c, "kungfu_arrange", None)
                if arrange is not None:
                    arrange(self.callbacks)
        own(self, model)

    set_model.kungfu_arranges = True
    cls.set_model = set_model


def wrap_epoch_metrics(model, wrap: Callable[[Callable], Callable]) -> None:
    """Replaces, on `model`, Keras's reading of an epoch's metrics (`read(logs) -> dict`, what
    every callback sees at an epoch's end and model.evaluate returns) by `wrap(read)`. Once per
    model: a wrapped model is left as it is."""
    own = model._get_metrics_result_or_logs
    if getattr(own, "kungfu_wrapped", False):
        return
    wrapped = wrap(own)
    wrapped.kungfu_wrapped = True
    model._get_metrics_result_or_logs = wrapped


def interactive_logging() -> bool:
    """Whether Keras prints its progress bars and messages."""
    from keras.src.utils import io_utils

    return bool(io_utils.is_interactive_logging_enabled())


def set_interactive_logging(on: bool) -> None:
    from keras.src.utils import io_utils

    (io_utils.enable_interactive_logging if on else io_utils.disable_interactive_logging)()


def monitor_op_chosen(callback) -> bool:
    """Whether a Keras monitoring callback (EarlyStopping, ReduceLROnPlateau, ModelCheckpoint)
    chose its comparison, which it does lazily at its first epoch end; True for a callback
    without one."""
    return not hasattr(callback, "_set_monitor_op") or callback.monitor_op is not None


def choose_monitor_op(callback) -> None:
    """Runs a monitoring callback's lazy set-up now (it turns min_delta's sign)."""
    callback._set_monitor_op()


def set_progress_total(logger, total: int) -> None:
    """The number of steps a ProgbarLogger's bar shows for this epoch (its `target` and its
    Progbar's, which it otherwise takes from the first epoch)."""
    logger.target = total
    if logger.progbar is not None:
        logger.progbar.target = total


def set_initial_epoch(model, epoch) -> None:
    """The epoch model.fit counts from: Keras reads the model's `_initial_epoch` after the
    callbacks' on_train_begin (BackupAndRestore sets it so too); None: fit's own argument."""
    model._initial_epoch = epoch


# --- Keras: optimizers and layers ---------------------------------------------------------------

def iterations_variable(optimizer):
    """The optimizer's own step counter (not a LossScaleOptimizer's inner one's)."""
    return optimizer._iterations


def trainable_variables(optimizer) -> list:
    """The variables the optimizer was built on."""
    return optimizer._trainable_variables


def variable_index(optimizer, variable) -> int:
    """The index of `variable` among those the optimizer was built on (its slots' index)."""
    return optimizer._get_variable_index(variable)


class BatchNormalizationMoments(keras.layers.BatchNormalization):
    """keras.layers.BatchNormalization whose training-time mean and variance come from the
    subclass's `moments(inputs, mask, axes)` (axes: those reduced over)."""

    def moments(self, inputs, mask, axes):  # pragma: no cover - subclasses define it
        raise NotImplementedError

    def _moments(self, inputs, mask):
        return self.moments(inputs, mask, list(self._reduction_axes))


# --- Keras: LossScaleOptimizer around a kungfu optimizer ---------------------------------------
#
# With the mixed_float16 policy, `model.compile` wraps the optimizer it gets in
# LossScaleOptimizer (keras/src/trainers/trainer.py, `compile`), so `kf.Optimizer(SGD)` becomes
# LossScaleOptimizer(kf.Optimizer(SGD)). Its `apply` goes (through `_tf_apply`, under the
# default distribution strategy) to `_common_apply(grads, trainable_variables)`, which:
#
# 1. `check_finite(grads)`: are this worker's scaled gradients finite;
# 2. if so, `_stateful_handle_finite_grads`: divides them by the loss scale and calls
#    `inner_optimizer.apply`, where kungfu's collectives are, then maybe doubles the scale;
# 3. if not, `_stateful_handle_non_finite_grads`: halves the scale and skips the step.
#
# A worker whose gradients overflow alone skips step 2 while the others wait in its collective
# until the op deadline. `agree_on_overflow()` replaces `_common_apply` with one that, when the
# inner optimizer is kungfu's, lets it decide step 1 for every worker alike
# (`Optimizer._kf_loss_scaled`): sync-sgd averages the gradients first and checks the averages
# (so a sum that overflows counts too); the other algorithms agree on the workers' checks (one
# overflow skips the step everywhere). Steps 2 and 3 stay Keras's own; any other inner
# optimizer keeps Keras's code. kf.Optimizer(LossScaleOptimizer(SGD)) needs none of this: its
# apply averages the gradients before LossScaleOptimizer's runs.

# What the replacement calls or replaces: without any of them, Keras is left alone.
LOSS_SCALE_NEEDED = ("_common_apply", "check_finite", "_stateful_handle_finite_grads",
                     "_stateful_handle_non_finite_grads")


def loss_scale_compatible() -> bool:
    """Whether this Keras's LossScaleOptimizer has what the replacement relies on."""
    return all(callable(getattr(keras.optimizers.LossScaleOptimizer, m, None))
               for m in LOSS_SCALE_NEEDED)


def agree_on_overflow() -> None:
    """Makes LossScaleOptimizer let a kungfu inner optimizer (one with `_kf_loss_scaled`)
    decide overflow. Process-wide, idempotent."""
    cls = keras.optimizers.LossScaleOptimizer
    if getattr(cls._common_apply, "kungfu_agreed", False):
        return
    if not loss_scale_compatible():
        warnings.warn(
            f"kungfu: Keras {keras.__version__}'s LossScaleOptimizer is not the one kungfu knows "
            f"(checked: {', '.join(CHECKED['keras'])}); LossScaleOptimizer(kf.Optimizer(...)), "
            "what compile makes under mixed_float16, may skip a step on one worker only: wrap "
            "the other way round, kf.Optimizer(keras.optimizers.LossScaleOptimizer(...))")
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
