#include <algorithm>
#include <string>
#include <thread>

#include "backend/gpu/nccl_backend.h"

namespace kungfu {

namespace {
using cuda_abi::cudaSuccess;
}  // namespace

StagingBackend::StagingBackend(const GpuLibraries& libs, int device, size_t chunk_bytes,
                               Backend& host)
    : libs_(libs),
      device_(device),
      chunk_bytes_(std::max<size_t>(chunk_bytes, 4096)),
      host_(host),
      caller_(libs) {}

StagingBackend::~StagingBackend() {
  if (stream_ != nullptr) libs_.cudart.StreamSynchronize(stream_);
  for (auto* e : {down_[0], down_[1], done_}) {
    if (e != nullptr) libs_.cudart.EventDestroy(e);
  }
  for (char* p : pinned_) {
    if (p != nullptr) libs_.cudart.FreeHost(p);
  }
  if (stream_ != nullptr) libs_.cudart.StreamDestroy(stream_);
}

Status StagingBackend::Setup(const OpContext& ctx) {
  const auto& cu = libs_.cudart;
  auto check = [&](const char* call, cuda_abi::cudaError_t e) {
    return e == cudaSuccess ? Status::OK() : CudaStatus(libs_, call, e);
  };
  KF_RETURN_IF_ERROR(check("cudaSetDevice", cu.SetDevice(device_)));
  if (stream_ != nullptr) return Status::OK();
  for (int i = 0; i < 2; ++i) {
    void* p = nullptr;
    KF_RETURN_IF_ERROR(
        check("cudaHostAlloc", cu.HostAlloc(&p, chunk_bytes_, cuda_abi::cudaHostAllocDefault)));
    pinned_[i] = static_cast<char*>(p);
    KF_RETURN_IF_ERROR(check("cudaEventCreateWithFlags",
                             cu.EventCreateWithFlags(&down_[i], cuda_abi::cudaEventDisableTiming)));
  }
  KF_RETURN_IF_ERROR(check("cudaEventCreateWithFlags",
                           cu.EventCreateWithFlags(&done_, cuda_abi::cudaEventDisableTiming)));
  return check("cudaStreamCreateWithFlags",
               cu.StreamCreateWithFlags(&stream_, cuda_abi::cudaStreamNonBlocking));
}

// A copy's event ends within the time of the copy: no peer is involved, so only the deadline.
Status StagingBackend::WaitEvent(const OpContext& ctx, cuda_abi::cudaEvent_t event) const {
  for (;;) {
    const auto q = libs_.cudart.EventQuery(event);
    if (q == cudaSuccess) return Status::OK();
    if (q != cuda_abi::cudaErrorNotReady) return CudaStatus(libs_, "cudaEventQuery", q);
    if (Clock::now() >= ctx.deadline) {
      return DeadlineExceeded("a staging copy of " + ctx.name + " ran past its deadline");
    }
    std::this_thread::yield();
  }
}

// The pipeline (kungfu/gpu.h): on the backend's stream, in this order, down(0), down(1), up(0),
// down(2), up(1), ...; chunk k uses pinned buffer k mod 2, which down(k) refills only after
// up(k - 2) emptied it (stream order). The host reduces chunk k while chunk k + 1 comes down
// and chunk k - 1 goes up. In place is safe: down(k + 1) reads past what up(k) writes.
Status StagingBackend::Stage(const OpContext& ctx, const void* send, void* recv, size_t bytes,
                             size_t esize, const HostOp& host_op) {
  if (bytes == 0) return Status::OK();
  KF_RETURN_IF_ERROR(Setup(ctx));
  const auto& cu = libs_.cudart;
  const size_t chunk = std::max(esize, chunk_bytes_ / esize * esize);
  const size_t n = (bytes + chunk - 1) / chunk;
  const auto* from = static_cast<const char*>(send);
  auto* to = static_cast<char*>(recv);
  auto len = [&](size_t k) { return std::min(chunk, bytes - k * chunk); };
  auto down = [&](size_t k) -> Status {
    auto e = cu.MemcpyAsync(pinned_[k % 2], from + k * chunk, len(k),
                            cuda_abi::cudaMemcpyDeviceToHost, stream_);
    if (e == cudaSuccess) e = cu.EventRecord(down_[k % 2], stream_);
    return e == cudaSuccess ? Status::OK() : CudaStatus(libs_, "staging a chunk down", e);
  };
  cuda_abi::cudaEvent_t ready = nullptr;
  KF_RETURN_IF_ERROR(caller_.Ready(ctx.device_stream, &ready));
  auto e = cu.StreamWaitEvent(stream_, ready, 0);
  if (e != cudaSuccess) return CudaStatus(libs_, "cudaStreamWaitEvent", e);
  KF_RETURN_IF_ERROR(down(0));
  Status st;
  for (size_t k = 0; k < n && st.ok(); ++k) {
    if (k + 1 < n) st = down(k + 1);
    if (st.ok()) st = WaitEvent(ctx, down_[k % 2]);
    if (st.ok()) st = host_op(k, pinned_[k % 2], len(k));
    if (!st.ok()) break;
    e = cu.MemcpyAsync(to + k * chunk, pinned_[k % 2], len(k), cuda_abi::cudaMemcpyHostToDevice,
                       stream_);
    if (e != cudaSuccess) st = CudaStatus(libs_, "staging a chunk up", e);
  }
  // Whatever was queued must end before the buffers go back to the caller.
  e = cu.EventRecord(done_, stream_);
  Status ended = e == cudaSuccess ? WaitEvent(ctx, done_) : CudaStatus(libs_, "cudaEventRecord", e);
  if (st.ok()) st = ended;
  if (st.ok()) st = caller_.Then(ctx.device_stream, done_);
  return st;
}

Status StagingBackend::AllReduce(const OpContext& ctx, const std::vector<Piece>& pieces,
                                 DType dtype, ReduceOp op, const Strategy& strategy,
                                 const Spawner& spawn, size_t) {
  const size_t es = DTypeSize(dtype);
  for (size_t i = 0; i < pieces.size(); ++i) {
    const Piece& x = pieces[i];
    KF_RETURN_IF_ERROR(
        Stage(ctx, x.send, x.recv, x.count * es, es, [&](size_t k, char* b, size_t n) {
          OpContext sub = ctx;
          sub.name =
              SubOpName(ctx.name, ("stage " + std::to_string(i) + "/" + std::to_string(k)).c_str());
          sub.memory = Memory::kHost;
          return host_.AllReduce(sub, {Piece{b, b, n / es}}, dtype, op, strategy, spawn, 0);
        }));
  }
  return Status::OK();
}

Status StagingBackend::Broadcast(const OpContext& ctx, const void* send, void* recv, size_t count,
                                 DType dtype, int root, const Strategy& strategy) {
  const size_t es = DTypeSize(dtype);
  return Stage(ctx, send, recv, count * es, es, [&](size_t k, char* b, size_t n) {
    OpContext sub = ctx;
    sub.name = SubOpName(ctx.name, ("stage " + std::to_string(k)).c_str());
    sub.memory = Memory::kHost;
    return host_.Broadcast(sub, b, b, n / es, dtype, root, strategy);
  });
}

}  // namespace kungfu
