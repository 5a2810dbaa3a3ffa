// GPU support as the bindings see it: NCCL and the CUDA runtime loaded at run time (no CUDA
// header or library is needed to build kungfu), and the backends that serve device memory.
//
// Two paths for device buffers (docs/torch.md, "GPUs"):
//  - NCCL: one communicator per session (a cluster version or a process set): at the session's
//    first device operation rank 0 makes a unique id and broadcasts it over the session's host
//    backend, every rank joins. A failed communicator stays failed; the next session (a resize,
//    a recovery) makes the next one. While an op waits, a peer's failure seen by the transport, or
//    the op's deadline, aborts the communicator, so no rank stays in a kernel.
//    A session across hosts allreduces hierarchically (backend/gpu/nccl_hierarchical.cc): NCCL
//    inside each host (a second communicator, of the host's ranks), the TCP ring across hosts on
//    each rank's share from pinned host memory, NCCL again inside.
//  - Staging, where NCCL cannot serve (none found, or ranks that share a GPU, which NCCL refuses):
//    chunks copied down into pinned host buffers on a stream of the backend's own, reduced by the
//    host backend (the TCP algorithms), copied back; the copies of the next and the previous
//    chunk overlap the reduction of this one.
// Both wait, on the device, for the work the caller queued on its stream before the op
// (OpOptions::device_stream), and make that stream wait for the op's result.
#pragma once
#include <string>
#include <vector>

#include "kungfu/backend.h"
#include "kungfu/status.h"

namespace kungfu {

struct GpuInfo {
  std::string nccl_path;     // the file NCCL was loaded from
  std::string nccl_version;  // "2.21.5"
  std::string cudart_path;   // the file the CUDA runtime was loaded from
  int cudart_version = 0;    // as cudaRuntimeGetVersion reports it, e.g. 12040
  int device_count = 0;      // CUDA devices this process sees
};

// Loads the libraries from the candidates (paths or sonames, most preferred first). The process
// keeps the first that load; later calls report those. NotFound names every candidate and why.
Status LoadGpu(const std::vector<std::string>& nccl, const std::vector<std::string>& cudart,
               GpuInfo* info);

enum class GpuPath { kNccl, kStaging };
const char* GpuPathName(GpuPath path);

// A factory of the backend that serves device memory on CUDA device `device` by `path`;
// staging moves chunks of at most chunk_bytes. LoadGpu must have succeeded (else
// FailedPrecondition-like InvalidArgument).
Status MakeGpuBackendFactory(GpuPath path, int device, size_t chunk_bytes, BackendFactory* out);

}  // namespace kungfu
