#include "backend/tcp.h"

#include <cstring>

namespace kungfu {

TcpBackend::TcpBackend(Transport& transport, const HostLayout& hosts, size_t chunk_bytes,
                       int parallelism)
    : group_{transport, transport.rank(), static_cast<int>(transport.peers().size()), hosts,
             chunk_bytes} {
  tuning_.parallelism = parallelism;
}

void TcpBackend::SetMemoryReads(bool local_reads, bool direct) {
  tuning_.local_reads = local_reads;
  tuning_.direct = direct;
}

// pack_bytes > 0: the pieces of at most pack_bytes (when there are several) are copied into one
// buffer first, the first piece, and their results copied back only on success; larger pieces
// stay on their own buffers (copying them would cost more than it saves). Fewer, larger
// messages: a message never spans two pieces.
Status TcpBackend::AllReduce(const OpContext& ctx, const std::vector<Piece>& pieces, DType dtype,
                             ReduceOp op, const Strategy& strategy, const Spawner& spawn,
                             size_t pack_bytes) {
  const size_t es = DTypeSize(dtype);
  std::vector<bool> packed(pieces.size(), false);
  size_t packed_count = 0, small = 0;
  if (pack_bytes > 0 && group_.size > 1) {
    for (const Piece& x : pieces) small += x.count * es <= pack_bytes;
  }
  for (size_t i = 0; i < pieces.size() && small > 1; ++i) {
    packed[i] = pieces[i].count * es <= pack_bytes;
    if (packed[i]) packed_count += pieces[i].count;
  }
  if (packed_count == 0) return AllReduceLaidOut(ctx, Layout(pieces), dtype, op, strategy, spawn);
  Buffer fused(packed_count * es);
  std::vector<Piece> laid{{fused.data(), fused.data(), packed_count}};
  size_t off = 0;
  for (size_t i = 0; i < pieces.size(); ++i) {
    if (!packed[i]) {
      laid.push_back(pieces[i]);
    } else if (pieces[i].count > 0) {
      std::memcpy(fused.data() + off, pieces[i].send, pieces[i].count * es);
      off += pieces[i].count * es;
    }
  }
  KF_RETURN_IF_ERROR(AllReduceLaidOut(ctx, Layout(laid), dtype, op, strategy, spawn));
  off = 0;
  for (size_t i = 0; i < pieces.size(); ++i) {
    if (!packed[i] || pieces[i].count == 0) continue;
    std::memcpy(pieces[i].recv, fused.data() + off, pieces[i].count * es);
    off += pieces[i].count * es;
  }
  return Status::OK();
}

Status TcpBackend::AllReduceLaidOut(const OpContext& ctx, const Layout& layout, DType dtype,
                                    ReduceOp op, const Strategy& strategy, const Spawner& spawn) {
  if (group_.size == 1) {
    Part{&layout, 0, layout.total(), layout.total(), dtype, op, 0}.CopyThrough();
    return Status::OK();
  }
  return AllReduceParts(group_, ctx, layout, dtype, op, strategy, spawn, tuning_);
}

namespace {

using AlongTree = Status (*)(const Group&, const OpContext&, const Part&, const Tree&);

// A rooted operation: `along` the tree of `strategy` rooted at `root`, then the verdict.
Status Rooted(const Group& g, const OpContext& ctx, const void* send, void* recv, size_t count,
              DType dtype, ReduceOp op, int root, const Strategy& strategy, AlongTree along) {
  const Layout layout(send, recv, count);
  const Part p{&layout, 0, count, count, dtype, op, 0};
  if (g.size == 1) {
    p.CopyThrough();
    return Status::OK();
  }
  const Tree tree = strategy.TreeRootedAt(root, g.size);
  KF_RETURN_IF_ERROR(along(g, ctx, p, tree));
  return Verdict(g, ctx, tree);
}

}  // namespace

Status TcpBackend::Reduce(const OpContext& ctx, const void* send, void* recv, size_t count,
                          DType dtype, ReduceOp op, int root, const Strategy& strategy) {
  return Rooted(group_, ctx, send, recv, count, dtype, op, root, strategy, ReduceTree);
}

Status TcpBackend::Broadcast(const OpContext& ctx, const void* send, void* recv, size_t count,
                             DType dtype, int root, const Strategy& strategy) {
  return Rooted(group_, ctx, send, recv, count, dtype, ReduceOp::kSum, root, strategy,
                BroadcastTree);
}

Status TcpBackend::Gather(const OpContext& ctx, const void* send, size_t count, DType dtype,
                          int root, const Strategy& strategy, GatherResult* out) {
  const Tree verdict = root < 0 ? Tree{} : strategy.TreeRootedAt(root, group_.size);
  return ::kungfu::Gather(group_, ctx, send, count, dtype, root, verdict, out);
}

}  // namespace kungfu
