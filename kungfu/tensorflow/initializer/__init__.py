"""Start every worker from the same state: root's model weights and optimizer state.

    kf.broadcast_variables(model.weights + optimizer.variables, root=0)
    model.fit(..., callbacks=[kf.BroadcastGlobalVariablesCallback(root=0)])

Variables are grouped by dtype and fused into buckets, one broadcast per bucket; the op names are
derived from `name`, the dtype and the position of the bucket's first variable, so every worker
that passes the same list of variables issues the same names.
"""
from __future__ import annotations

import warnings
from typing import Iterable, Optional

import keras
import tensorflow as tf

from kungfu import _collective, _peer
from kungfu.tensorflow.optimizers import _fusion

DEFAULT_BUCKET_BYTES = 16 << 20


def _flatten(variables) -> list:
    if isinstance(variables, (tf.Variable, keras.Variable)):
        return [variables]
    out = []
    for v in variables:
        if isinstance(v, (list, tuple)):
            out.extend(_flatten(v))
        else:
            out.append(v)
    return out


def broadcast_variables(variables: Iterable, root: int = 0, name: str = "kungfu/broadcast",
                        bucket_bytes: int = DEFAULT_BUCKET_BYTES):
    """Assigns root's values to `variables` on every worker.

    variables: tf.Variable or keras.Variable objects (a list, possibly nested), in the same order
    on every worker. Works eagerly and inside tf.function (then returns the grouped assign op).
    name: prefix of the broadcast ops' names; two broadcasts that may run concurrently need
    different prefixes.
    """
    if isinstance(root, bool) or not isinstance(root, int):
        raise TypeError(f"root must be an int, got {type(root).__name__}")
    size = _peer.identity().size
    if not 0 <= root < size:
        raise ValueError(f"root {root} is not a rank of this cluster of {size} workers")
    variables = _flatten(variables)
    # A TF1-style graph (tf.compat.v1.Session), not a tf.function: there the assigns run only if
    # the returned op runs them.
    session_graph = not tf.executing_eagerly() and not tf.inside_function()
    for v in variables:
        if not isinstance(v, (tf.Variable, keras.Variable)):
            raise TypeError(f"broadcast_variables takes variables, got {type(v).__name__}")
        if session_graph and not isinstance(v, tf.Variable):
            raise TypeError(
                f"broadcast_variables: {v.name} is a keras.Variable, which Keras 3 cannot assign "
                "in a TF1-style graph (its assign returns the value and changes nothing when "
                "run); use tf.Variable there, or call it eagerly or inside a tf.function")
        if not tf.TensorShape(v.shape).is_fully_defined():
            raise ValueError(f"variable {v.name} has a shape that is not fully defined: "
                             f"{v.shape}")
    received = _fusion.broadcast([tf.convert_to_tensor(v) for v in variables], root, name,
                                 bucket_bytes)
    # tf.Variable.assign in a graph returns an unread view of the variable, not the assign op (a
    # group of those was empty, so a session broadcast nothing); read_value=False returns the op.
    assigns = [v.assign(r, read_value=False) if isinstance(v, tf.Variable) else v.assign(r)
               for v, r in zip(variables, received)]
    if tf.executing_eagerly():
        return None
    return tf.group([a for a in assigns if isinstance(a, (tf.Tensor, tf.Operation))])


def model_built(model) -> bool:
    """Whether the model's variables exist: a model without keras.Input creates them in its
    first training step."""
    return bool(getattr(model, "built", True))


