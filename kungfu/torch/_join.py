"""kungfu.torch.Join: the core's Join (kungfu/_join.py) under PyTorch's signature,
`Join(joinables, enable=True)`, and like PyTorch's Join with DistributedDataParallel it makes the
workers equal again when the block ends: the modules among `joinables` take the parameters and
buffers of the rank that joined last (the one whose model took every step), the optimizers its
state. Horovod's join leaves that to the script."""
from __future__ import annotations

from typing import Iterable, Optional

import torch

from kungfu import _join
from kungfu.torch.ops.collective import broadcast_optimizer_state, broadcast_parameters


class Join(_join.Join):
    """`with Join([model, optimizer]):` around a loop whose workers run different numbers of
    steps (see the core's Join). On a normal exit, every module of `joinables` takes the last
    joined rank's state_dict() and every optimizer its state. `timeout`: the deadline of each
    round (None: KUNGFU_OP_TIMEOUT); `enable=False`: the block does nothing."""

    def __init__(self, joinables: Iterable = (), enable: bool = True,
                 throw_on_early_termination: bool = False, timeout: Optional[float] = None):
        if throw_on_early_termination:
            raise ValueError(
                "Join(throw_on_early_termination=True) is not supported: in kungfu's Join the "
                "workers that still have data go on, the joined ones contributing nothing")
        self.joinables = list(joinables)
        for j in self.joinables:
            if not isinstance(j, (torch.nn.Module, torch.optim.Optimizer)):
                raise TypeError(f"Join's joinables are modules and optimizers, got "
                                f"{type(j).__name__}")
        super().__init__(timeout=timeout, enable=enable)

    def __exit__(self, kind, value, tb) -> None:
        super().__exit__(kind, value, tb)
        if kind is not None or not self.enable:
            return
        for i, j in enumerate(self.joinables):
            name = f"kungfu.torch.Join/{i}"
            if isinstance(j, torch.nn.Module):
                broadcast_parameters(j.state_dict(), root=self.last_joined, name=name,
                                     timeout=self.timeout)
            else:
                broadcast_optimizer_state(j, root=self.last_joined, name=name,
                                          timeout=self.timeout)
