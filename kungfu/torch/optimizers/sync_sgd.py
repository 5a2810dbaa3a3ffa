"""Synchronous SGD: the gradients are averaged over the workers in buckets, each bucket as soon
as backward has made all of its gradients, overlapping the rest of backward (docs/torch.md)."""
from __future__ import annotations

import contextlib
import warnings
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch

from kungfu import _adasum, _collective, _peer
from kungfu._process_set import ProcessSet
from kungfu.torch.ops import Handle, all_gather_async, all_reduce_async
from kungfu.torch.optimizers._wrap import wrap

BUCKET_BYTES = 25 << 20  # as DDP's; measured in benchmarks/README.md, "torch_ddp.py"


class _Bucket:
    """Parameters whose gradients are averaged together, in one allreduce of a flat buffer:
    consecutive in backward order (the reverse of the parameters' order), of one dtype and
    device, up to the bucket size (a larger parameter is a bucket of its own)."""

    def __init__(self, index: int, params: List[Tuple[str, torch.Tensor]]):
        self.name = f"bucket{index}"
        self.params = params
        self.slices: Dict[int, slice] = {}
        at = 0
        for _, p in params:
            self.slices[id(p)] = slice(at, at + p.numel())
            at += p.numel()
        first = params[0][1]
        self.flat = torch.empty(at, dtype=first.dtype, device=first.device)
        self.ready: set = set()  # ids of the parameters whose gradient is in flat
        self.handle: Optional[Handle] = None

    def put(self, p: torch.Tensor, grad: Optional[torch.Tensor], scale: float = 1.0) -> None:
        part = self.flat[self.slices[id(p)]]
        if grad is None:
            part.zero_()
        else:  # a sparse gradient (nn.Embedding(sparse=True)) averaged dense: sparse_as_dense
            part.copy_((grad.to_dense() if grad.is_sparse else grad).detach().reshape(-1))
            if scale != 1:
                part.mul_(scale)
        self.ready.add(id(p))

    def complete(self) -> bool:
        return len(self.ready) == len(self.params)

    def reset(self) -> None:
        self.ready, self.handle = set(), None


def _buckets(params: List[Tuple[str, torch.Tensor]], limit: int) -> List[_Bucket]:
    out: List[_Bucket] = []
    group: List[Tuple[str, torch.Tensor]] = []
    size = 0
    for name, p in reversed(params):  # backward makes the last layers' gradients first
        nbytes = p.numel() * p.element_size()
        if group and (size + nbytes > limit or (p.dtype, p.device) != (group[0][1].dtype,
                                                                        group[0][1].device)):
            out.append(_Bucket(len(out), group))
            group, size = [], 0
        group.append((name, p))
        size += nbytes
    if group:
        out.append(_Bucket(len(out), group))
    return out