def _optimizer_variables(model) -> list:
    opt = getattr(model, "optimizer", None)
    if opt is None or not model_built(model):
        return []  # building the optimizer before the model would tie it to no variables
    if not opt.built:
        # Keras creates slots lazily: create them now so they can be broadcast too.
        with keras.name_scope(opt.name, caller=opt):
            opt.build(list(model.trainable_variables))
    return list(opt.variables)


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """Keras callback: at the start of training every worker takes root's model weights and
    optimizer state (slots, iteration counter, learning rate variable).

    The broadcast happens once per callback object, in on_train_begin (after the first step for
    a model that creates its variables in it: built without keras.Input); the optimizer is
    built on the model's trainable variables first if Keras has not built it yet. kf.Hook does the same
    by itself, so with a Hook this callback is optional; in a worker that joins a running
    elastic job it does nothing (the Hook gives it the others' state). When the model's
    optimizer is a kungfu distributed optimizer and the model was compiled for XLA (Keras does
    that by itself on GPUs), the callback switches the training step to jit_compile=False, with
    a warning: kungfu's collectives cannot run inside XLA clusters.
    """

    def __init__(self, root: int = 0, name: str = "kungfu/broadcast-global", **kwargs):
        kwargs.pop("with_keras", None)  # accepted for compatibility, nothing to choose
        root = kwargs.pop("root_rank", root)
        if kwargs:
            raise TypeError(f"unexpected arguments {sorted(kwargs)}")
        super().__init__()
        self.root = root
        self.name = name
        self.done = False

    def broadcast(self):
        model = self.model
        # model.weights: trainable and non-trainable weights (e.g. batch-norm statistics), but
        # not the layers' random seed states, which stay per worker.
        variables = list(model.weights) + _optimizer_variables(model)
        broadcast_variables(variables, root=self.root, name=self.name)
        self.done = True

    def on_train_begin(self, logs=None):
        prepare_fit(self.model, (self.params or {}).get("steps"))
        # A worker that joins a running elastic job takes the others' state from kf.Hook; a
        # broadcast of its own would wait for peers that are not in it.
        if _peer.started_as_joiner():
            self.done = True
        if not self.done and model_built(self.model):
            self.broadcast()

    def on_train_batch_end(self, batch, logs=None):
        if not self.done:  # a model built by its first step: equal from the second on
            self.broadcast()


def prepare_fit(model, steps: Optional[int] = None) -> None:
    """What model.fit needs before its first step, from BroadcastGlobalVariablesCallback or
    kf.Hook (either may be the only kungfu callback):
    - every worker must train the same number of steps per epoch (`steps`: Keras's count, None
      when it does not know it): a worker with a batch more would wait in its last step for
      peers that have ended the epoch. Unequal counts fail at once on every worker, naming them;
    - kungfu's collectives have no XLA kernels: a model whose optimizer is distributed must not
      train in an XLA-compiled step (Keras picks XLA by itself on GPUs with jit_compile="auto");
    - a model with Keras's own train_step and a plain optimizer trains on each worker alone:
      say so (the usual cause is a model reloaded with keras.models.load_model, which gives the
      plain optimizer back; kf.load_model distributes it again)."""
    from kungfu.tensorflow.optimizers import Optimizer

    # kf.JoinCallback: the workers may run out of data at different steps
    _check_equal_steps(None if getattr(model, "kungfu_uneven", False) else steps)
    opt = getattr(model, "optimizer", None)
    if opt is None:
        return
    if isinstance(opt, keras.optimizers.LossScaleOptimizer):
        # compile under mixed_float16 wraps kf.Optimizer(...) in a LossScaleOptimizer
        # (kungfu/tensorflow/_internals.py, agree_on_overflow, makes that agree on overflow).
        opt = opt.inner_optimizer
    if not isinstance(opt, Optimizer):
        own_step = getattr(type(model), "train_step", None) is not keras.Model.train_step
        if _peer.identity().size > 1 and not own_step:
            warnings.warn(
                f"kungfu: the model's optimizer is a plain {type(opt).__name__}, not a kungfu "
                "distributed optimizer: each worker trains on its own. Wrap it with "
                "kf.Optimizer before compile; a model loaded with keras.models.load_model has "
                "its plain optimizer back (kf.load_model distributes it again)")
        return
    if getattr(model, "jit_compile", False) and not getattr(model, "run_eagerly", False):
        warnings.warn("kungfu: training without XLA (jit_compile=False): the distributed "
                      "optimizer's collectives cannot be compiled by XLA")
        model.jit_compile = False
        model.make_train_function(force=True)


def _check_equal_steps(steps: Optional[int]) -> None:
    # (joining() first: a warm spare has no size until it is given its place, kungfu/_spare.py)
    if _peer.joining() or _peer.identity().size == 1:
        return  # a joiner continues the others' epoch (kf.Hook's data)
    counts = _collective.allgather_object(steps, name="kungfu/fit/steps-per-epoch")
    if None in counts or len(set(counts)) == 1:
        return
    ranks = ", ".join(f"rank {r}: {c}" for r, c in enumerate(counts))
    raise ValueError(
        f"kungfu: the workers have different numbers of steps per epoch ({ranks}): each step "
        "is a collective of every worker, so give each the same number of batches (kf.shard "
        "splits data into equal shares; or pass steps_per_epoch=), or train on kf.ElasticData")


__all__ = ["broadcast_variables", "BroadcastGlobalVariablesCallback"]
