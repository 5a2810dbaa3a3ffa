"""kf.load_model: a saved Keras model back with its optimizer distributed.

A kungfu distributed optimizer saves as the optimizer it wraps, so a saved model loads anywhere,
without kungfu; keras.models.load_model therefore gives the plain optimizer back. Resuming a
distributed job with it would train each worker alone.
"""
from __future__ import annotations

import keras

from kungfu.tensorflow.optimizers import Optimizer


def load_model(filepath, custom_objects=None, compile: bool = True, safe_mode: bool = True,
               *, algorithm: str = "sync-sgd", **options):
    """keras.models.load_model(filepath, custom_objects, compile, safe_mode), with the model's
    optimizer wrapped in kf.Optimizer(optimizer, algorithm, **options). The optimizer's saved
    state (slots, iteration counter) is kept. Every worker loads the same file; a model saved
    without an optimizer, or loaded with compile=False, is returned as Keras loads it.

        model = kf.load_model("checkpoint.keras")   # then model.fit(...) as before
    """
    model = keras.models.load_model(filepath, custom_objects=custom_objects, compile=compile,
                                    safe_mode=safe_mode)
    opt = getattr(model, "optimizer", None)
    if opt is not None and not isinstance(opt, Optimizer):
        model.optimizer = Optimizer(opt, algorithm, **options)
    return model