class _SynchronousSGD:
    """The mixin in front of the user's optimizer class (see _wrap.py).

    Per step, on every worker:
    1. backward: each parameter's post-accumulate-grad hook counts the passes; at the k-th
       (backward_passes_per_step; torch has summed the k passes' gradients into .grad) it copies
       its .grad into its bucket, divided by k unless the passes are summed (Horovod's default);
       the hook that completes a bucket starts the bucket's asynchronous allreduce, while
       backward goes on;
    2. step(): a parameter whose hook did not fire (not used this step) takes part anyway: its
       .grad as it is, or zeros when it has none, and the buckets not yet started start; one
       allreduce counts, per parameter, the workers that had a gradient;
    3. step() waits for every bucket (each has the op deadline), gives a parameter that some
       worker had a gradient for the average (absent gradients count as zeros), leaves .grad
       None where no worker had one, and calls the wrapped optimizer's step.
    With sparse_as_dense=False, a sparse gradient (nn.Embedding(sparse=True)) takes zeros in its
    bucket and its rows are gathered instead (indices and values, two allgathers started in
    step 1); step 3 gives the parameter the sparse sum of every worker's rows (divided by the
    size for avg), coalesced.
    A name's k-th use is the same operation on every worker, so names need no step counter."""

    def _kungfu_init(self, params: List[Tuple[str, torch.Tensor]], prefix: str, op: str,
                     bucket_bytes: int, process_set: Optional[ProcessSet], passes: int,
                     average_passes: bool, fp16: bool, predivide: float,
                     sparse_as_dense: bool = True):
        self._kungfu_params = [(n, p) for n, p in params if p.requires_grad]
        self._kungfu_prefix = prefix
        self._kungfu_op = op
        self._kungfu_set = process_set
        self._kungfu_fp16 = fp16
        self._kungfu_skip = False
        self._kungfu_synced = False  # synchronize() ran since the last backward pass or step
        self._kungfu_predivide = predivide
        self._kungfu_k = passes
        self._kungfu_scale = 1.0 / passes if average_passes else 1.0
        self._kungfu_passes: Dict[int, int] = {}  # parameter id -> backward passes this step
        self._kungfu_dense = sparse_as_dense
        self._kungfu_index = {id(p): i for i, (_, p) in enumerate(self._kungfu_params)}
        # parameter id -> the allgathers of its sparse gradient's (indices, values) this step
        self._kungfu_rows: Dict[int, Tuple[Handle, Handle]] = {}
        self._kungfu_buckets = _buckets(self._kungfu_params, bucket_bytes)
        self._kungfu_bucket_of = {id(p): b for b in self._kungfu_buckets for _, p in b.params}
        self._kungfu_hooks = [p.register_post_accumulate_grad_hook(self._kungfu_hook(n))
                              for n, p in self._kungfu_params]

    def _kungfu_start(self, b: _Bucket) -> None:
        name, ps, op = f"{self._kungfu_prefix}/{b.name}", self._kungfu_set, self._kungfu_op
        if op == "adasum":
            return  # in synchronize, once every bucket is complete (_kungfu_adasum)
        n = ps.size() if ps is not None else _peer.get().size
        f = self._kungfu_predivide
        fp16 = self._kungfu_fp16 and b.flat.dtype in (torch.float32, torch.float64)
        if not fp16 and (op != "avg" or f == 1):
            b.handle = all_reduce_async(b.flat, op, name, process_set=ps)
            return
        # An average as a sum between two factors: Horovod's gradient_predivide_factor f (1/f
        # before, f/n after), or 1/n before for fp16 (the float16 sum is then the mean's, so it
        # overflows no sooner than the mean does).
        pre, post = 1.0, 1.0
        if op == "avg":
            pre, post = (1.0 / f, f / n) if f != 1 else (1.0 / n, 1.0)
            op = "sum"
        if not fp16:
            b.handle = all_reduce_async(b.flat, op, name, process_set=ps,
                                        prescale_factor=pre, postscale_factor=post)
            return
        half = (b.flat * pre).to(torch.float16)
        inner = all_reduce_async(half, op, name, process_set=ps)
        b.handle = Handle(inner, lambda _: b.flat.copy_(half).mul_(post))

    def _kungfu_hook(self, name: str):
        def hook(p: torch.Tensor) -> None:
            b = self._kungfu_bucket_of[id(p)]
            k = self._kungfu_k
            if id(p) in b.ready:
                raise RuntimeError(
                    f"SynchronousSGDOptimizer: the gradient of {name!r} was made more than "
                    f"backward_passes_per_step={k} times before step()")
            self._kungfu_synced = False
            passes = self._kungfu_passes[id(p)] = self._kungfu_passes.get(id(p), 0) + 1
            if passes < k:
                return  # torch adds the next pass's gradient to .grad
            self._kungfu_put(b, p)
            if b.complete():
                self._kungfu_start(b)
        return hook

    def _kungfu_put(self, b: _Bucket, p: torch.Tensor) -> None:
        grad = p.grad
        if grad is not None and grad.is_sparse and not self._kungfu_dense:
            g = grad.coalesce()
            name = f"{self._kungfu_prefix}/sparse{self._kungfu_index[id(p)]}"
            ps = self._kungfu_set
            self._kungfu_rows[id(p)] = (
                all_gather_async(g.indices().t().contiguous(), f"{name}/indices",
                                 process_set=ps, stack=False),
                all_gather_async(g.values() * self._kungfu_scale, f"{name}/values",
                                 process_set=ps, stack=False))
            grad = None  # its part of the bucket: zeros
        b.put(p, grad, self._kungfu_scale)

    def _kungfu_sparse(self, p: torch.Tensor) -> torch.Tensor:
        """The sparse gradient of p from every worker's rows (step 3)."""
        indices, values = (h.wait() for h in self._kungfu_rows[id(p)])
        if self._kungfu_op == "avg":
            ps = self._kungfu_set
            values = values / (ps.size() if ps is not None else _peer.get().size)
        return torch.sparse_coo_tensor(indices.t(), values, p.shape).coalesce()

    def synchronize(self) -> None:
        """Steps 2 and 3 above without the optimizer's step: every parameter's .grad averaged."""
        absent = set()
        for b in self._kungfu_buckets:
            for _, p in b.params:
                if id(p) not in b.ready:
                    if p.grad is None:
                        absent.add(id(p))
                    self._kungfu_put(b, p)
            if b.handle is None:
                self._kungfu_start(b)
        if self._kungfu_op == "adasum":
            self._kungfu_adasum()
        present = np.array([id(p) not in absent for _, p in self._kungfu_params], np.int32)
        counts = _collective.allreduce_async(present, "sum", f"{self._kungfu_prefix}/present",
                                             process_set=self._kungfu_set)
        buckets = self._kungfu_buckets
        try:
            for b in buckets:
                if b.handle is not None:
                    b.handle.wait()
            counts = counts.wait()
            sparse = {id(p): self._kungfu_sparse(p) for _, p in self._kungfu_params
                      if id(p) in self._kungfu_rows}
        finally:
            self._kungfu_clear()
        with torch.no_grad():
            for (_, p), count in zip(self._kungfu_params, counts.tolist()):
                if count == 0:
                    continue  # no worker had a gradient: it stays None
                if id(p) in sparse:
                    p.grad = sparse[id(p)]
                    continue
                avg = self._kungfu_bucket_of[id(p)].flat[
                    self._kungfu_bucket_of[id(p)].slices[id(p)]].view_as(p)
                if p.grad is None or p.grad.is_sparse:
                    p.grad = avg.clone()
                else:
                    p.grad.copy_(avg)
        self._kungfu_synced = True

    def _kungfu_adasum(self) -> None:
        """op="adasum": each parameter's gradient (zeros where a worker has none) replaced in
        its bucket by the workers' Adasum, per parameter as Horovod's per layer (kf.adasum: a
        tree of pairwise exchanges, float64 arithmetic, host memory)."""
        views = [self._kungfu_bucket_of[id(p)].flat[self._kungfu_bucket_of[id(p)].slices[id(p)]]
                 for _, p in self._kungfu_params]
        host = [v.detach().to("cpu", torch.float64).numpy() for v in views]
        combined = _adasum.adasum(host, name=f"{self._kungfu_prefix}/adasum")
        with torch.no_grad():
            for v, c in zip(views, combined):
                v.copy_(torch.from_numpy(c))

    def _kungfu_forget(self) -> None:
        """After a recovery (kungfu.torch.ElasticTrainer): the averages still pending belong to
        the cluster that lost a worker; they are dropped, not waited for."""
        self._kungfu_clear()

    def _kungfu_clear(self) -> None:
        for b in self._kungfu_buckets:
            b.reset()
        self._kungfu_passes.clear()
        self._kungfu_rows.clear()

    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._kungfu_synced and not self._kungfu_skip:
            # Averaging again would be a second collective for nothing (and, with op="sum",
            # multiply the gradients by the size): the gradients are used as they are.
            warnings.warn("kungfu: optimizer.step() called without optimizer.skip_synchronize() "
                          "after optimizer.synchronize() (Horovod's recipe: `with "
                          "optimizer.skip_synchronize(): optimizer.step()`); the gradients "
                          "already synchronized are used", stacklevel=2)
        elif not self._kungfu_skip:
            self.synchronize()
        self._kungfu_synced = False
        super().step()
        return loss

    @contextlib.contextmanager
    def skip_synchronize(self):
        """step() without synchronize() inside the block, after an explicit synchronize()
        (Horovod's name). For torch.amp.GradScaler: synchronize(), then scaler.unscale_() and
        scaler.step() see the averaged gradients, the same on every worker, so every worker
        skips the same overflowing steps."""
        self._kungfu_skip = True
        try:
            yield
        finally:
            self._kungfu_skip = False

    def zero_grad(self, set_to_none: bool = True) -> None:
        # Buckets still being averaged are waited for (their operations stay paired with the
        # other workers') before the gradients are dropped.
        try:
            for b in self._kungfu_buckets:
                if b.handle is not None:
                    b.handle.wait()
            for handles in self._kungfu_rows.values():
                for h in handles:
                    h.wait()
        finally:
            self._kungfu_clear()
        self._kungfu_synced = False
        super().zero_grad(set_to_none)


