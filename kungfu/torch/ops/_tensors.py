"""Torch tensors as numpy arrays for the core's collectives, and back (docs/torch.md).

A contiguous CPU tensor is viewed, not copied: `Tensor.numpy()` shares its memory, so an
in-place collective writes straight into the tensor. Anything else (non-contiguous, on a GPU) is
staged: copied to a contiguous host tensor first and the result copied back. bfloat16, which
numpy lacks, travels as ml_dtypes.bfloat16 (the runtime reduces it in float32 per step)."""
from __future__ import annotations

import numpy as np
import torch

from kungfu.errors import InvalidArgumentError

# The dtypes the runtime reduces (kungfu._native's dtype table), by their torch names.
_SUPPORTED = {
    torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.float16,
    torch.float32, torch.float64, torch.bool, torch.bfloat16,
} | {getattr(torch, n) for n in ("uint16", "uint32", "uint64") if hasattr(torch, n)}


def _bfloat16():
    try:
        import ml_dtypes
    except ImportError:
        raise InvalidArgumentError(
            "bfloat16 tensors need the ml_dtypes package (pip install ml_dtypes): numpy has no "
            "bfloat16 of its own") from None
    return ml_dtypes.bfloat16


def check(t) -> torch.Tensor:
    """t detached from autograd (sharing its memory), or InvalidArgumentError."""
    if not isinstance(t, torch.Tensor):
        raise InvalidArgumentError(f"expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in _SUPPORTED:
        names = ", ".join(sorted(str(d).replace("torch.", "") for d in _SUPPORTED))
        raise InvalidArgumentError(f"dtype {t.dtype} is not supported (supported: {names})")
    if t.layout != torch.strided:
        raise InvalidArgumentError(f"only dense tensors are supported, got layout {t.layout}")
    return t.detach()


def is_view(t: torch.Tensor) -> bool:
    """Whether host_array(t) shares t's memory (a collective may write into t directly)."""
    return (t.device.type == "cpu" and t.is_contiguous() and not t.is_conj()
            and not t.is_neg())


def host_array(t: torch.Tensor) -> np.ndarray:
    """A C-contiguous numpy array with t's values: a view of t where is_view(t), else a copy."""
    if not is_view(t):
        t = t.to("cpu").contiguous().resolve_conj().resolve_neg()
        if t.data_ptr() == 0 and t.numel():  # pragma: no cover - a copy always has storage
            raise InvalidArgumentError("tensor has no storage")
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(_bfloat16())
    return t.numpy()


def to_tensor(a: np.ndarray, like: torch.Tensor) -> torch.Tensor:
    """a as a tensor of like's dtype on like's device (sharing a's memory on the CPU)."""
    if like.dtype == torch.bfloat16:
        out = torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).view(torch.bfloat16)
    else:
        out = torch.from_numpy(np.ascontiguousarray(a))
    return out if like.device.type == "cpu" else out.to(like.device)


def numpy_dtype(t: torch.Tensor) -> np.dtype:
    """The numpy dtype of t's elements (ml_dtypes.bfloat16 for bfloat16)."""
    if t.dtype == torch.bfloat16:
        return np.dtype(_bfloat16())
    return np.dtype(torch.empty((), dtype=t.dtype).numpy().dtype)
