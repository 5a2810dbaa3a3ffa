"""Elastic training, framework-neutral: the decision round, and resize and recovery as one
state machine.

- `_round.py`: the `Round` a trainer drives at its step boundaries: policies' hooks run,
  their decisions recorded, agreed and applied (a registry of actions); `_actions.py`: the
  actions (kf.set_tree, kf.set_batch_size, kf.resize, ...); `_state.py`: the TrainingState that
  policies read.

- `_protocol.py`: the steps in the config store (propose, wait for joiners, switch, abandon,
  recover) and this worker's view of the job (`context()`).
- `_membership.py`: `Membership`, the state machine a trainer drives at its step boundaries
  (training, proposing, waiting for joiners, switching, recovering), with the in-memory commits
  and the durable checkpoint; a framework binding supplies `Variables` (capture and restore).
- `_checkpoint.py`: the checkpoint file's format (header, checksum or HMAC) and its atomic write;
  `_checkpoint_content.py`: what it holds (arrays in an .npz, the rest as JSON: no pickle);
  `convert_checkpoint.py`: converts a format-version-1 file one trusts.
- `_data.py`: `ElasticData`, training samples addressed by global offset (every sample once per
  epoch across resizes and failures), served as numpy batches.

The trainer that drives them is a `kungfu._loop.Loop`: kf.Hook (kungfu/tensorflow/_hook.py, with
its binding kungfu/tensorflow/_variables.py) and kungfu.torch's ElasticTrainer. Nothing here
imports a framework or the launcher.
"""
from kungfu.elastic._actions import (  # noqa: F401
    check_batch_size,
    check_batch_sizes,
    check_learning_rate,
    resize,
    set_batch_size,
    set_batch_sizes,
    set_learning_rate,
    set_strategy,
    set_tree,
)
from kungfu.elastic._checkpoint import CheckpointError, check_writable  # noqa: F401
from kungfu.elastic._data import ElasticData  # noqa: F401
from kungfu.elastic._membership import (  # noqa: F401
    Commit,
    Membership,
    State,
    Trainer,
    Variables,
    runtime_message,
    mismatch,
)
from kungfu.elastic._protocol import (  # noqa: F401
    Elastic,
    ExpelledError,
    Recovery,
    ResizeError,
    context,
    detached,
    resize_now,
)
from kungfu.elastic._round import HOOKS, Round, call_hook, in_round  # noqa: F401
from kungfu.elastic._state import TrainingState  # noqa: F401
