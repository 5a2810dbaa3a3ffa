// What both device backends (NCCL's and the staging one) do around an operation: wait on the
// device for the caller's stream, make the caller's stream wait for the op, wait on the host for
// an event with a deadline while watching the session's transport for a failed peer. Internal to
// src/backend/gpu.
#pragma once
#include <functional>
#include <mutex>

#include "backend/gpu/loader.h"
#include "kungfu/op.h"
#include "kungfu/status.h"
#include "kungfu/transport.h"

namespace kungfu {

Status CudaStatus(const GpuLibraries& libs, const char* call, cuda_abi::cudaError_t e);

// One reusable event of the backend's: recorded on the caller's stream when an op starts, so the
// op's own stream waits for the caller's inputs (device-side, the host never blocks on it).
// Ops of one backend run one at a time (Peer runs device ops in issue order on one thread).
class CallerStream {
 public:
  explicit CallerStream(const GpuLibraries& libs) : libs_(libs) {}
  ~CallerStream();
  // Records the caller's progress on `caller` (0: the legacy default stream) and returns the
  // event to wait for.
  Status Ready(uint64_t caller, cuda_abi::cudaEvent_t* ready);
  // Makes `caller` wait (on the device) for `done`.
  Status Then(uint64_t caller, cuda_abi::cudaEvent_t done) const;

 private:
  const GpuLibraries& libs_;
  cuda_abi::cudaEvent_t event_ = nullptr;
};

// Polls `done()` until it says the op ended (its status in *st), ctx.deadline passes
// (DeadlineExceeded naming the op) or the transport reports a failed peer: then `abort(why)` is
// called once and polling goes on until done() reports the end it caused.
Status WaitWatching(const OpContext& ctx, const char* what, const Transport& transport,
                    const std::function<bool(Status*)>& done,
                    const std::function<void(const Status&)>& abort);

}  // namespace kungfu
