"""GPUs: where NCCL and the CUDA runtime are found, and which path device tensors take.

The runtime loads both libraries at run time (srcs/go-free-runtime/include/kungfu/gpu.h), so one
build of kungfu serves CPU and GPU machines. Where to look, in order: KUNGFU_NCCL_LIBRARY and
KUNGFU_CUDART_LIBRARY; the lib folders of the nvidia-* pip packages that CUDA builds of PyTorch
install (nvidia/nccl/lib, nvidia/cuda_runtime/lib); then the system's sonames. The process keeps
the first that load.
"""
from __future__ import annotations

import glob
import os
import sys
from dataclasses import dataclass
from typing import List, Optional, Tuple

from kungfu import _env, _native

_SONAMES_NCCL = ["libnccl.so.2", "libnccl.so"]
_SONAMES_CUDART = ["libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0", "libcudart.so"]


@dataclass(frozen=True)
class GpuStatus:
    """What loading found: `available` with where and which versions, or `why` not."""
    available: bool
    why: str = ""
    nccl_path: str = ""
    nccl_version: str = ""
    cudart_path: str = ""
    cudart_version: int = 0
    device_count: int = 0


def candidates(environ: Optional[dict] = None,
               search_path: Optional[List[str]] = None) -> Tuple[List[str], List[str]]:
    """The paths and sonames tried for NCCL and for the CUDA runtime, most preferred first."""
    nccl: List[str] = []
    cudart: List[str] = []
    explicit_nccl = _env.NCCL_LIBRARY.get(environ)
    explicit_cudart = _env.CUDART_LIBRARY.get(environ)
    if explicit_nccl:
        nccl.append(explicit_nccl)
    if explicit_cudart:
        cudart.append(explicit_cudart)
    for base in sys.path if search_path is None else search_path:
        root = os.path.join(base or ".", "nvidia")
        if not os.path.isdir(root):
            continue
        nccl += sorted(glob.glob(os.path.join(root, "nccl", "lib", "libnccl.so*")))
        for folder in ("cuda_runtime", "cu13", "cu12"):
            cudart += sorted(glob.glob(os.path.join(root, folder, "lib", "libcudart.so*")),
                             reverse=True)
    return nccl + _SONAMES_NCCL, cudart + _SONAMES_CUDART


_status: Optional[GpuStatus] = None


def status() -> GpuStatus:
    """Loads the libraries once (KUNGFU_GPU=off: never) and says what was found or why not."""
    global _status
    if _status is None:
        if _env.GPU.get() == "off":
            _status = GpuStatus(False, "KUNGFU_GPU=off")
        else:
            nccl, cudart = candidates()
            code, message, info = _native.lib().load_gpu(nccl, cudart)
            _status = GpuStatus(True, **info) if code == 0 else GpuStatus(False, message)
    return _status


def nccl_available() -> bool:
    """Whether NCCL and the CUDA runtime were found (and loaded) in this process."""
    return status().available


def show_nccl_version() -> str:
    """One line: NCCL's version and where it came from, or why there is none."""
    s = status()
    if not s.available:
        return f"NCCL: not available ({s.why})"
    return (f"NCCL {s.nccl_version} ({s.nccl_path}), CUDA runtime {s.cudart_version} "
            f"({s.cudart_path}), {s.device_count} device(s)")


def backend_for(self_spec: str, peers: List[str]) -> Tuple[str, int]:
    """(path, device) of this worker's GPU backend: path "nccl", "staging" or "" (none), and
    the CUDA device it uses: with one visible device (kungfu-run's per-rank CUDA_VISIBLE_DEVICES)
    device 0, else the worker's local rank modulo the devices."""
    wanted = _env.GPU.get()
    if wanted == "off" or not nccl_available():
        return "", 0
    host = self_spec.rsplit(":", 1)[0]
    local = [p for p in peers if p.rsplit(":", 1)[0] == host] or [self_spec]
    local_rank = local.index(self_spec) if self_spec in local else 0
    count = max(status().device_count, 1)
    if wanted == "auto":
        wanted = "nccl" if count >= len(local) else "staging"  # NCCL refuses a shared GPU
    return wanted, local_rank % count
