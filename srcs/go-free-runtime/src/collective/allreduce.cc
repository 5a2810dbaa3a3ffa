#include <condition_variable>
#include <mutex>

#include "collective/collective.h"

namespace kungfu {

Status AllReduceParts(const Group& g, const OpContext& ctx, const Layout& layout, DType dtype,
                      ReduceOp op, const Strategy& s, const Spawner& spawn,
                      const AllReduceTuning& tuning) {
  const size_t count = layout.total();
  const size_t bytes = count * DTypeSize(dtype);
  const Part whole{&layout, 0, count, count, dtype, op, 0};
  if (s.allreduce == Algorithm::kDirect) {
    if (!tuning.direct) {
      return InvalidArgument(
          "strategy DIRECT needs every peer on one host, allowed to read the others' memory "
          "(process_vm_readv); use RING or AUTO");
    }
    // One host: HIERARCHICAL with one segment per peer, every phase by memory reads.
    return HierarchicalAllReduce(g, ctx, whole, true);
  }
  // Large buffers run as independent pipelines over contiguous parts.
  size_t parts = 1;
  if (tuning.parallelism > 1 && bytes >= 4 * g.chunk_bytes) {
    parts = std::min<size_t>(tuning.parallelism, bytes / (2 * g.chunk_bytes));
  }
  bool hierarchical = s.allreduce == Algorithm::kHierarchical;
  if (hierarchical) {  // tags number at most 64 segments (peers per host; beyond, its tree runs)
                       // and 64 parts
    for (const auto& ranks : g.hosts.ranks_of_host) {
      hierarchical = hierarchical && ranks.size() <= kMaxHierarchicalSegments;
    }
    parts = std::min(parts, 4096 / kMaxHierarchicalSegments);
  }
  std::vector<int> ring(g.size);  // RING: the ranks in order
  for (int r = 0; r < g.size; ++r) ring[r] = r;
  auto run_part = [&](size_t i) {
    auto [b, e] = EvenPiece(count, parts, i);
    const Part p = whole.Sub(b, e, i, false);
    Status st = hierarchical ? HierarchicalAllReduce(g, ctx, p, tuning.local_reads)
                : s.allreduce == Algorithm::kRing ? RingAllReduce(g, ctx, p, ring)
                                                  : TreeAllReduce(g, ctx, p, s.trees);
    // The other parts here and on the peers would wait for this one's messages: stop them now.
    if (!st.ok() && parts > 1 && st.code() != Code::kCancelled)
      g.transport.AbortOp(ctx.name, ctx.seq, st);
    return st;
  };
  if (parts == 1) return run_part(0);
  std::mutex mu;
  std::condition_variable cv;
  size_t finished = 0;
  Status first;
  for (size_t i = 1; i < parts; ++i) {
    auto part = [&, i] {
      Status st = run_part(i);
      std::lock_guard<std::mutex> lk(mu);
      if (!st.ok() && first.ok()) first = st;
      ++finished;
      cv.notify_all();
    };
    try {
      spawn(part);
    } catch (const std::exception&) {  // no thread to be had: run it here, after the others
      part();
    }
  }
  Status st = run_part(0);
  std::unique_lock<std::mutex> lk(mu);
  if (!st.ok() && first.ok()) first = st;
  cv.wait(lk, [&] { return finished == parts - 1; });
  return first;
}
}  // namespace kungfu
