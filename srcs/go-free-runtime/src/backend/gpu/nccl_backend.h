// The backends that serve device memory (kungfu/gpu.h says what each does). Internal to
// src/backend/gpu.
#pragma once
#include <memory>
#include <mutex>
#include <vector>

#include "backend/gpu/device_ops.h"
#include "backend/gpu/gpu_comm.h"
#include "kungfu/backend.h"

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
  // The communicator, made at the first op: rank 0's unique id broadcast over the host backend
  // as a sub-operation of `ctx`.
  Status Comm(const OpContext& ctx, GpuComm** out);
  // Runs the ops `issue` enqueues (after the caller's stream), then waits for them all.
  Status Run(const OpContext& ctx, const char* what, const std::vector<Issue>& issue);

  const GpuLibraries& libs_;
  const int device_;
  Transport& transport_;
  Backend& host_;
  CallerStream caller_;
  // run_mu_ is held while an op issues and waits (ops run one at a time, in issue order);
  // state_mu_ guards comm_ and failed_, briefly, and is what Abort takes (from any thread, an op
  // under way included: GpuComm::Abort is thread-safe). Lock order: run_mu_, then state_mu_.
  std::mutex run_mu_;
  std::mutex state_mu_;
  std::unique_ptr<GpuComm> comm_;
  Status failed_;  // once a communicator failed, every later op of this session fails so
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
