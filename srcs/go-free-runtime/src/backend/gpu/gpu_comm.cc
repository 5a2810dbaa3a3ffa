#include "backend/gpu/gpu_comm.h"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <limits>
#include <mutex>

namespace kungfu {

using cuda_abi::cudaError_t;
using cuda_abi::cudaEvent_t;
using cuda_abi::CudartApi;
using cuda_abi::cudaStream_t;
using cuda_abi::ncclComm_t;
using cuda_abi::ncclDataType_t;
using cuda_abi::ncclRedOp_t;
using cuda_abi::ncclResult_t;

// Shared by a GpuComm and its GpuWorks (see gpu_comm.h, Lifetimes).
struct GpuCommState {
  GpuCommState(const GpuLibraries& l, int r, int n, int d) : libs(l), rank(r), size(n), device(d) {}
  ~GpuCommState();

  // Records `why` as the failure (the first one stays), aborts the NCCL communicator and wakes
  // every waiter. mu held.
  void AbortLocked(const Status& why);

  const GpuLibraries& libs;
  const int rank;
  const int size;
  const int device;
  cudaStream_t stream = nullptr;  // owned; set once by Create, destroyed with the state

  std::mutex mu;
  std::condition_variable cv;  // signalled when failure is set
  ncclComm_t comm = nullptr;   // guarded by mu; null exactly when failure is not OK
  Status failure;              // guarded by mu
  bool closed_idle = false;    // guarded by mu: destroyed after every op had completed
  uint64_t next_seq = 0;       // guarded by mu
};

namespace {

using Clock = std::chrono::steady_clock;

// Makes `device` current for the scope, and restores the caller's device after.
class DeviceGuard {
 public:
  DeviceGuard(const CudartApi& cu, int device) : cu_(cu) {
    if (cu_.GetDevice(&previous_) != cuda_abi::cudaSuccess) previous_ = -1;
    if (previous_ != device) {
      result_ = cu_.SetDevice(device);
      changed_ = result_ == cuda_abi::cudaSuccess;
    }
  }
  ~DeviceGuard() {
    if (changed_ && previous_ >= 0) cu_.SetDevice(previous_);
  }
  cudaError_t result() const { return result_; }

