#include "backend/gpu/device_ops.h"

#include <algorithm>
#include <chrono>
#include <string>
#include <thread>

namespace kungfu {

namespace {
// After an abort, how long the wait goes on for the op to report the end the abort caused (its
// kernels stop; an aborted communicator ends them at once). Past it the abort's status is
// returned anyway.
constexpr auto kAfterAbort = std::chrono::seconds(5);
constexpr auto kMaxNap = std::chrono::microseconds(1000);
}  // namespace

Status CudaStatus(const GpuLibraries& libs, const char* call, cuda_abi::cudaError_t e) {
  return Internal(std::string(call) + " failed: CUDA error " + std::to_string(e) + " (" +
                  libs.cudart.GetErrorString(e) + ")");
}

CallerStream::~CallerStream() {
  if (event_ != nullptr) libs_.cudart.EventDestroy(event_);
}

Status CallerStream::Ready(uint64_t caller, cuda_abi::cudaEvent_t* ready) {
  if (event_ == nullptr) {
    const auto e = libs_.cudart.EventCreateWithFlags(&event_, cuda_abi::cudaEventDisableTiming);
    if (e != cuda_abi::cudaSuccess) {
      event_ = nullptr;
      return CudaStatus(libs_, "cudaEventCreateWithFlags", e);
    }
  }
  const auto e = libs_.cudart.EventRecord(event_, reinterpret_cast<cuda_abi::cudaStream_t>(caller));
  if (e != cuda_abi::cudaSuccess) return CudaStatus(libs_, "cudaEventRecord", e);
  *ready = event_;
  return Status::OK();
}

Status CallerStream::Then(uint64_t caller, cuda_abi::cudaEvent_t done) const {
  const auto e =
      libs_.cudart.StreamWaitEvent(reinterpret_cast<cuda_abi::cudaStream_t>(caller), done, 0);
  return e == cuda_abi::cudaSuccess ? Status::OK() : CudaStatus(libs_, "cudaStreamWaitEvent", e);
}

Status WaitWatching(const OpContext& ctx, const char* what, const Transport& transport,
                    const std::function<bool(Status*)>& done,
                    const std::function<void(const Status&)>& abort) {
  Status st, aborted;
  TimePoint give_up = TimePoint::max();
  auto nap = std::chrono::microseconds(20);
  while (!done(&st)) {
    const TimePoint now = Clock::now();
    if (aborted.ok()) {
      Status peer = transport.failure();
      if (!peer.ok()) {
        aborted = peer;
      } else if (now >= ctx.deadline) {
        aborted = DeadlineExceeded(std::string(what) + " ran past its deadline on the device");
      }
      if (!aborted.ok()) {
        abort(aborted);
        give_up = now + kAfterAbort;
      }
    } else if (now >= give_up) {
      return aborted;
    }
    std::this_thread::sleep_for(nap);
    nap = std::min<std::chrono::microseconds>(nap * 2, kMaxNap);
  }
  if (!aborted.ok() && !st.ok()) return aborted;  // the cause, not the abort it caused
  return st;
}

}  // namespace kungfu
