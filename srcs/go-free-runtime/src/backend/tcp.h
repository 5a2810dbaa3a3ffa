// The TCP backend: the collective algorithms of src/collective over the session's transport
// (streams between hosts, Unix sockets and memory reads inside one). It serves host memory.
#pragma once
#include "collective/collective.h"
#include "kungfu/backend.h"

namespace kungfu {

class TcpBackend : public Backend {
 public:
  // `transport` and `hosts` outlive the backend (the session owns all three).
  TcpBackend(Transport& transport, const HostLayout& hosts, size_t chunk_bytes, int parallelism);

  const char* name() const override { return "tcp"; }
  bool Serves(Memory memory) const override { return memory == Memory::kHost; }
  // Whether peers of one host may read each other's memory (the session's probe, run once before
  // any operation): DIRECT needs it and one host; HIERARCHICAL reads inside hosts with it.
  void SetMemoryReads(bool local_reads, bool direct);

  Status AllReduce(const OpContext& ctx, const std::vector<Piece>& pieces, DType dtype, ReduceOp op,
                   const Strategy& strategy, const Spawner& spawn, size_t pack_bytes) override;
  Status Reduce(const OpContext& ctx, const void* send, void* recv, size_t count, DType dtype,
                ReduceOp op, int root, const Strategy& strategy) override;
  Status Broadcast(const OpContext& ctx, const void* send, void* recv, size_t count, DType dtype,
                   int root, const Strategy& strategy) override;
  Status Gather(const OpContext& ctx, const void* send, size_t count, DType dtype, int root,
                const Strategy& strategy, GatherResult* out) override;

 private:
  Status AllReduceLaidOut(const OpContext& ctx, const Layout& layout, DType dtype, ReduceOp op,
                          const Strategy& strategy, const Spawner& spawn);
  const Group group_;
  AllReduceTuning tuning_;
};

}  // namespace kungfu
