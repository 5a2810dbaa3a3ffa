"""Loads the TensorFlow op library built with kungfu, after checking it matches this TensorFlow."""
from __future__ import annotations

import os

import tensorflow as tf

from kungfu import _peer

_HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_LIB = os.path.join(_HERE, "libkungfu_tensorflow_ops.so")
_VERSION_FILE = os.path.join(_HERE, "kungfu_tensorflow_ops.tf_version")
REBUILD = "pip install --no-build-isolation -e .   (in the kungfu checkout, with this Python)"


def _load():
    if not os.path.exists(_LIB):
        raise ImportError(
            "kungfu's TensorFlow op library is missing: kungfu was built where TensorFlow was not "
            f"importable. Install TensorFlow, then rebuild kungfu: {REBUILD}"
        )
    try:
        with open(_VERSION_FILE) as f:
            built = f.read().strip()
    except OSError:
        raise ImportError(
            f"{_VERSION_FILE} is missing, so kungfu cannot tell which TensorFlow its op library "
            f"was built for. Rebuild kungfu: {REBUILD}"
        ) from None
    if built != tf.__version__:
        raise ImportError(
            f"kungfu's TensorFlow op library was built for TensorFlow {built}, but this is "
            f"TensorFlow {tf.__version__}. Rebuild kungfu: {REBUILD}"
        )
    return tf.load_op_library(_LIB)


class _Ops:
    """The op library's functions. Importing connects to no peer: the first op asked for does
    (the kernels find the process's peer through the runtime library, which the op library
    shares with the Python module, so it must exist before any op runs). A worker joining an
    elastic job connects later, when kf.Hook syncs it."""

    def __init__(self, library):
        self._library = library

    def __getattr__(self, name: str):
        op = getattr(self._library, name)
        if not _peer.started() and not _peer.joining():
            _peer.get()
        return op


# Collectives whose result is their output: inside a tf.function they need no order among
# themselves. TensorFlow's automatic control dependencies run every stateful op in program order,
# which made a step's per-tensor allreduces run one after another, a round trip each (ResNet-50's
# 214 gradients at np=2: about 85 ms, against 31-34 ms when they overlap and the runtime fuses
# them; docs/tensorflow.md). kungfu matches operations by name, never by order, so they may run
# in any order, like TensorFlow's own collectives (CollectiveReduce and the like are exempt the
# same way). As with them, an op whose output nothing uses is pruned: synchronize with barrier(),
# which stays ordered.
#
# Not inside a loop or a cond: there the same op runs again under the same name (every
# iteration), and without its control edges a later iteration's op may start before an earlier
# one's, so the k-th run of the name would pair different iterations on different workers (wrong
# sums, seen in a tf.range loop). Ops of one name outside loops are ordered by ops._issue.
UNORDERED_OPS = frozenset(("KungfuAllReduce", "KungfuGroupAllReduce", "KungfuBroadcast",
                           "KungfuAllGather", "KungfuAllToAll", "KungfuReduceScatter"))


lib = _Ops(_load())


def _unorder() -> None:
    from kungfu.tensorflow import _internals  # after the load: a refused library leaves nothing

    _internals.unorder_collectives(UNORDERED_OPS)


_unorder()
