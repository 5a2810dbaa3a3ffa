// Session: one cluster version's peer list with its transport and backends. Every collective runs
// inside exactly one session; a new version builds a new session. What is fixed for its life:
// the peers, the transport, the host layout and the memory-read probe's answer (ProbeDirect, run
// once before any operation). What changes between operations, under its own locks: the default
// strategy (SetDefault, after every peer agreed), the traffic counters, and the backends a
// binding adds (AddBackend, e.g. the GPU one at its first use).
//
// Each collective picks the strategy here (the op's, else the default; AUTO resolved by size) and
// runs on the first backend that serves the op's memory (kungfu/backend.h): the TCP backend for
// host memory, always present.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include <mutex>
#include <utility>

#include "kungfu/backend.h"
#include "kungfu/dtype.h"
#include "kungfu/op.h"
#include "kungfu/strategy.h"
#include "kungfu/transport.h"

namespace kungfu {

class TcpBackend;

class Session {
 public:
  // Runs over `transport` (any implementation; the session owns it). Peers and rank are the
  // transport's.
  Session(std::unique_ptr<Transport> transport, StrategyKind strategy, size_t chunk_bytes,
          int parallelism);
  ~Session();  // aborts what waits in the backends, then releases them and the transport

  // Puts `backend` before the others: it runs the operations of the memory it serves from now
  // on. Call it between operations (one under way keeps its backend).
  void AddBackend(std::unique_ptr<Backend> backend);
  // Makes a backend with `factory` over this session's transport and host backend and adds it.
  void AddBackend(const BackendFactory& factory);
  // A peer failed or the session is left: every backend's waits fail at once with `why`.
  void AbortBackends(const Status& why);

  Transport& transport() { return transport_; }
  int rank() const { return rank_; }
  int size() const { return static_cast<int>(peers_.size()); }
  const PeerList& peers() const { return peers_; }
  // The strategy an operation of `bytes` runs with when it asks for `requested` (-1: default).
  Strategy StrategyFor(int requested, size_t bytes) const;

  // The default strategy (for operations that ask for none): a named one, or a user tree (kind
  // kTree with a non-empty father array). Peer::SetStrategy changes it between operations,
  // after every peer agreed; an operation reads it once, when it starts.
  void SetDefault(StrategyKind kind, Tree tree);
  std::pair<StrategyKind, Tree> Default() const;

  // Traffic of allreduces that used the default strategy, per strategy that ran them (AUTO
  // resolved; a user tree counts as TREE), for policies that compare strategies: operations,
  // bytes per peer and seconds.
  std::vector<StrategyCounter> Counters() const;

  Status AllReduce(const OpContext& ctx, const void* send, void* recv, size_t count, DType dtype,
                   ReduceOp op, int strategy, const Spawner& spawn);
  // One allreduce over several buffers at once, without copying them together: the algorithms
  // see the pieces laid end to end as one buffer (no message crosses a piece boundary). Every
  // peer passes pieces of the same counts in the same order; each piece's send may equal its
  // recv (in place). pack_bytes > 0: pieces of at most pack_bytes are packed into one buffer
  // first (TcpBackend::AllReduce).
  Status AllReduceV(const OpContext& ctx, const std::vector<Piece>& pieces, DType dtype,
                    ReduceOp op, int strategy, const Spawner& spawn, size_t pack_bytes = 0);
  Status Reduce(const OpContext& ctx, const void* send, void* recv, size_t count, DType dtype,
                ReduceOp op, int root, int strategy);
  Status Broadcast(const OpContext& ctx, const void* send, void* recv, size_t count, DType dtype,
                   int root, int strategy);
  Status AllGather(const OpContext& ctx, const void* send, size_t count, DType dtype,
                   GatherResult* out);
  Status Gather(const OpContext& ctx, const void* send, size_t count, DType dtype, int root,
                GatherResult* out);
  // Equal blocks, on a backend that offers them (a GPU backend; kungfu/backend.h says what each
  // does): allgather into one buffer, reduce-scatter, all-to-all.
  Status AllGatherEqual(const OpContext& ctx, const void* send, void* recv, size_t count,
                        DType dtype);
  Status ReduceScatter(const OpContext& ctx, const void* send, void* recv, size_t recv_count,
                       DType dtype, ReduceOp op);
  Status AllToAll(const OpContext& ctx, const void* send, void* recv, size_t count, DType dtype);
  Status Consensus(const OpContext& ctx, const void* data, size_t bytes, bool* agreed);
  // C1 of one outcome per operation (peer.h): an empty message to every peer, then (`wait`)
  // every peer's, until ctx.deadline. OK with `wait`: this peer has committed.
  Status Commit(const OpContext& ctx, bool wait);

  // Whether peers of one host may read each other's memory: `allowed` and every peer could read
  // every other peer of its host through the transport (CanReadPeerMemory, ReadPeerMemory); all
  // peers reach the same answer. DIRECT needs it and one host; HIERARCHICAL uses it inside hosts.
  // Run once, after the transport is connected and before any operation.
  Status ProbeDirect(TimePoint deadline, bool allowed);
  bool direct_ok() const { return direct_ok_; }

 private:
  Status BackendFor(const OpContext& ctx, Backend** out);
  Status ProbeDirectOp(const std::string& name, TimePoint deadline, bool allowed);

  const PeerList peers_;
  const int rank_;
  const HostLayout layout_;
  mutable std::mutex default_mu_;  // guards default_kind_, default_tree_, counters_
  StrategyKind default_kind_;
  Tree default_tree_;
  std::vector<StrategyCounter> counters_;
  bool direct_ok_ = false;       // local_reads_ok_ and one host
  bool local_reads_ok_ = false;  // every peer may read the memory of the peers of its host
  uint64_t probe_word_ = 0;
  std::unique_ptr<Transport> owned_transport_;
  Transport& transport_;  // *owned_transport_
  // The backends, first served first; the TCP one (*tcp_) is always the last. Declared after the
  // transport, so they go before it. backends_mu_ is taken alone.
  std::mutex backends_mu_;
  std::vector<std::unique_ptr<Backend>> backends_;
  TcpBackend* tcp_ = nullptr;
};

}  // namespace kungfu
