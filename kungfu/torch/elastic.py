"""Elastic training and adaptation policies for a PyTorch loop (docs/torch.md, "Elastic").

    data = kf.ElasticData(x, y, batch_size=32)            # numpy arrays; per-worker batch size
    trainer = kf.ElasticTrainer(model, optimizer, MyPolicy(), data=data)

    def train_step(x, y, w):                              # this worker's part of the step
        optimizer.zero_grad()
        loss = (loss_fn(model(torch.from_numpy(x)), torch.from_numpy(y)) * w).mean()
        loss.backward()
        optimizer.step()
        return loss.item()

    trainer.fit(train_step, epochs=10)

ElasticTrainer is a kungfu._loop.Loop, as kf.Hook is for Keras: the same decision round, the
same policies (kf.set_batch_size, kf.set_learning_rate, kf.resize, ...), resize and recovery,
with this module's binding of torch's state: the model's parameters and buffers and the
optimizer's state_dict (its momentum, its learning rate).
"""
from __future__ import annotations

import copy
import io
from typing import Callable, List, Optional, Sequence, Union

import numpy as np
import torch

from kungfu import _collective, _peer, errors
from kungfu._loop import Loop
from kungfu.elastic import Variables
from kungfu.torch.ops import broadcast_parameters
from kungfu.torch.ops._tensors import check, host_array, to_tensor


def _state_bytes(state: dict) -> np.ndarray:
    """An optimizer's state_dict as torch.save's bytes: what the checkpoint file (arrays) and a
    joiner's transfer (lend) carry; _OptimizerState.write reads it back."""
    buf = io.BytesIO()
    torch.save(state, buf)
    return np.frombuffer(buf.getvalue(), np.uint8)


class _OptimizerState:
    """The optimizer's state_dict as one entry of the variables (it is created lazily by the
    optimizer's first step, so its tensors cannot be listed up front)."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer

    def read(self) -> np.ndarray:
        return _state_bytes(self.optimizer.state_dict())

    def write(self, blob: np.ndarray) -> None:
        state = torch.load(io.BytesIO(np.ascontiguousarray(blob).tobytes()), weights_only=True)
        self.optimizer.load_state_dict(state)


class TorchVariables(Variables):
    """The variables of an ElasticTrainer: the model's parameters and buffers (tensors) and the
    optimizer's state (one _OptimizerState entry)."""

    def __init__(self, trainer: "ElasticTrainer"):
        self.trainer = trainer

    def _named(self) -> list:
        m = self.trainer.model
        return list(m.named_parameters()) + list(m.named_buffers())

    def synced(self) -> list:
        out: list = [t for _, t in self._named()]
        if self.trainer.optimizer is not None:
            out.append(_OptimizerState(self.trainer.optimizer))
        return out

    def snapshot(self, variables: list) -> list:
        return [copy.deepcopy(v.optimizer.state_dict()) if isinstance(v, _OptimizerState)
                else v.detach().clone() for v in variables]

    def restore(self, variables: list, snapshot: list) -> None:
        with torch.no_grad():
            for v, s in zip(variables, snapshot):
                if isinstance(v, _OptimizerState):
                    v.optimizer.load_state_dict(copy.deepcopy(s))
                else:
                    v.copy_(s)

    def arrays(self, snapshot: list) -> List[np.ndarray]:
        return [_state_bytes(s) if isinstance(s, dict) else host_array(check(s)).copy()
                for s in snapshot]

    def load(self, variables: list, arrays: Sequence[np.ndarray]) -> None:
        with torch.no_grad():
            for v, a in zip(variables, arrays):
                if isinstance(v, _OptimizerState):
                    v.write(a)
                else:
                    v.copy_(to_tensor(a, v))

    def describe(self, variables: list) -> list:
        names = {id(t): n for n, t in self._named()}
        return [("optimizer state", (), "state_dict") if isinstance(v, _OptimizerState)
                else (names.get(id(v), "?"), tuple(v.shape), str(v.dtype).replace("torch.", ""))
                for v in variables]

    def lend(self, variables: list, names: List[str]) -> None:
        for name, v in zip(names, variables):
            if isinstance(v, _OptimizerState):  # its size first: the joiner does not know it
                blob = v.read()
                _collective.save(f"{name}/bytes", np.array([blob.size], np.int64))
                _collective.save(name, blob)
            else:
                _collective.save(name, host_array(check(v)))

    def borrow(self, variables: list, names: List[str]) -> None:
        with torch.no_grad():
            for name, v in zip(names, variables):
                if isinstance(v, _OptimizerState):
                    n = _collective.request(0, f"{name}/bytes", like=np.zeros(1, np.int64))
                    v.write(_collective.request(0, name, like=np.empty(int(n[0]), np.uint8)))
                else:
                    v.copy_(to_tensor(_collective.request(0, name, like=host_array(check(v))),
                                      v))

    def unlend(self, names: List[str]) -> None:
        for name in names:
            _collective.drop(name)
            _collective.drop(f"{name}/bytes")


