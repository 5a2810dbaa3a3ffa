// GpuComm: one NCCL communicator, its own CUDA stream, and the operations kungfu runs on them.
//
// Streams and events (why no host synchronization on the caller's stream):
//   1. The caller writes the inputs on its stream and records an event there (GpuOpOptions.ready).
//   2. The op makes the communicator's stream wait for that event on the device
//      (cudaStreamWaitEvent), enqueues the NCCL call, and records its own completion event.
//   3. The caller makes its stream wait for GpuWork::done_event() before it reads the results,
//      and/or waits on the host with GpuWork::Wait(timeout).
// So compute and communication overlap, and the host never blocks a framework's stream.
//
// Failure (NCCL cannot cancel one op; it can abort the communicator, which ends every kernel of
// it on this rank, so no rank stays in a kernel whose peer is gone):
//   - GpuWork::Wait polls the completion event and ncclCommGetAsyncError. An async error, or the
//     deadline passing, aborts the communicator; the op reports it (DeadlineExceeded at the
//     deadline; InvalidArgument when NCCL reports invalid usage, e.g. ranks disagreeing on an
//     op; Unavailable otherwise), naming the op.
//   - Abort(reason), from any thread (e.g. when kungfu learns that a peer died), aborts the
//     communicator; every pending op and every later one fails at once with Unavailable.
//   - Once failed, a communicator stays failed: recovery makes a new one (new unique id), as
//     after a resize.
// An op whose completion was observed before the failure keeps its OK status.
//
// Lifetimes: GpuComm and each GpuWork share one state (the stream, the NCCL communicator, the
// failure); the state, and with it the stream, goes when the last of them goes. ~GpuComm
// destroys the NCCL communicator if its stream has no work left, else aborts it (a destroy
// would wait for that work, possibly forever if a peer is gone). A GpuWork outliving its
// GpuComm reports OK if the stream was idle then (every op had completed), else Cancelled. The
// GpuLibraries outlive everything (they are never unloaded).
//
// Lock order: the state's mutex is the only lock here; it is held around every call into NCCL
// with the communicator (enqueue, async-error query, abort, destroy), so an abort from another
// thread never frees the communicator under a call. It is not held while waiting: Wait sleeps on
// a condition variable that Abort signals. (A blocking NCCL enqueue would hold it; NCCL's
// collectives on an initialized blocking communicator return once the work is enqueued.)
//
// Not thread-safe for issuing: ops must be issued in the same order on every rank (as fusion
// agrees it), so one thread issues them; Wait, Poll and Abort may run on any thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "backend/gpu/cuda_api.h"
#include "backend/gpu/loader.h"
#include "kungfu/dtype.h"
#include "kungfu/status.h"

namespace kungfu {

// NCCL's type for `dtype` when reducing (int16, uint16 have none; bool maps to uint8 for min and
// max). InvalidArgument naming the dtype otherwise.
Status NcclReduceTypeOf(DType dtype, const GpuLibraries& libs, cuda_abi::ncclDataType_t* out);

struct GpuOpOptions {
  // Recorded by the caller on its stream once the inputs are written; the op's stream waits for
  // it on the device. Null: the inputs are ready now.
  cuda_abi::cudaEvent_t ready = nullptr;
  // AllReduce / ReduceScatter with ReduceOp::kSum only: divide by size() (ncclAvg, NCCL 2.10+).
  bool mean = false;
};

struct GpuCommState;

// One operation issued on a GpuComm.
class GpuWork {
 public:
  ~GpuWork();
  GpuWork(const GpuWork&) = delete;
  GpuWork& operator=(const GpuWork&) = delete;

  // "allreduce #12": the op and its sequence number on the communicator.
  const std::string& name() const { return name_; }
  // Completes on the communicator's stream once the results are written (or the op was ended by
  // an abort: only Wait/Poll tell which). Owned by this GpuWork; valid while it lives.
  cuda_abi::cudaEvent_t done_event() const { return done_; }
  // True once the op has an outcome, which goes to *status. Never blocks.
  bool Poll(Status* status);
  // Waits on the host at most timeout_ms for the outcome; at the deadline aborts the
  // communicator and returns DeadlineExceeded naming the op.
  Status Wait(int64_t timeout_ms);