def SynchronousSGDOptimizer(optimizer: torch.optim.Optimizer, named_parameters=None,
                            op: Optional[str] = "avg", bucket_bytes: int = BUCKET_BYTES,
                            process_set: Optional[ProcessSet] = None,
                            backward_passes_per_step: int = 1,
                            average_aggregated_gradients: bool = True, compression=None,
                            gradient_predivide_factor: float = 1.0,
                            sparse_as_dense: bool = True):
    """optimizer, its gradients averaged over the workers before each step (op="sum" sums them,
    as the original KungFu did by default), in buckets of up to `bucket_bytes` of gradients
    (default 25 MiB, as DDP's; 0: one parameter per allreduce). named_parameters
    (model.named_parameters()) names the parameters in errors (it must name each of them, each
    name once: a ValueError otherwise, as Horovod's); without it they are named by their place.
    Every worker must wrap the same model in the same order: the workers check that they agree
    and fail at once if not. Use the returned optimizer (it shares the state of
    the one passed in).

    process_set: only its workers wrap and step (averaging over them). backward_passes_per_step
    = k: k backward passes (without zero_grad between them) per step(); the gradient averaged
    over the workers is the mean of the k passes' (average_aggregated_gradients=True, the step
    of a k times larger batch) or their sum (False: Horovod's DistributedOptimizer, whose
    passes add up in .grad). compression="fp16" (or kungfu.torch.Compression.fp16, Horovod's
    name) sends float32/float64 gradients as float16 (half the bytes or less; for avg each
    worker's gradient is divided by the size before the cast); None or "none": as they are.
    gradient_predivide_factor f (Horovod's; op="avg" only): each gradient is divided by f
    before the sum and the sum by size / f after it (the same average, another range for the
    sum; with fp16, the range of the float16 sum). op="adasum" (Horovod's op=hvd.Adasum): each
    parameter's gradient is the workers' Adasum (kf.adasum), any number of workers; not with
    compression, a predivide factor or a process set. sparse_as_dense=True (default): a sparse
    gradient (nn.Embedding(sparse=True)) is averaged as a dense tensor and .grad is left dense;
    False (Horovod's default): every worker's rows are gathered and .grad stays sparse (their
    sum, or avg divided by the size), as an optimizer that takes sparse gradients only
    (torch.optim.SparseAdam) needs."""
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 0:
        raise ValueError(f"bucket_bytes must be an int >= 0, got {bucket_bytes!r}")
    k = backward_passes_per_step
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"backward_passes_per_step must be a positive int, got {k!r}")
    kind = getattr(compression, "name", compression)  # also an object named like Horovod's
    if kind not in (None, "none", "fp16"):
        raise ValueError(f"compression must be None, 'none' or 'fp16', got {compression!r}")
    f = gradient_predivide_factor
    if isinstance(f, bool) or not isinstance(f, (int, float)) or not f > 0:
        raise ValueError(f"gradient_predivide_factor must be a number > 0, got {f!r}")
    if f != 1 and (op or "sum") != "avg":
        raise ValueError(f"gradient_predivide_factor needs op='avg', got op={op!r}")
    op = getattr(op, "name", op)  # also an object named like Horovod's hvd.Adasum
    if op not in (None, "avg", "sum", "min", "max", "prod", "adasum"):
        raise ValueError(f"op must be 'avg', 'sum', 'adasum' (or 'min', 'max', 'prod'), "
                         f"got {op!r}")
    if not isinstance(sparse_as_dense, bool):
        raise ValueError(f"sparse_as_dense must be True or False, got {sparse_as_dense!r}")
    if not sparse_as_dense and op not in (None, "sum", "avg"):
        raise ValueError(f"sparse_as_dense=False gathers sparse rows: op must be 'avg' or "
                         f"'sum', got {op!r}")
    if op == "adasum" and (kind == "fp16" or process_set is not None):
        raise ValueError("op='adasum' combines the gradients as they are, over the whole "
                         "cluster: it takes no compression and no process_set")
    return wrap(_SynchronousSGD, optimizer, named_parameters, "SynchronousSGDOptimizer",
                op=op or "sum", bucket_bytes=bucket_bytes, process_set=process_set, passes=k,
                average_passes=bool(average_aggregated_gradients), fp16=kind == "fp16",
                predivide=float(f), sparse_as_dense=sparse_as_dense)
