// The backends that serve device memory (kungfu/gpu.h says what each does). Internal to
// src/backend/gpu.
#pragma once
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "backend/gpu/device_ops.h"
#include "backend/gpu/gpu_comm.h"
#include "kungfu/backend.h"
#include "kungfu/peer_id.h"

namespace kungfu {

class NcclBackend : public Backend {
 public:
  NcclBackend(const GpuLibraries& libs, int device, Transport& transport, Backend& host);
  ~NcclBackend() override;
  const char* name() const override { return "nccl"; }
  bool Serves(Memory memory) const override { return memory == Memory::kDevice; }

  Status AllReduce(const OpContext& ctx, const std::vector<Piece>& pieces, DType dtype, ReduceOp op,
                   const Strategy& strategy, const Spawner& spawn, size_t pack_bytes) override;
  Status Broadcast(const OpContext& ctx, const void* send, void* recv, size_t count, DType dtype,
                   int root, const Strategy& strategy) override;
  Status AllGatherEqual(const OpContext& ctx, const void* send, void* recv, size_t count,
                        DType dtype) override;
  Status ReduceScatter(const OpContext& ctx, const void* send, void* recv, size_t recv_count,
                       DType dtype, ReduceOp op) override;
  Status AllToAll(const OpContext& ctx, const void* send, void* recv, size_t count,
                  DType dtype) override;
  void Abort(const Status& why) override;

 private:
  using Issue = std::function<Status(GpuComm&, const GpuOpOptions&, std::unique_ptr<GpuWork>*)>;
  // Which ranks a communicator joins: all of the session's, or this host's (the hierarchical
  // allreduce's inside steps).
  enum class Scope { kAll, kHost };
  // The communicator of `scope`, made at its first op: for kAll rank 0's unique id is broadcast
  // over the host backend, for kHost every host's first rank's is gathered (a sub-operation of
  // `ctx` either way). run_mu_ held.
  Status Comm(const OpContext& ctx, Scope scope, GpuComm** out);
  Status UniqueId(const OpContext& ctx, Scope scope, std::string* id);
  // GpuComm::Create within ctx's deadline, watching the transport for a failed peer.
  Status Join(const OpContext& ctx, const std::string& id, int rank, int size,
              std::unique_ptr<GpuComm>* out);
  // Runs the ops `issue` enqueues on the session-wide communicator, then waits for them all.
  Status Run(const OpContext& ctx, const char* what, const std::vector<Issue>& issue);
  // Enqueues `issue` on `comm` (after the caller's stream where after_caller), makes the caller's
  // stream wait for each op, and waits for them all, watching the transport. run_mu_ held.
  Status Issued(const OpContext& ctx, const char* what, GpuComm& comm,
                const std::vector<Issue>& issue, bool after_caller);
  // Remembers the first failure: every later op of this session fails with it.
  Status Failed(const Status& st);
  // nccl_hierarchical.cc: the allreduce of a session that spans several hosts.
  Status AllReduceAcrossHosts(const OpContext& ctx, const std::vector<Piece>& pieces, DType dtype,
                              ReduceOp op);
  Status AcrossHosts(const OpContext& ctx, GpuComm& local, const Piece& x, size_t index,
                     DType dtype, ReduceOp op);
  Status HostBuffer(size_t bytes, char** out);  // pinned, grown as needed; run_mu_ held

  const GpuLibraries& libs_;
  const int device_;
  Transport& transport_;
  Backend& host_;
  const HostLayout hosts_;
  CallerStream caller_;
  // run_mu_ is held while an op issues and waits (ops run one at a time, in issue order);
  // state_mu_ guards the communicators and failed_, briefly, and is what Abort takes (from any
  // thread, an op under way included: GpuComm::Abort is thread-safe). Lock order: run_mu_, then
  // state_mu_.
  std::mutex run_mu_;
  std::mutex state_mu_;
  std::unique_ptr<GpuComm> comm_;       // every rank of the session
  std::unique_ptr<GpuComm> host_comm_;  // this host's ranks (sessions across hosts)
  Status failed_;           // once a communicator failed, every later op of this session fails so
  char* pinned_ = nullptr;  // HostBuffer's; run_mu_
  size_t pinned_bytes_ = 0;
};

class StagingBackend : public Backend {
 public:
  StagingBackend(const GpuLibraries& libs, int device, size_t chunk_bytes, Backend& host);
  ~StagingBackend() override;
  const char* name() const override { return "staging"; }
  bool Serves(Memory memory) const override { return memory == Memory::kDevice; }

  Status AllReduce(const OpContext& ctx, const std::vector<Piece>& pieces, DType dtype, ReduceOp op,
                   const Strategy& strategy, const Spawner& spawn, size_t pack_bytes) override;
  Status Broadcast(const OpContext& ctx, const void* send, void* recv, size_t count, DType dtype,
                   int root, const Strategy& strategy) override;

 private:
  // For chunk k of [send, send + bytes): copied into a pinned buffer, `host_op(k, buffer,
  // bytes)` run on it in place, copied back to the same offset of recv.
  using HostOp = std::function<Status(size_t k, char* buffer, size_t bytes)>;
  Status Stage(const OpContext& ctx, const void* send, void* recv, size_t bytes, size_t esize,
               const HostOp& host_op);
  Status Setup(const OpContext& ctx);  // the stream, events and pinned buffers, at first use
  Status WaitEvent(const OpContext& ctx, cuda_abi::cudaEvent_t event) const;

  const GpuLibraries& libs_;
  const int device_;
  const size_t chunk_bytes_;
  Backend& host_;
  CallerStream caller_;
  cuda_abi::cudaStream_t stream_ = nullptr;
  cuda_abi::cudaEvent_t down_[2] = {nullptr, nullptr};  // chunk k's copy down ended
  cuda_abi::cudaEvent_t done_ = nullptr;                // the last copy back ended
  char* pinned_[2] = {nullptr, nullptr};
};

}  // namespace kungfu
