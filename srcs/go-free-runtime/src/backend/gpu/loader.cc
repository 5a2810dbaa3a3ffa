#include "backend/gpu/loader.h"

#include <dlfcn.h>
#include <link.h>

#include <mutex>

namespace kungfu {

namespace {

using cuda_abi::CudartApi;
using cuda_abi::NcclApi;

// One entry point: its exported name and where its address goes.
struct Symbol {
  const char* name;
  void** slot;
};

// Function pointers are stored through void** (dlsym's type); POSIX guarantees that round trip.
template <typename Fn>
Symbol Sym(const char* name, Fn* slot) {
  static_assert(sizeof(Fn) == sizeof(void*), "a function pointer must fit dlsym's void*");
  return Symbol{name, reinterpret_cast<void**>(slot)};
}

std::vector<Symbol> NcclSymbols(NcclApi* api) {
  return {Sym("ncclGetVersion", &api->GetVersion),
          Sym("ncclGetUniqueId", &api->GetUniqueId),
          Sym("ncclCommInitRank", &api->CommInitRank),
          Sym("ncclCommDestroy", &api->CommDestroy),
          Sym("ncclCommAbort", &api->CommAbort),
          Sym("ncclCommGetAsyncError", &api->CommGetAsyncError),
          Sym("ncclGetErrorString", &api->GetErrorString),
          Sym("ncclAllReduce", &api->AllReduce),
          Sym("ncclBroadcast", &api->Broadcast),
          Sym("ncclReduce", &api->Reduce),
          Sym("ncclAllGather", &api->AllGather),
          Sym("ncclReduceScatter", &api->ReduceScatter),
          Sym("ncclSend", &api->Send),
          Sym("ncclRecv", &api->Recv),
          Sym("ncclGroupStart", &api->GroupStart),
          Sym("ncclGroupEnd", &api->GroupEnd)};
}

std::vector<Symbol> CudartSymbols(CudartApi* api) {
  return {Sym("cudaRuntimeGetVersion", &api->RuntimeGetVersion),
          Sym("cudaGetDeviceCount", &api->GetDeviceCount),
          Sym("cudaGetDevice", &api->GetDevice),
          Sym("cudaSetDevice", &api->SetDevice),
          Sym("cudaStreamCreateWithFlags", &api->StreamCreateWithFlags),
          Sym("cudaStreamDestroy", &api->StreamDestroy),
          Sym("cudaStreamSynchronize", &api->StreamSynchronize),
          Sym("cudaStreamWaitEvent", &api->StreamWaitEvent),
          Sym("cudaEventCreateWithFlags", &api->EventCreateWithFlags),
          Sym("cudaEventRecord", &api->EventRecord),
          Sym("cudaEventQuery", &api->EventQuery),
          Sym("cudaEventSynchronize", &api->EventSynchronize),
          Sym("cudaEventDestroy", &api->EventDestroy),
          Sym("cudaMalloc", &api->Malloc),
          Sym("cudaFree", &api->Free),
          Sym("cudaHostAlloc", &api->HostAlloc),
          Sym("cudaFreeHost", &api->FreeHost),
          Sym("cudaMemcpyAsync", &api->MemcpyAsync),
          Sym("cudaGetErrorString", &api->GetErrorString)};
}

// The file the dynamic linker opened for `handle` (a soname resolves to a full path); `fallback`
// if it cannot tell.
std::string LoadedPath(void* handle, const std::string& fallback) {
  struct link_map* map = nullptr;
  if (dlinfo(handle, RTLD_DI_LINKMAP, &map) == 0 && map != nullptr && map->l_name != nullptr &&
      map->l_name[0] != '\0') {
    return map->l_name;
  }
  return fallback;
}

// Opens the first candidate that has every symbol; fills the slots and `*path`. On failure,
// `*why` lists each candidate with its reason ("path: reason; ...").
bool OpenFirst(const std::vector<std::string>& candidates, const std::vector<Symbol>& symbols,
               std::string* path, std::string* why) {
  for (const std::string& candidate : candidates) {
    if (!why->empty()) *why += "; ";
    dlerror();  // clear a stale error, so the text below is this call's
    void* handle = dlopen(candidate.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (handle == nullptr) {
      const char* err = dlerror();
      *why += candidate + ": " + (err ? err : "dlopen failed");
      continue;
    }
    const char* missing = nullptr;
    for (const Symbol& s : symbols) {
      *s.slot = dlsym(handle, s.name);
      if (*s.slot == nullptr) {
        missing = s.name;
        break;
      }
    }
    if (missing != nullptr) {
      *why += candidate + ": has no symbol " + missing;
      dlclose(handle);  // nothing of it was called, so closing is safe
      continue;
    }
    *path = LoadedPath(handle, candidate);
    return true;  // kept open for the life of the process (see loader.h)
  }
  if (candidates.empty()) *why = "no candidate paths given";
  return false;
}

}  // namespace

bool GpuLibraries::HasAvgAndBfloat16() const {
  return nccl_version_code >= cuda_abi::NcclVersionCode(2, 10, 0);
}

std::string GpuLibraries::Describe() const {
  return "NCCL " + nccl_version + " (" + nccl_path + "), CUDA runtime " +
         std::to_string(cudart_version) + " (" + cudart_path + ")";
}

std::string NcclVersionString(int code) {
  int major, minor, patch;
  if (code >= 10000) {  // 2.9 and later: major*10000 + minor*100 + patch
    major = code / 10000;
    minor = (code % 10000) / 100;
  } else {  // up to 2.8: major*1000 + minor*100 + patch
    major = code / 1000;
    minor = (code % 1000) / 100;
  }
  patch = code % 100;
  return std::to_string(major) + "." + std::to_string(minor) + "." + std::to_string(patch);
}

Status OpenGpuLibraries(const GpuLibraryCandidates& candidates,
                        std::unique_ptr<GpuLibraries>* out) {
  auto libs = std::make_unique<GpuLibraries>();
  std::string why;
  if (!OpenFirst(candidates.nccl, NcclSymbols(&libs->nccl), &libs->nccl_path, &why)) {
    return NotFound("NCCL not found: tried " + why);
  }
  why.clear();
  if (!OpenFirst(candidates.cudart, CudartSymbols(&libs->cudart), &libs->cudart_path, &why)) {
    return NotFound("the CUDA runtime not found: tried " + why);
  }
  int code = 0;
  cuda_abi::ncclResult_t r = libs->nccl.GetVersion(&code);
  if (r != cuda_abi::ncclSuccess) {
    return Internal("ncclGetVersion of " + libs->nccl_path +
                    " failed: " + libs->nccl.GetErrorString(r));
  }
  libs->nccl_version_code = code;
  libs->nccl_version = NcclVersionString(code);
  int cudart_version = 0;
  if (libs->cudart.RuntimeGetVersion(&cudart_version) != cuda_abi::cudaSuccess) {
    return Internal("cudaRuntimeGetVersion of " + libs->cudart_path + " failed");
  }
  libs->cudart_version = cudart_version;
  *out = std::move(libs);
  return Status::OK();
}

Status LoadGpuLibraries(const GpuLibraryCandidates& candidates, const GpuLibraries** out) {
  // Held across the dlopen calls: two threads loading at once would otherwise both open and one
  // copy would leak. Nothing else takes this lock.
  static std::mutex mu;
  static GpuLibraries* loaded = nullptr;  // set once, never freed (see loader.h, Lifetime)
  std::lock_guard<std::mutex> lk(mu);
  if (loaded == nullptr) {
    std::unique_ptr<GpuLibraries> libs;
    KF_RETURN_IF_ERROR(OpenGpuLibraries(candidates, &libs));
    loaded = libs.release();
  }
  *out = loaded;
  return Status::OK();
}

}  // namespace kungfu
