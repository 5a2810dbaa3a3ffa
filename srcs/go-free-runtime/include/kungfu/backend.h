// Backend: what an operation needs from whatever moves its data. A session runs each operation on
// the first of its backends that serves the operation's memory (Serves): the TCP backend (the
// algorithms of src/collective over the session's transport) serves host memory; a GPU backend
// (NCCL, loaded at run time) serves device memory. Session, fusion and the bindings see only
// this interface, so a backend plugs in without touching them (c10d's Backend, Horovod's
// operation manager asking each backend in turn).
//
// Contract of every operation:
//  1. It runs inside one operation of the session (OpContext: name, sequence number, deadline,
//     memory); every peer of the session calls it with the same arguments but the buffers.
//  2. It returns once this peer's part is done and its output buffers hold the result, or with the
//     status that ends the operation; it never waits past ctx.deadline. The session, not the
//     backend, aborts a failed operation on the other peers.
//  3. Buffers stay the caller's: a backend reads and writes them only until it returns.
// An operation a backend does not offer returns InvalidArgument naming the backend (the base
// class's default), never a wrong result.
#pragma once
#include <functional>
#include <memory>
#include <vector>

#include "kungfu/dtype.h"
#include "kungfu/op.h"
#include "kungfu/status.h"
#include "kungfu/strategy.h"
#include "kungfu/transport.h"

namespace kungfu {

class Backend {
 public:
  virtual ~Backend() = default;
  virtual const char* name() const = 0;
  virtual bool Serves(Memory memory) const = 0;

  // `strategy`: what the session chose for this operation (a backend with graphs of its own may
  // ignore it). `spawn` runs independent parts concurrently.
  virtual Status AllReduce(const OpContext& ctx, const std::vector<Piece>& pieces, DType dtype,
                           ReduceOp op, const Strategy& strategy, const Spawner& spawn,
                           size_t pack_bytes) = 0;
  virtual Status Reduce(const OpContext& ctx, const void* send, void* recv, size_t count,
                        DType dtype, ReduceOp op, int root, const Strategy& strategy);
  virtual Status Broadcast(const OpContext& ctx, const void* send, void* recv, size_t count,
                           DType dtype, int root, const Strategy& strategy);
  // Counts may differ per peer; root < 0: every peer gets the blocks (allgather).
  virtual Status Gather(const OpContext& ctx, const void* send, size_t count, DType dtype, int root,
                        const Strategy& strategy, GatherResult* out);
  // Equal blocks: recv holds size x count elements, block r from rank r.
  virtual Status AllGatherEqual(const OpContext& ctx, const void* send, void* recv, size_t count,
                                DType dtype);
  // recv holds recv_count elements: this rank's block of the reduction of every peer's send
  // (size x recv_count elements).
  virtual Status ReduceScatter(const OpContext& ctx, const void* send, void* recv,
                               size_t recv_count, DType dtype, ReduceOp op);
  // Block j (count elements) of send goes to rank j; block i of recv comes from rank i.
  virtual Status AllToAll(const OpContext& ctx, const void* send, void* recv, size_t count,
                          DType dtype);
  // A peer of the session failed or the session ends: whatever waits in this backend fails at
  // once with `why`, and so does every later operation.
  virtual void Abort(const Status& why) {}

 protected:
  Status Unsupported(const char* what) const;
};

// Makes a backend for one session (every cluster version and process set gets its own):
// `transport` is the session's (its peers, its failure), `host` its host-memory backend, for
// what a backend exchanges or stages through host memory. The backend must not outlive either.
using BackendFactory = std::function<std::unique_ptr<Backend>(Transport& transport, Backend& host)>;

}  // namespace kungfu
