// The test double's communicator: NCCL's semantics over the shared segment of shm.h.
//
// Issue order is execution order. The host thread that calls ncclAllReduce & co. takes a ticket
// (under issue_mu_) and enqueues the work on the given stream; on the stream's worker the work
// waits for its ticket's turn, so the ops of one communicator run one at a time, in the order
// they were issued, whatever streams they were put on (as NCCL's kernels on one communicator
// serialize). Only the op holding the turn touches round_ and the segment's slots.
//
// Failure: an op that fails, runs past the deadline, or sees a peer fail sets the async error
// (ncclCommGetAsyncError) and, unless a peer caused it, raises the segment's failure flag, so the
// peers' waits end too instead of hanging. ncclCommAbort sets the local abort flag (every wait
// polls it), raises the flag for the peers, and waits until the op holding the turn has left;
// ops that have not started then return without touching their buffers.
//
// Fault injection (read once, at ncclCommInitRank, from the environment of the process):
//   KUNGFU_GPU_DOUBLE_FAIL_RANK=r   rank r's op number KUNGFU_GPU_DOUBLE_AFTER_OPS (from 0;
//                                   collectives and p2p groups count) fails with ncclSystemError
//   KUNGFU_GPU_DOUBLE_STALL_RANK=r  that op never arrives: it waits for an abort or a peer failure
//   KUNGFU_GPU_DOUBLE_TIMEOUT_MS    how long any wait in an op may take before the op fails with
//                                   ncclSystemError (default 60000; real NCCL would hang)
//   KUNGFU_GPU_DOUBLE_INIT_TIMEOUT_MS  how long ncclCommInitRank waits for the others (30000)
//
// Lifetimes: the ncclComm_t handle and every queued op hold a shared_ptr to the Comm, so the
// segment stays mapped until the last op has run, even after ncclCommDestroy/ncclCommAbort.
// Lock order: issue_mu_, then a stream's queue lock (Enqueue); turn_mu_ is never held while
// waiting on the segment or calling out.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "shm.h"
#include "stream.h"

namespace kfdouble {

enum OpKind : int32_t {
  kAllReduce = 1,
  kBroadcast = 2,
  kReduce = 3,
  kAllGather = 4,
  kReduceScatter = 5,
  kP2pGroup = 6,
};

struct P2pOp {
  bool is_send;
  void* buf;  // the send buffer (read only) or the receive buffer
  size_t bytes;
  int peer;
};

struct Op {
  OpKind kind;
  const void* send = nullptr;
  void* recv = nullptr;
  size_t count = 0;  // elements: per rank for allgather (sent) and reduce-scatter (received)
  int dtype = 0;
  int redop = 0;
  int root = 0;
  std::vector<P2pOp> p2p;  // kP2pGroup: the sends and receives of one ncclGroupEnd
  // Set at issue:
  uint64_t ticket = 0;
  uint64_t coll_index = 0;
  enum Fault { kNone, kFail, kStall } fault = kNone;
};

class Comm : public std::enable_shared_from_this<Comm> {
 public:
  // Joins the communicator (shm.h, Rendezvous) and reads the fault settings.
  kungfu::cuda_abi::ncclResult_t Init(const std::string& name, int nranks, int rank);
  // Takes a ticket and enqueues `op` on `stream`. Fails at once if the communicator has failed.
  kungfu::cuda_abi::ncclResult_t Issue(Op op, kungfu::cuda_abi::cudaStream_t stream);
  void Abort();
  kungfu::cuda_abi::ncclResult_t async_error() const;
  int nranks() const { return seg_.nranks(); }

 private:
  void RunInTurn(const Op& op);  // on a stream worker
  kungfu::cuda_abi::ncclResult_t Execute(const Op& op);
  kungfu::cuda_abi::ncclResult_t Fail(kungfu::cuda_abi::ncclResult_t code, bool tell_peers);

  // Waits until pred() holds, polling the abort flag, the peers' failure flag and the deadline.
  template <typename Pred>
  WaitEnd WaitUntil(Pred pred);
  kungfu::cuda_abi::ncclResult_t Ended(WaitEnd end);  // the error a wait's end reports
  kungfu::cuda_abi::ncclResult_t Barrier();
  kungfu::cuda_abi::ncclResult_t StartCollective(const Op& op);
  template <typename Fill, typename Use>
  kungfu::cuda_abi::ncclResult_t Round(Fill fill, Use use);

  kungfu::cuda_abi::ncclResult_t AllReduce(const Op& op);
  kungfu::cuda_abi::ncclResult_t Broadcast(const Op& op);
  kungfu::cuda_abi::ncclResult_t AllGather(const Op& op);
  kungfu::cuda_abi::ncclResult_t ReduceScatter(const Op& op);
  kungfu::cuda_abi::ncclResult_t P2pGroup(const Op& op);
  kungfu::cuda_abi::ncclResult_t Stall();

  Segment seg_;
  int fail_rank_ = -1;
  int stall_rank_ = -1;
  uint64_t fault_op_ = 0;
  int64_t timeout_ms_ = 60000;
  // KUNGFU_GPU_DOUBLE_TRACE: a file that gets one line per op issued (what a test checks about
  // which communicators an operation used).
  std::string trace_;
  Clock::time_point deadline_;  // of the running op; only the op holding the turn uses it

  std::atomic<bool> aborted_{false};
  std::atomic<int32_t> async_error_{0};

  std::mutex issue_mu_;
  uint64_t next_ticket_ = 0;  // guarded by issue_mu_
  uint64_t next_coll_ = 0;    // guarded by issue_mu_

  std::mutex turn_mu_;
  std::condition_variable turn_cv_;
  uint64_t turn_ = 0;     // guarded by turn_mu_: the ticket that may run next
  bool running_ = false;  // guarded by turn_mu_: an op holds the turn
  uint64_t round_ = 0;    // the last barrier round; used only by the op holding the turn
};

}  // namespace kfdouble

namespace kungfu::cuda_abi {
struct ncclComm {
  std::shared_ptr<kfdouble::Comm> comm;
};
}  // namespace kungfu::cuda_abi