 private:
  friend class GpuComm;
  GpuWork(std::shared_ptr<GpuCommState> state, std::string name, cuda_abi::cudaEvent_t done);
  bool PollLocked(Status* status);  // state mutex held

  std::shared_ptr<GpuCommState> state_;
  const std::string name_;
  cuda_abi::cudaEvent_t done_;
  bool finished_ = false;  // guarded by the state's mutex
  Status status_;          // guarded by the state's mutex
};

class GpuComm {
 public:
  // A fresh NCCL unique id (kNcclUniqueIdBytes bytes), to send to every rank over the runtime.
  static Status NewUniqueId(const GpuLibraries& libs, std::string* id);
  // Joins the communicator `unique_id` as `rank` of `size` on CUDA device `device`, and creates
  // its stream there. Blocks until every rank has joined (NCCL's rendezvous). The caller's
  // current device is left as it was.
  static Status Create(const GpuLibraries& libs, const std::string& unique_id, int rank, int size,
                       int device, std::unique_ptr<GpuComm>* out);
  ~GpuComm();
  GpuComm(const GpuComm&) = delete;
  GpuComm& operator=(const GpuComm&) = delete;

  int rank() const;
  int size() const;
  int device() const;
  cuda_abi::cudaStream_t stream() const;

  // Device pointers; send == recv runs in place. Counts are elements.
  Status AllReduce(const void* send, void* recv, size_t count, DType dtype, ReduceOp op,
                   const GpuOpOptions& options, std::unique_ptr<GpuWork>* work);
  // send is read on `root` only.
  Status Broadcast(const void* send, void* recv, size_t count, DType dtype, int root,
                   const GpuOpOptions& options, std::unique_ptr<GpuWork>* work);
  // recv holds size() * send_count elements, rank r's at r * send_count.
  Status AllGather(const void* send, void* recv, size_t send_count, DType dtype,
                   const GpuOpOptions& options, std::unique_ptr<GpuWork>* work);
  // send holds size() * recv_count elements; block r is reduced into rank r's recv.
  Status ReduceScatter(const void* send, void* recv, size_t recv_count, DType dtype, ReduceOp op,
                       const GpuOpOptions& options, std::unique_ptr<GpuWork>* work);
  // recv (read on `root` only) gets the reduction of every rank's send.
  Status Reduce(const void* send, void* recv, size_t count, DType dtype, ReduceOp op, int root,
                const GpuOpOptions& options, std::unique_ptr<GpuWork>* work);
  // A copy of `bytes` between host and device memory (or within either), ordered on the
  // communicator's stream with its collectives: the staging of an op that leaves the device in
  // between (the hierarchical allreduce's step across hosts).
  Status Copy(void* dst, const void* src, size_t bytes, cuda_abi::cudaMemcpyKind kind,
              const GpuOpOptions& options, std::unique_ptr<GpuWork>* work);
  // send and recv hold size() * count elements: block p of send goes to rank p, block p of
  // recv comes from rank p (grouped ncclSend/ncclRecv).
  Status AllToAll(const void* send, void* recv, size_t count, DType dtype,
                  const GpuOpOptions& options, std::unique_ptr<GpuWork>* work);

  // Aborts the communicator: every pending and later op fails with Unavailable(reason) at once.
  // Any thread; later calls do nothing.
  void Abort(const std::string& reason);
  // OK, or why the communicator failed.
  Status status() const;

 private:
  explicit GpuComm(std::shared_ptr<GpuCommState> state);
  // Issues one op: the wait for options.ready, `issue` (the NCCL calls), the completion record.
  template <typename Issue>
  Status Enqueue(const char* what, const GpuOpOptions& options, Issue issue,
                 std::unique_ptr<GpuWork>* work);
  Status ReduceArgs(DType dtype, ReduceOp op, bool mean, cuda_abi::ncclDataType_t* type,
                    cuda_abi::ncclRedOp_t* redop) const;

  std::shared_ptr<GpuCommState> state_;
};

}  // namespace kungfu