 private:
  const CudartApi& cu_;
  int previous_ = -1;
  bool changed_ = false;
  cudaError_t result_ = cuda_abi::cudaSuccess;
};

Status CudaError(const GpuLibraries& libs, const char* call, cudaError_t e) {
  return Internal(std::string(call) + " failed: CUDA error " + std::to_string(e) + " (" +
                  libs.cudart.GetErrorString(e) + ")");
}

// An NCCL error as kungfu's Status: invalid arguments and usage (ranks that disagree on an op)
// are InvalidArgument; everything else means a peer or the device is gone: Unavailable.
Status NcclError(const GpuLibraries& libs, const std::string& what, ncclResult_t r) {
  std::string message =
      what + ": NCCL error " + std::to_string(r) + " (" + libs.nccl.GetErrorString(r) + ")";
  if (r == cuda_abi::ncclInvalidUsage) {
    return InvalidArgument(message + "; the ranks may disagree on the operation");
  }
  if (r == cuda_abi::ncclInvalidArgument) return InvalidArgument(message);
  return Unavailable(message);
}

Status Aborted(const Status& cause) {
  return Status(cause.code(), "GPU communicator aborted: " + cause.message());
}

// Whether blocks * count elements of dtype fit in a size_t of bytes.
Status CheckCount(DType dtype, size_t count, size_t blocks) {
  if (!IsValidDType(static_cast<int>(dtype))) return InvalidArgument("unknown dtype code");
  if (count > std::numeric_limits<size_t>::max() / DTypeSize(dtype) / std::max<size_t>(blocks, 1)) {
    return InvalidArgument("count " + std::to_string(count) + " overflows the buffer size");
  }
  return Status::OK();
}

// For ops that only move data: NCCL's type for dtype, or bytes where NCCL has none (moving
// bytes is exact for every type). *n is the count in that type.
Status MoveTypeOf(DType dtype, const GpuLibraries& libs, size_t count, size_t blocks,
                  ncclDataType_t* type, size_t* n) {
  KF_RETURN_IF_ERROR(CheckCount(dtype, count, blocks));
  if (dtype != DType::kBool && NcclReduceTypeOf(dtype, libs, type).ok()) {
    *n = count;
  } else {
    *type = cuda_abi::ncclUint8;
    *n = count * DTypeSize(dtype);
  }
  return Status::OK();
}

}  // namespace

Status NcclReduceTypeOf(DType dtype, const GpuLibraries& libs, ncclDataType_t* out) {
  switch (dtype) {
    case DType::kInt8: *out = cuda_abi::ncclInt8; return Status::OK();
    case DType::kUInt8: *out = cuda_abi::ncclUint8; return Status::OK();
    case DType::kBool: *out = cuda_abi::ncclUint8; return Status::OK();  // min/max of 0 and 1
    case DType::kInt32: *out = cuda_abi::ncclInt32; return Status::OK();
    case DType::kUInt32: *out = cuda_abi::ncclUint32; return Status::OK();
    case DType::kInt64: *out = cuda_abi::ncclInt64; return Status::OK();
    case DType::kUInt64: *out = cuda_abi::ncclUint64; return Status::OK();
    case DType::kFloat16: *out = cuda_abi::ncclFloat16; return Status::OK();
    case DType::kFloat32: *out = cuda_abi::ncclFloat32; return Status::OK();
    case DType::kFloat64: *out = cuda_abi::ncclFloat64; return Status::OK();
    case DType::kBFloat16:
      if (!libs.HasAvgAndBfloat16()) {
        return InvalidArgument("NCCL " + libs.nccl_version + " has no bfloat16 (2.10 and later)");
      }
      *out = cuda_abi::ncclBfloat16;
      return Status::OK();
    case DType::kInt16:
    case DType::kUInt16: break;
  }
  return InvalidArgument(std::string("NCCL cannot reduce dtype ") + DTypeName(dtype));
}

// ---- GpuCommState -------------------------------------------------------------------------------

GpuCommState::~GpuCommState() {
  // Every GpuWork is gone, and the NCCL communicator was destroyed or aborted by ~GpuComm.
  if (stream != nullptr) libs.cudart.StreamDestroy(stream);
}

void GpuCommState::AbortLocked(const Status& why) {
  if (failure.ok()) failure = why;
  if (comm != nullptr) {
    libs.nccl.CommAbort(comm);  // ends this rank's kernels of the communicator
    comm = nullptr;
  }
  cv.notify_all();
}

// ---- GpuWork ------------------------------------------------------------------------------------

GpuWork::GpuWork(std::shared_ptr<GpuCommState> state, std::string name, cudaEvent_t done)
    : state_(std::move(state)), name_(std::move(name)), done_(done) {}

GpuWork::~GpuWork() {
  // CUDA releases an event whose record is still pending once the record completes.
  state_->libs.cudart.EventDestroy(done_);
}

bool GpuWork::PollLocked(Status* status) {
  GpuCommState& st = *state_;
  auto finish = [&](const Status& s) {
    finished_ = true;
    status_ = s;
    *status = s;
    return true;
  };
  if (finished_) return finish(status_);
  if (st.closed_idle) return finish(Status::OK());  // every op had completed (~GpuComm)
  if (!st.failure.ok()) return finish(st.failure.WithContext(name_));
  // The event first: an op that fails sets the async error before its event completes, so an
  // event seen complete with no async error after it means success.
  const cudaError_t q = st.libs.cudart.EventQuery(done_);
  ncclResult_t async = cuda_abi::ncclSuccess;
  const ncclResult_t r = st.libs.nccl.CommGetAsyncError(st.comm, &async);
  if (r != cuda_abi::ncclSuccess) async = r;
  if (async != cuda_abi::ncclSuccess) {
    const Status s = NcclError(st.libs, name_ + " failed on the device", async);
    st.AbortLocked(Aborted(s));
    return finish(s);
  }
  if (q == cuda_abi::cudaSuccess) return finish(Status::OK());
  if (q != cuda_abi::cudaErrorNotReady) {
    const Status s = CudaError(st.libs, "cudaEventQuery", q).WithContext(name_);
    st.AbortLocked(Aborted(s));
    return finish(s);
  }
  return false;
}

bool GpuWork::Poll(Status* status) {
  std::lock_guard<std::mutex> lk(state_->mu);
  return PollLocked(status);
}

Status GpuWork::Wait(int64_t timeout_ms) {
  GpuCommState& st = *state_;
  // Clamped to [0, about 30 years], so that the deadline's arithmetic cannot overflow.
  const int64_t bounded_ms = std::min<int64_t>(std::max<int64_t>(timeout_ms, 0), int64_t{1} << 40);
  const auto deadline = Clock::now() + std::chrono::milliseconds(bounded_ms);
  // Polls back off from 20 us to 2 ms: short ops answer fast, long ones cost little.
  auto interval = std::chrono::microseconds(20);
  std::unique_lock<std::mutex> lk(st.mu);
  Status s;
  for (;;) {
    if (PollLocked(&s)) return s;
    const auto now = Clock::now();
    if (now >= deadline) {
      const std::string why =
          name_ + " did not complete within " + std::to_string(timeout_ms) + " ms";
      st.AbortLocked(Unavailable("GPU communicator aborted: " + why));
      finished_ = true;
      status_ = DeadlineExceeded(why + "; the GPU communicator was aborted");
      return status_;
    }
    // Abort from another thread signals cv, so a failure ends the wait at once.
    st.cv.wait_until(lk, std::min<Clock::time_point>(deadline, now + interval));
    interval = std::min<std::chrono::microseconds>(interval * 2, std::chrono::milliseconds(2));
  }
}

// ---- GpuComm ------------------------------------------------------------------------------------

GpuComm::GpuComm(std::shared_ptr<GpuCommState> state) : state_(std::move(state)) {}

Status GpuComm::NewUniqueId(const GpuLibraries& libs, std::string* id) {
  cuda_abi::ncclUniqueId raw;
  const ncclResult_t r = libs.nccl.GetUniqueId(&raw);
  if (r != cuda_abi::ncclSuccess) return NcclError(libs, "ncclGetUniqueId", r);
  id->assign(raw.internal, sizeof(raw.internal));
  return Status::OK();
}

Status GpuComm::Create(const GpuLibraries& libs, const std::string& unique_id, int rank, int size,
                       int device, std::unique_ptr<GpuComm>* out) {
  if (unique_id.size() != cuda_abi::kNcclUniqueIdBytes) {
    return InvalidArgument("an NCCL unique id has " + std::to_string(cuda_abi::kNcclUniqueIdBytes) +
                           " bytes, not " + std::to_string(unique_id.size()));
  }
  if (size < 1 || rank < 0 || rank >= size) {
    return InvalidArgument("rank " + std::to_string(rank) + " of " + std::to_string(size));
  }
  int count = 0;
  const cudaError_t ce = libs.cudart.GetDeviceCount(&count);
  if (ce != cuda_abi::cudaSuccess) {
    return Unavailable(CudaError(libs, "cudaGetDeviceCount", ce).message());
  }
  if (device < 0 || device >= count) {
    return InvalidArgument("CUDA device " + std::to_string(device) + " of " +
                           std::to_string(count));
  }
  auto st = std::make_shared<GpuCommState>(libs, rank, size, device);
  DeviceGuard guard(libs.cudart, device);
  if (guard.result() != cuda_abi::cudaSuccess) {
    return CudaError(libs, "cudaSetDevice", guard.result());
  }
  cuda_abi::ncclUniqueId id;
  std::memcpy(id.internal, unique_id.data(), sizeof(id.internal));
  const ncclResult_t r = libs.nccl.CommInitRank(&st->comm, size, id, rank);
  if (r != cuda_abi::ncclSuccess) {
    st->comm = nullptr;
    return NcclError(libs, "ncclCommInitRank", r);
  }
  const cudaError_t se =
      libs.cudart.StreamCreateWithFlags(&st->stream, cuda_abi::cudaStreamNonBlocking);
  if (se != cuda_abi::cudaSuccess) {
    libs.nccl.CommDestroy(st->comm);
    st->comm = nullptr;
    st->stream = nullptr;
    return CudaError(libs, "cudaStreamCreateWithFlags", se);
  }
  out->reset(new GpuComm(std::move(st)));
  return Status::OK();
}

GpuComm::~GpuComm() {
  GpuCommState& st = *state_;
  std::lock_guard<std::mutex> lk(st.mu);
  if (st.comm != nullptr) {
    // Idle when an event recorded now has already completed: nothing is left on the stream.
    bool idle = false;
    DeviceGuard guard(st.libs.cudart, st.device);
    cudaEvent_t probe = nullptr;
    if (st.libs.cudart.EventCreateWithFlags(&probe, cuda_abi::cudaEventDisableTiming) ==
        cuda_abi::cudaSuccess) {
      idle = st.libs.cudart.EventRecord(probe, st.stream) == cuda_abi::cudaSuccess &&
             st.libs.cudart.EventQuery(probe) == cuda_abi::cudaSuccess;
      st.libs.cudart.EventDestroy(probe);
    }
    ncclResult_t async = cuda_abi::ncclSuccess;
    st.libs.nccl.CommGetAsyncError(st.comm, &async);
    if (idle && async == cuda_abi::ncclSuccess) {
      st.libs.nccl.CommDestroy(st.comm);
      st.comm = nullptr;
      st.closed_idle = true;
    }
  }
  // Ops still pending are aborted: a destroy would wait for them, maybe forever.
  st.AbortLocked(Cancelled("the GPU communicator was destroyed"));
}

int GpuComm::rank() const { return state_->rank; }
int GpuComm::size() const { return state_->size; }
int GpuComm::device() const { return state_->device; }
cudaStream_t GpuComm::stream() const { return state_->stream; }

void GpuComm::Abort(const std::string& reason) {
  std::lock_guard<std::mutex> lk(state_->mu);
  state_->AbortLocked(Unavailable("GPU communicator aborted: " + reason));
}

Status GpuComm::status() const {
  std::lock_guard<std::mutex> lk(state_->mu);
  return state_->failure;
}

template <typename Issue>
Status GpuComm::Enqueue(const char* what, const GpuOpOptions& options, Issue issue,
                        std::unique_ptr<GpuWork>* work) {
  GpuCommState& st = *state_;
  const CudartApi& cu = st.libs.cudart;
  std::lock_guard<std::mutex> lk(st.mu);
  const std::string name = std::string(what) + " #" + std::to_string(st.next_seq++);
  if (!st.failure.ok()) return st.failure.WithContext(name);
  DeviceGuard guard(cu, st.device);  // the event must belong to the stream's device
  cudaEvent_t done = nullptr;
  cudaError_t ce = cu.EventCreateWithFlags(&done, cuda_abi::cudaEventDisableTiming);
  if (ce != cuda_abi::cudaSuccess) {
    return CudaError(st.libs, "cudaEventCreateWithFlags", ce).WithContext(name);
  }
  auto fail = [&](const Status& s) {
    cu.EventDestroy(done);
    return s.WithContext(name);
  };
  if (options.ready != nullptr) {
    ce = cu.StreamWaitEvent(st.stream, options.ready, 0);
    if (ce != cuda_abi::cudaSuccess) return fail(CudaError(st.libs, "cudaStreamWaitEvent", ce));
  }
  const ncclResult_t r = issue(st.comm, st.stream);
  if (r != cuda_abi::ncclSuccess) {
    const Status s = NcclError(st.libs, "enqueue", r);
    // Arguments NCCL refused leave the communicator as it was; anything else may not have.
    if (r != cuda_abi::ncclInvalidArgument) st.AbortLocked(Aborted(s.WithContext(name)));
    return fail(s);
  }
  ce = cu.EventRecord(done, st.stream);
  if (ce != cuda_abi::cudaSuccess) {
    const Status s = CudaError(st.libs, "cudaEventRecord", ce);
    st.AbortLocked(Aborted(s.WithContext(name)));  // the op runs, but nobody could wait for it
    return fail(s);
  }
  work->reset(new GpuWork(state_, name, done));
  return Status::OK();
}

Status GpuComm::ReduceArgs(DType dtype, ReduceOp op, bool mean, ncclDataType_t* type,
                           ncclRedOp_t* redop) const {
  KF_RETURN_IF_ERROR(CheckReducible(dtype, op));
  KF_RETURN_IF_ERROR(NcclReduceTypeOf(dtype, state_->libs, type));
  switch (op) {
    case ReduceOp::kSum: *redop = cuda_abi::ncclSum; break;
    case ReduceOp::kProd: *redop = cuda_abi::ncclProd; break;
    case ReduceOp::kMin: *redop = cuda_abi::ncclMin; break;
    case ReduceOp::kMax: *redop = cuda_abi::ncclMax; break;
  }
  if (mean) {
    if (op != ReduceOp::kSum) return InvalidArgument("a mean is a sum divided by the size");
    if (!state_->libs.HasAvgAndBfloat16()) {
      return InvalidArgument("NCCL " + state_->libs.nccl_version + " has no ncclAvg (2.10+)");
    }
    *redop = cuda_abi::ncclAvg;
  }
  return Status::OK();
}

Status GpuComm::AllReduce(const void* send, void* recv, size_t count, DType dtype, ReduceOp op,
                          const GpuOpOptions& options, std::unique_ptr<GpuWork>* work) {
  ncclDataType_t type;
  ncclRedOp_t redop;
  KF_RETURN_IF_ERROR(ReduceArgs(dtype, op, options.mean, &type, &redop).WithContext("allreduce"));
  const auto& nccl = state_->libs.nccl;
  return Enqueue(
      "allreduce", options,
      [&](ncclComm_t c, cudaStream_t s) {
        return nccl.AllReduce(send, recv, count, type, redop, c, s);
      },
      work);
}

Status GpuComm::Broadcast(const void* send, void* recv, size_t count, DType dtype, int root,
                          const GpuOpOptions& options, std::unique_ptr<GpuWork>* work) {
  if (root < 0 || root >= size()) {
    return InvalidArgument("broadcast: root " + std::to_string(root) + " of " +
                           std::to_string(size()));
  }
  ncclDataType_t type;
  size_t n;
  KF_RETURN_IF_ERROR(MoveTypeOf(dtype, state_->libs, count, 1, &type, &n).WithContext("broadcast"));
  const auto& nccl = state_->libs.nccl;
  return Enqueue(
      "broadcast", options,
      [&](ncclComm_t c, cudaStream_t s) { return nccl.Broadcast(send, recv, n, type, root, c, s); },
      work);
}

Status GpuComm::Reduce(const void* send, void* recv, size_t count, DType dtype, ReduceOp op,
                       int root, const GpuOpOptions& options, std::unique_ptr<GpuWork>* work) {
  if (root < 0 || root >= size()) {
    return InvalidArgument("reduce: root " + std::to_string(root) + " of " +
                           std::to_string(size()));
  }
  ncclDataType_t type;
  ncclRedOp_t redop;
  KF_RETURN_IF_ERROR(ReduceArgs(dtype, op, options.mean, &type, &redop).WithContext("reduce"));
  const auto& nccl = state_->libs.nccl;
  return Enqueue(
      "reduce", options,
      [&](ncclComm_t c, cudaStream_t s) {
        return nccl.Reduce(send, recv, count, type, redop, root, c, s);
      },
      work);
}

Status GpuComm::Copy(void* dst, const void* src, size_t bytes, cuda_abi::cudaMemcpyKind kind,
                     const GpuOpOptions& options, std::unique_ptr<GpuWork>* work) {
  const CudartApi& cu = state_->libs.cudart;
  cudaError_t failed = cuda_abi::cudaSuccess;
  Status st = Enqueue(
      "copy", options,
      [&](ncclComm_t, cudaStream_t s) {
        failed = cu.MemcpyAsync(dst, src, bytes, kind, s);
        // Refused before it ran: the stream and the communicator are as they were.
        return failed == cuda_abi::cudaSuccess ? cuda_abi::ncclSuccess
                                               : cuda_abi::ncclInvalidArgument;
      },
      work);
  if (failed != cuda_abi::cudaSuccess) return CudaError(state_->libs, "cudaMemcpyAsync", failed);
  return st;
}

Status GpuComm::AllGather(const void* send, void* recv, size_t send_count, DType dtype,
                          const GpuOpOptions& options, std::unique_ptr<GpuWork>* work) {
  ncclDataType_t type;
  size_t n;
  KF_RETURN_IF_ERROR(
      MoveTypeOf(dtype, state_->libs, send_count, size(), &type, &n).WithContext("allgather"));
  const auto& nccl = state_->libs.nccl;
  return Enqueue(
      "allgather", options,
      [&](ncclComm_t c, cudaStream_t s) { return nccl.AllGather(send, recv, n, type, c, s); },
      work);
}

Status GpuComm::ReduceScatter(const void* send, void* recv, size_t recv_count, DType dtype,
                              ReduceOp op, const GpuOpOptions& options,
                              std::unique_ptr<GpuWork>* work) {
  ncclDataType_t type;
  ncclRedOp_t redop;
  KF_RETURN_IF_ERROR(
      ReduceArgs(dtype, op, options.mean, &type, &redop).WithContext("reducescatter"));
  KF_RETURN_IF_ERROR(CheckCount(dtype, recv_count, size()).WithContext("reducescatter"));
  const auto& nccl = state_->libs.nccl;
  return Enqueue(
      "reducescatter", options,
      [&](ncclComm_t c, cudaStream_t s) {
        return nccl.ReduceScatter(send, recv, recv_count, type, redop, c, s);
      },
      work);
}

Status GpuComm::AllToAll(const void* send, void* recv, size_t count, DType dtype,
                         const GpuOpOptions& options, std::unique_ptr<GpuWork>* work) {
  ncclDataType_t type;
  size_t n;
  KF_RETURN_IF_ERROR(
      MoveTypeOf(dtype, state_->libs, count, size(), &type, &n).WithContext("alltoall"));
  const size_t block = count * DTypeSize(dtype);
  const auto& nccl = state_->libs.nccl;
  const int peers = size();
  return Enqueue(
      "alltoall", options,
      [&](ncclComm_t c, cudaStream_t s) {
        ncclResult_t r = nccl.GroupStart();
        if (r != cuda_abi::ncclSuccess) return r;
        for (int p = 0; p < peers && r == cuda_abi::ncclSuccess; ++p) {
          r = nccl.Send(static_cast<const char*>(send) + p * block, n, type, p, c, s);
          if (r == cuda_abi::ncclSuccess) {
            r = nccl.Recv(static_cast<char*>(recv) + p * block, n, type, p, c, s);
          }
        }
        const ncclResult_t end = nccl.GroupEnd();  // always: the group must be closed
        return r != cuda_abi::ncclSuccess ? r : end;
      },
      work);
}

}  // namespace kungfu
