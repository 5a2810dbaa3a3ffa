"""Elastic membership, framework-neutral: resize and recovery as one state machine.

- `_protocol.py`: the steps in the config store (propose, wait for joiners, switch, abandon,
  recover) and this worker's view of the job (`context()`).
- `_membership.py`: `Membership`, the state machine a trainer drives at its step boundaries
  (training, proposing, waiting for joiners, switching, recovering), with the in-memory commits
  and the durable checkpoint; a framework binding supplies `Variables` (capture and restore).
- `_checkpoint.py`: the checkpoint file's format (header, checksum) and its atomic write.

kf.Hook (kungfu/tensorflow/_hook.py) is the TensorFlow trainer; kungfu/tensorflow/_variables.py
its binding. Nothing here imports a framework or the launcher.
"""
from kungfu.elastic._checkpoint import CheckpointError, check_writable  # noqa: F401
from kungfu.elastic._membership import (  # noqa: F401
    Commit,
    Membership,
    State,
    Trainer,
    Variables,
    first_line,
    mismatch,
)
from kungfu.elastic._protocol import (  # noqa: F401
    Elastic,
    ExpelledError,
    Recovery,
    ResizeError,
    context,
    detached,
    resize,
    resize_now,
)
