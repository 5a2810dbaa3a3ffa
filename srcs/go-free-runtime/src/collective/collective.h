// The collective algorithms over a transport, one file each: a strategy (kungfu/strategy.h) is a
// value that selects one. They run inside one operation (OpContext: its name, sequence number and
// deadline) among the peers of a Group, and return when this peer's part is done; a failure is
// returned, never thrown, and the caller (the TCP backend) aborts the operation on the others.
#pragma once
#include <vector>

#include "collective/part.h"
#include "kungfu/strategy.h"

namespace kungfu {

// ring.cc: reduce-scatter then allgather over `members` (ranks in ring order, this peer among
// them).
Status RingAllReduce(const Group& g, const OpContext& ctx, const Part& p,
                     const std::vector<int>& members);
// tree.cc: chunk c reduces up and broadcasts down trees[c mod T].
Status TreeAllReduce(const Group& g, const OpContext& ctx, const Part& p,
                     const std::vector<Tree>& trees);
// tree.cc: rooted operations along one tree, and the verdict that ends them on every peer.
Status ReduceTree(const Group& g, const OpContext& ctx, const Part& p, const Tree& tree);
Status BroadcastTree(const Group& g, const OpContext& ctx, const Part& p, const Tree& tree);
Status Verdict(const Group& g, const OpContext& ctx, const Tree& tree);
// hierarchical.cc: inside each host, across hosts, inside again; `reads`: inside the host by
// memory reads (DIRECT is this on one host), else by messages.
Status HierarchicalAllReduce(const Group& g, const OpContext& ctx, const Part& p, bool reads);
// gather.cc: blocks of any size per peer, in rank order; root < 0: every peer gets them
// (allgather), else only root, after which the op ends with a verdict along verdict_tree.
Status Gather(const Group& g, const OpContext& ctx, const void* send, size_t count, DType dtype,
              int root, const Tree& verdict_tree, GatherResult* out);

// allreduce.cc: what runs one allreduce of `layout` under strategy `s`: large buffers as up to
// `parallelism` independent pipelines over contiguous parts (spawned), each part by the
// algorithm the strategy selects. `reads`: peers of a host may read each other's memory (the
// session's probe); DIRECT needs it and one host.
struct AllReduceTuning {
  int parallelism = 1;
  bool local_reads = false;
  bool direct = false;
};
Status AllReduceParts(const Group& g, const OpContext& ctx, const Layout& layout, DType dtype,
                      ReduceOp op, const Strategy& s, const Spawner& spawn,
                      const AllReduceTuning& tuning);

}  // namespace kungfu
