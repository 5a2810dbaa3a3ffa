// Loading NCCL and the CUDA runtime at run time.
//
// The runtime reads no environment: the caller hands the candidate paths, in order of preference
// (Python builds them from KUNGFU_NCCL_LIBRARY / KUNGFU_CUDART_LIBRARY, the lib folders of the
// nvidia-* pip packages, then plain sonames such as "libnccl.so.2" and "libcudart.so.12", which
// dlopen looks up in the usual places). Each candidate is opened with RTLD_NOW | RTLD_LOCAL, so a
// library whose own dependencies are missing fails here rather than at its first call, and its
// symbols do not leak into the process's global scope (a framework may carry another NCCL).
//
// A candidate is taken when it opens and has every entry point of cuda_api.h; otherwise the next
// one is tried. When none is taken, the error lists every candidate with why it was refused
// (dlerror's text, or the first missing symbol).
//
// Lifetime: libraries that were taken are never closed (NCCL and the CUDA runtime start threads
// and register atexit handlers; unloading them under those is unsafe), so the tables of entry
// points stay valid until the process exits.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "backend/gpu/cuda_api.h"
#include "kungfu/status.h"

namespace kungfu {

struct GpuLibraryCandidates {
  std::vector<std::string> nccl;    // paths or sonames of libnccl, most preferred first
  std::vector<std::string> cudart;  // paths or sonames of libcudart, most preferred first
};

// NCCL and the CUDA runtime, loaded. Immutable once made, so any thread may read it.
struct GpuLibraries {
  cuda_abi::NcclApi nccl;
  cuda_abi::CudartApi cudart;
  std::string nccl_path;      // where NCCL was found: the file dlopen opened
  std::string cudart_path;    // where the CUDA runtime was found
  int nccl_version_code = 0;  // as ncclGetVersion reports it, e.g. 22105
  std::string nccl_version;   // "2.21.5"
  int cudart_version = 0;     // as cudaRuntimeGetVersion reports it, e.g. 12040

  // Whether the loaded NCCL has ncclAvg and ncclBfloat16 (2.10 and later).
  bool HasAvgAndBfloat16() const;
  // "NCCL 2.21.5 (/path/libnccl.so.2), CUDA runtime 12040 (/path/libcudart.so.12)".
  std::string Describe() const;
};

// Decodes ncclGetVersion's code (both encodings; see NcclVersionCode) into "major.minor.patch".
std::string NcclVersionString(int code);

// Opens the libraries afresh from `candidates`, without touching the process-wide copy. NotFound
// when no candidate of either library is usable, naming each candidate tried and why.
Status OpenGpuLibraries(const GpuLibraryCandidates& candidates, std::unique_ptr<GpuLibraries>* out);

// The process-wide copy: the first call that succeeds loads the libraries and keeps them; every
// later call returns the same object, whatever its candidates (one process can use one NCCL).
// A failed call keeps nothing, so a later call may try other candidates. Thread-safe.
Status LoadGpuLibraries(const GpuLibraryCandidates& candidates, const GpuLibraries** out);

}  // namespace kungfu
