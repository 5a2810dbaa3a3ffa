"""kungfu for TensorFlow 2 / Keras 3: ops, distributed optimizers, initialisation callbacks.

Importing this module loads kungfu's op library (checking it was built for this TensorFlow) and
connects this worker to its peers.
"""
from kungfu.tensorflow import ops  # noqa: F401
