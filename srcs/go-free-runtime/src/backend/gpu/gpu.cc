#include "kungfu/gpu.h"

#include <atomic>

#include "backend/gpu/nccl_backend.h"

namespace kungfu {

namespace {
std::atomic<const GpuLibraries*> loaded{nullptr};  // the first LoadGpu that succeeded
}  // namespace

Status LoadGpu(const std::vector<std::string>& nccl, const std::vector<std::string>& cudart,
               GpuInfo* info) {
  const GpuLibraries* libs = nullptr;
  KF_RETURN_IF_ERROR(LoadGpuLibraries(GpuLibraryCandidates{nccl, cudart}, &libs));
  loaded = libs;  // the same object on every success (loader.h)
  info->nccl_path = libs->nccl_path;
  info->nccl_version = libs->nccl_version;
  info->cudart_path = libs->cudart_path;
  info->cudart_version = libs->cudart_version;
  int count = 0;
  if (libs->cudart.GetDeviceCount(&count) != cuda_abi::cudaSuccess) count = 0;
  info->device_count = count;
  return Status::OK();
}

const char* GpuPathName(GpuPath path) { return path == GpuPath::kNccl ? "nccl" : "staging"; }

Status MakeGpuBackendFactory(GpuPath path, int device, size_t chunk_bytes, BackendFactory* out) {
  const GpuLibraries* libs = loaded;
  if (libs == nullptr) {
    return InvalidArgument("the GPU libraries are not loaded (LoadGpu first)");
  }
  if (path == GpuPath::kNccl) {
    *out = [libs, device](Transport& transport, Backend& host) -> std::unique_ptr<Backend> {
      return std::make_unique<NcclBackend>(*libs, device, transport, host);
    };
  } else {
    *out = [libs, device, chunk_bytes](Transport&, Backend& host) -> std::unique_ptr<Backend> {
      return std::make_unique<StagingBackend>(*libs, device, chunk_bytes, host);
    };
  }
  return Status::OK();
}

}  // namespace kungfu