class ElasticTrainer(Loop):
    """Runs policies (kf.BasePolicy) in a PyTorch training loop and makes it elastic: resizes
    (a policy's kf.resize, or `kungfu-run -w`'s requests) and recovery from a lost worker, with
    the model's and the optimizer's state (module doc). `data`: a kf.ElasticData, whose
    epoch_batches() give this worker's part of each step (every sample once per epoch across
    resizes and failures); needed for recovery and kf.set_batch_size. `checkpoint`: a file rank
    0 keeps the last commit in, to resume from (docs/elastic.md); `checkpoint_key`: the key it
    is signed with (default KUNGFU_CHECKPOINT_KEY; a file not signed with it is refused).

    Training starts from rank 0's parameters and buffers everywhere (they are broadcast at
    before_train); a worker joining a running job takes rank 0's model and optimizer state."""

    recoverable = (errors.PeerFailedError, errors.OpTimeoutError)
    face = "kf.ElasticTrainer"

    def __init__(self, model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer],
                 *policies, data=None, name: str = "kungfu/torch", exit_on_detach: bool = True,
                 checkpoint: Optional[str] = None, checkpoint_every: int = 100,
                 cluster_logs: bool = True, checkpoint_key: Union[str, bytes, None] = None):
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"ElasticTrainer takes a torch.nn.Module, got {type(model).__name__}")
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"ElasticTrainer takes a torch.optim.Optimizer (or None), got "
                            f"{type(optimizer).__name__}")
        self.model = model
        super().__init__(*policies, data=data, optimizer=optimizer, name=name,
                         exit_on_detach=exit_on_detach, checkpoint=checkpoint,
                         checkpoint_every=checkpoint_every, cluster_logs=cluster_logs,
                         checkpoint_key=checkpoint_key)
        self.logs: dict = {}  # the last step's and epoch's numbers (cluster ones included)

    # -- what the Loop asks of PyTorch ----------------------------------------------------------

    def _binding(self) -> Variables:
        return TorchVariables(self)

    def _learning_rate(self, bits: int = 64) -> Optional[float]:
        if self.optimizer is None or not self.optimizer.param_groups:
            return None
        lr = self.optimizer.param_groups[0].get("lr")
        if lr is None:
            return None
        lr = float(lr)
        return float(np.float32(lr)) if bits == 32 else lr

    def _set_learning_rate(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def _start_equal(self) -> None:
        if _peer.identity().size > 1:
            broadcast_parameters(list(self.model.named_parameters())
                                 + list(self.model.named_buffers()), name=f"{self._name}/start")

    def _step_logs(self, out) -> dict:
        if isinstance(out, dict):
            return dict(out)
        if isinstance(out, torch.Tensor) and out.numel() == 1:
            return {"loss": out.detach().item()}
        try:
            return {"loss": float(out)}
        except (TypeError, ValueError):
            return {}

    def _step_again(self):
        # Averages of the failed step still pending belong to the lost cluster: forget them.
        forget = getattr(self.optimizer, "_kungfu_forget", None)
        if forget is not None:
            forget()
        return super()._step_again()

    def on_detached(self) -> None:
        super().on_detached()
        self._stopped = True

    # -- a loop ---------------------------------------------------------------------------------

    _stopped = False

    def fit(self, train_step: Callable, epochs: int, on_epoch_end: Optional[Callable] = None
            ) -> "ElasticTrainer":
        """Trains `epochs` epochs (the job's, counted from a joiner's or a resumed checkpoint's
        epoch): train_step(x, y, w) on each of this worker's batches (numpy arrays from
        data.epoch_batches(); w weighs each sample, see ElasticData), made to survive a lost
        peer (guard). It returns the loss (a number or a scalar tensor) or a dict of numbers;
        self.logs holds the last step's, with the cluster's numbers. on_epoch_end(epoch, logs),
        when given, runs on every worker after each epoch. A worker that a shrink leaves out
        stops and, with exit_on_detach, exits with code 0."""
        if self.data is None:
            raise ValueError("ElasticTrainer.fit needs data=kf.ElasticData(...)")
        if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1:
            raise ValueError(f"epochs must be a positive int, got {epochs!r}")
        self.epochs_total = epochs
        step = self.guard(train_step)
        self.before_train()
        while self.state.epoch < epochs and not self._stopped:
            self.before_epoch()
            for x, y, w in self._batches():
                self.before_step()
                logs = self._step_logs(step(x, y, w))
                logs.update(self._cluster.step(self.state))
                self.after_step(logs)
                self.logs = logs
                if self._stopped:
                    break
            if self._stopped:
                break
            logs = {**self.logs, **self._cluster.epoch(self.state)}
            epoch = self.state.epoch
            self.after_epoch(logs)
            if on_epoch_end is not None:
                on_epoch_end(epoch, logs)
        self.after_train()
        self._exit_if_detached()
        return self

    def _batches(self):
        for batch in self.data.epoch_batches():
            if len(batch) == 2:  # (x, w): no labels
                yield batch[0], None, batch[1]
            else:
                yield batch[0], batch[1], batch[-1]
